"""rollout.engine=vllm_server without vLLM: the payloads and answers (pure functions), a refused prompt, the faults
said in one sentence before any server is needed (no server at start, a port that is not one, a server that stays
unreachable, a sync that hangs past its watchdog), and the one fault vLLM itself cannot be made to produce: a weight
sync that stalls inside the server (`LoopbackServer.stall_updates`, tests/helpers/vllm_loopback.py, the only use of
the loopback stand-in).

Against vLLM itself (its CPU build): the engine, the sync's requests and a server killed mid-run
(tests/integration/test_vllm_real.py), several trainer processes, FSDP2 and ZeRO-3, two servers
(test_vllm_real_launch.py), videos and tool trajectories (test_vllm_video_tools_real.py), two machines
(tests/distributed/test_two_machines.py). The NCCL backend needs CUDA: scripts/gpu_check.py --server-transfer nccl
runs it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.runs import train_run
from helpers.vllm_loopback import LoopbackServer

from gpg_vl.config.schema import RolloutSettings
from gpg_vl.errors import UserError
from gpg_vl.rollout.engine import Sampling
from gpg_vl.rollout.vllm.client import Rejected, Server, ServerGone, split_urls
from gpg_vl.rollout.vllm.server import (
    FINAL_ONLY,
    choice_logps,
    compare_model,
    oldest_version,
    place_features,
    rejected_for_length,
    sampling_params,
    token_runs,
    video_io_kwargs,
    video_render_body,
)
from gpg_vl.rollout.vllm.weight_transfer import SYNC_STALLED_EXIT, transport_unavailable
from gpg_vl.train.checkpoint.folder import latest_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def settings(urls: str, tmp_path, **extra) -> dict:
    return {"urls": urls, "weight_transfer": "disk", "transfer_dir": str(tmp_path / "transfer"), "timeout_s": 2,
            **extra}


def overrides(urls: str, tmp_path, *extra: str) -> list[str]:
    """A run against the servers at urls. Seeded: each request draws from its own seed whichever server and thread
    serves it first, so a run's rewards (and which steps have a group to learn from) never follow the threads'
    order, as they do unseeded."""
    return ["rollout.engine=vllm_server", f"rollout.vllm_server.urls={urls}",
            "rollout.vllm_server.weight_transfer=disk", f"rollout.vllm_server.transfer_dir={tmp_path / 'transfer'}",
            "rollout.vllm_server.seed=1", "rollout.max_new_tokens=40", *extra]


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------------------------
# payloads and answers (pure)
# ---------------------------------------------------------------------------------------------
def test_sampling_params_are_vllms_fields_sampled_as_the_hf_engine(policy):
    family = policy.family
    params = sampling_params(family, Sampling(32, temperature=0.7, top_p=0.9), 8, seed=3)
    assert (params["n"], params["max_tokens"], params["temperature"], params["top_p"], params["top_k"]) == (
        8, 32, 0.7, 0.9, -1)
    assert params["logprobs"] == 0 and params["output_kind"] == FINAL_ONLY and params["seed"] == 3
    assert params["stop_token_ids"] == family.eos_ids and set(params["logit_bias"]) == {
        str(t) for t in family.suppressed_ids}
    turn = sampling_params(family, Sampling(32), 1, stops=True, max_tokens=5)
    assert turn["stop"] == ["</tool_call>"] and turn["include_stop_str_in_output"] and turn["max_tokens"] == 5
    assert sampling_params(family, Sampling(4, greedy=True), 1)["temperature"] == 0.0


def test_image_and_video_features_are_pointed_at_each_ones_run_of_tokens():
    assert token_runs([1, 9, 9, 9, 2, 9, 9, 3], 9) == [{"offset": 1, "length": 3}, {"offset": 5, "length": 2}]
    tokens = {"image": 9, "video": 8}

    def rendered(modality, *items):
        return [{"mm_hashes": {modality: [h]}, "mm_placeholders": {modality: [{"offset": 4, "length": n}]},
                 "kwargs_data": {modality: [h * 2]}} for h, n in items]

    images = rendered("image", ("a", 3), ("b", 2))
    merged = place_features({"image": images, "video": []}, [1, 9, 9, 9, 2, 9, 9, 3], tokens, "http://s")
    assert merged == {"mm_hashes": {"image": ["a", "b"]}, "kwargs_data": {"image": ["aa", "bb"]},
                      "mm_placeholders": {"image": [{"offset": 1, "length": 3}, {"offset": 5, "length": 2}]}}
    with pytest.raises(UserError, match=r"makes 2 tokens of image 0 where the trainer's processor makes 3; start "
                                        r"`vllm serve` with the trainer's min/max pixels"):
        place_features({"image": images[::-1]}, [1, 9, 9, 9, 2, 9, 9, 3], tokens, "http://s")
    assert place_features({"image": [], "video": []}, [1, 2], tokens, "http://s") is None
    ids = [1, 8, 8, 8, 8, 2, 9, 9, 3]  # a video, then an image
    both = place_features({"image": rendered("image", ("i", 2)), "video": rendered("video", ("v", 4))}, ids,
                          tokens, "http://s")
    assert both["mm_placeholders"] == {"image": [{"offset": 6, "length": 2}], "video": [{"offset": 1, "length": 4}]}
    assert both["kwargs_data"] == {"image": ["ii"], "video": ["vv"]}
    with pytest.raises(UserError, match=r"makes 3 tokens of video 0 where the trainer's processor makes 4; start "
                                        r"`vllm serve` with the trainer's video pixel budgets"):
        place_features({"video": rendered("video", ("v", 3))}, ids, tokens, "http://s")
    with pytest.raises(UserError, match=r"2 runs of video tokens for 1 videos .*Qwen3-VL writes frame timestamps"):
        place_features({"video": rendered("video", ("v", 4))}, [8, 8, 5, 8, 8], tokens, "http://s")


def test_a_video_goes_to_render_as_the_trainers_frames_with_its_metadata_in_vllms_fields(policy):
    """The render request of one video (vLLM's ChatCompletionRequest): a `video_url` part holding a `video/jpeg` data
    URL of the trainer's frames (PNG, one per comma), `media_io_kwargs.video` with every frame kept and the
    trainer's metadata, `mm_processor_kwargs.do_sample_frames` false."""
    import base64
    import io

    import numpy as np
    from helpers.video_clips import clip_frames
    from PIL import Image

    messages = [{"role": "user", "content": [{"type": "video", "video": clip_frames(7), "fps": 2},
                                             {"type": "text", "text": "Where does the dot go?"}]}]
    (video,) = policy.family.engine_videos(messages)
    frames, metadata = video
    assert metadata == {"fps": 2.0, "frames_indices": [0, 1, 2, 3, 4, 5, 6, 6], "total_num_frames": 7}
    body = video_render_body("m", video)
    (part,) = body["messages"][0]["content"]
    header, data = part["video_url"]["url"].split(",", 1)
    assert part["type"] == "video_url" and header == "data:video/jpeg;base64"
    sent = np.stack([np.asarray(Image.open(io.BytesIO(base64.b64decode(frame)))) for frame in data.split(",")])
    assert sent.dtype == np.uint8 and torch.equal(torch.from_numpy(sent).permute(0, 3, 1, 2).float(), frames)
    assert body["mm_processor_kwargs"] == {"do_sample_frames": False}
    # 8 frames sent of a 7-frame clip (the last repeated): the total is the count sent and the rate scaled by 8 / 7,
    # so the sampled fps (frames / total x fps) stays the trainer's 16 / 7
    kwargs = body["media_io_kwargs"]["video"]
    assert kwargs == {"num_frames": -1, "fps": pytest.approx(16 / 7), "frames_indices": [0, 1, 2, 3, 4, 5, 6, 6],
                      "total_num_frames": 8, "do_sample_frames": False}
    assert video_io_kwargs({"fps": 8.0, "frames_indices": [0, 4, 9, 13], "total_num_frames": 32}, 4) == {
        "num_frames": -1, "fps": 8.0, "frames_indices": [0, 4, 9, 13], "total_num_frames": 32,
        "do_sample_frames": False}


def test_choices_give_logps_and_the_oldest_weight_version():
    choice = {"token_ids": [5, 6, 7], "logprobs": {"content": [{"token": "token_id:5", "logprob": -0.5},
                                                               {"token": "token_id:6", "logprob": -1.0}]},
              "weight_versions": [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3}]}
    assert choice_logps(choice) == [-0.5, -1.0, 0.0] and oldest_version(choice, 9) == 3
    assert oldest_version({"token_ids": [1]}, 9) == 9 and oldest_version({"weight_versions": []}, 2) == 2


def test_settings_refuse_malformed_urls_and_a_backend_the_trainer_cannot_send_over():
    assert split_urls(" http://a:8000/, http://b:9000 ") == ["http://a:8000", "http://b:9000"]
    with pytest.raises(UserError, match="not an http"):
        split_urls("a:8000")
    nccl = RolloutSettings().vllm_server
    assert "needs a CUDA GPU and the vllm package" in transport_unavailable(nccl, cuda=False, installed=True)
    assert transport_unavailable(nccl, cuda=True, installed=True) is None
    disk = RolloutSettings(vllm_server={"weight_transfer": "disk"}).vllm_server
    assert "needs rollout.vllm_server.transfer_dir" in transport_unavailable(disk, cuda=False, installed=False)
    from gpg_vl.config.compose import load_config

    with pytest.raises(UserError, match="rollout.vllm_server.weight_transfer"):  # checked when the config composes
        load_config("train", ["rollout.vllm_server.weight_transfer=ipc"])
    assert rejected_for_length(Rejected("u", 400, "This model's maximum context length is 10 tokens."))
    assert not rejected_for_length(Rejected("u", 400, "token_ids must be a list"))


def test_a_server_serving_another_model_is_named_with_the_difference(policy):
    config = policy.model.config
    models = {"data": [{"id": "m", "root": "/other", "max_model_len": 100}]}
    other = {"model_config": {"hf_config": {"architectures": ["LlavaForConditionalGeneration"]}}}
    assert "serves /other (LlavaForConditionalGeneration), not the trainer's Qwen2_5_VL" in compare_model(
        "http://s", models, other, config, 50)
    smaller = {"model_config": {"hf_config": {"text_config": {"hidden_size": 7}}}}
    assert "whose hidden_size is 7 where the trainer's model has" in compare_model("http://s", models, smaller,
                                                                                    config, 50)
    assert "--max-model-len 120" in compare_model("http://s", models, None, config, 120)
    assert compare_model("http://s", models, {"model_config": {"hf_config": config.to_dict()}}, config, 50) is None


def test_a_refused_prompt_is_skipped_with_one_warning_naming_it(policy, shapes):
    from gpg_vl.config.schema import TrainerSettings
    from gpg_vl.data.stream import PromptStream
    from gpg_vl.rollout.hf import HFEngine
    from gpg_vl.train.step.sample import sample_attempt

    class Refusing(HFEngine):
        def generate(self, prompts, group_size, sampling):
            rollout = super().generate(prompts, group_size, sampling)
            rollout.rejected, rollout.rejected_reasons = [0], {0: "too long for the server"}
            return rollout

    warnings = []
    stream = PromptStream(shapes.load("train"), seed=0)
    attempt = sample_attempt(policy, shapes, stream, engine=Refusing(policy, RolloutSettings()),
                             trainer=TrainerSettings(batch_size=3, group_size=2), rollout=RolloutSettings(
                                 max_new_tokens=4), warn=warnings.append)
    assert len(attempt.rows) == 2 and attempt.rewards.shape == (2, 2) and attempt.rollout.completion_ids.shape[0] == 4
    (warning,) = warnings
    assert warning.startswith("skipped prompt") and "refused it (too long for the server)" in warning


# ---------------------------------------------------------------------------------------------
# faults in a run
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", ["train", "eval"])
def test_no_server_at_start_is_refused_before_the_model_loads(tmp_path, capsys, no_model, script):
    from gpg_vl.cli import eval_main, train_main
    from gpg_vl.config.compose import run_cli

    typed = overrides("http://127.0.0.1:9", tmp_path, "rollout.vllm_server.timeout_s=0.5")
    code = run_cli(script, train_main if script == "train" else eval_main, [f"output_dir={tmp_path / 'out'}", *typed])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 1
    waiting, error = err.splitlines()  # the wait is said as it starts (after one short try), then its end
    assert waiting == ("waiting up to 0.5 s (rollout.vllm_server.timeout_s) for the vLLM server at "
                       "http://127.0.0.1:9 to answer GET /health ...")
    assert error.startswith("error: no vLLM server answers at http://127.0.0.1:9 (GET /health, for "
                            "rollout.vllm_server.timeout_s=0.5 s); start `vllm serve` there")


@pytest.mark.parametrize("script", ["train", "eval"])
def test_printing_or_checking_a_config_never_contacts_a_server(tmp_path, capsys, monkeypatch, script):
    """`--cfg job` with rollout.engine=vllm_server waited timeout_s (300 s) for a server (issue 59)."""
    from gpg_vl.config.compose import load_config, run_cli

    def contacted(self, route, **kwargs):
        raise AssertionError(f"{self.url}{route} was contacted")

    monkeypatch.setattr(Server, "get", contacted)
    typed = [f"output_dir={tmp_path / 'out'}", *overrides("http://127.0.0.1:8000", tmp_path)]
    cfg = load_config(script, typed)
    assert cfg.rollout.engine == "vllm_server"
    assert run_cli(script, lambda cfg: pytest.fail("ran"), [*typed, "--cfg", "job"]) == 0
    printed = capsys.readouterr()
    assert "vllm_server:" in printed.out and "urls: http://127.0.0.1:8000" in printed.out and printed.err == ""


def test_a_port_outside_1_to_65535_is_refused_as_a_port_at_once(tmp_path, capsys, no_model):
    from gpg_vl.config.compose import run_cli

    for port in ("70000", "0", "http"):
        code = run_cli("train", lambda cfg: pytest.fail("composed"), [f"output_dir={tmp_path / 'out'}", *overrides(
            f"http://127.0.0.1:{port}", tmp_path)])
        err = capsys.readouterr().err
        assert code == 2 and err == (f"error: rollout.vllm_server.urls holds 'http://127.0.0.1:{port}', whose port "
                                     f"{port} is not a port (1-65535); give the port `vllm serve --port` listens "
                                     "on.\n")


@pytest.mark.parametrize("k", [0, 1])
def test_a_stalled_sync_ends_the_run_within_sync_timeout_s_losing_no_step(tmp_path, k):
    stalling = LoopbackServer().start()
    answer = stalling.post

    def post(route, query, body):
        if route == "/pause" and stalling.version == "0":
            stalling.stall_updates = True  # the sync after step 1 never ends on the server's side
        return answer(route, query, body)

    stalling.post = post
    try:  # k = 0: the sync after step 1's update stalls; k = 1: the sampler's, before step 3 (with step 1's weights)
        with pytest.raises(UserError) as error:
            train_run(tmp_path / "out", *overrides(stalling.url, tmp_path, "trainer.max_steps=3",
                                                   f"trainer.max_staleness={k}",
                                                   "rollout.vllm_server.sync_timeout_s=3"))
    finally:
        stalling.stall_updates = False
        stalling.stop()
    done = 1 + k  # the steps whose update ran
    sentence = str(error.value)
    assert re.search(r"did not answer POST /collective_rpc within 2\.4 s \(1 try; last: [^)]*\); check that `vllm "
                     r"serve` is running there and reachable, or raise rollout\.vllm_server\.sync_timeout_s=3 s \(each "
                     rf"request of a weight sync may take 80% of it\); the run stopped after step {done} and wrote "
                     rf"checkpoint-{done}: continue with resume=auto", sentence), sentence
    out = tmp_path / "out"
    assert latest_checkpoint(out).name == f"checkpoint-{done}"  # the steps that ran are kept ...
    assert [m["step"] for m in metrics(out)] == list(range(1, done + 1))  # ... with their lines
    assert (out / "rollouts" / "step-1.json").is_file()  # and rollouts (trainer.log_rollouts_every: step 1 and 10s)


def test_a_sync_that_hangs_past_sync_timeout_s_exits_the_rank_in_one_sentence():
    """What no request timeout can end (a collective that never returns): the watchdog exits the process."""
    code = ("import time\nfrom gpg_vl.rollout.vllm.weight_transfer import Watchdog\n"
            "with Watchdog(0.5, 'the weight sync did not end.', 1):\n    time.sleep(30)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == SYNC_STALLED_EXIT and done.stderr.strip() == "error: rank 1: the weight sync did not end."


def test_a_server_that_is_unreachable_is_retried_until_its_deadline():
    with pytest.raises(ServerGone, match=r"did not answer GET /health within 0\.6 s \(\d+ tries"):
        Server("http://127.0.0.1:9", timeout_s=0.6).get("/health")


def test_a_request_a_server_takes_but_never_answers_is_said_once_while_it_waits(monkeypatch, capsys):
    """A vLLM server whose weight load failed still answers /health but never generates: a teacher's request then
    waited its whole teacher.timeout_s without a word (issue 59). A request unanswered for NOTE_AFTER_S is said once."""
    import socket

    import gpg_vl.rollout.vllm.client as client

    monkeypatch.setattr(client, "NOTE_AFTER_S", 0.3, raising=False)
    with socket.socket() as silent:  # accepts connections (the backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        server = Server(url, timeout_s=1.2)
        with pytest.raises(ServerGone, match=r"did not answer POST /inference/v1/generate within 1\.2 s"):
            server.post("/inference/v1/generate", {}, limit="teacher.timeout_s")
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (f"still waiting for the vLLM server at {url} to answer POST /inference/v1/generate (0.3 s so far, "
                    "up to teacher.timeout_s=1.2 s); a server whose weight load failed still answers /health but "
                    "never generates: restart it.")


def test_a_server_that_cannot_load_the_trainers_weights_is_to_be_restarted():
    from gpg_vl.rollout.vllm.client import ServerError
    from gpg_vl.rollout.vllm.weight_transfer import DiskTransport

    class Refusing(Server):
        def post(self, route, body=None, **named):
            raise Rejected(self.url + route, 500 if route == "/x" else 400, "no weight named lm_head.weight")

    transport = DiskTransport.__new__(DiskTransport)
    transport.timeout_s, transport.limit = 1.0, "rollout.vllm_server.sync_timeout_s"
    with pytest.raises(ServerError) as error:
        transport._reload(Refusing("http://127.0.0.1:9", timeout_s=1.0), Path("/tmp/v1"))
    assert "restart it (after a failed load it still answers /health but generates nothing)" in str(error.value)

def test_every_rank_walks_the_weights_only_rank_0_sends_and_a_failure_reaches_every_rank(tmp_path):
    """push_weights on rank 1 makes no request but walks every weight (gathering them is collective under FSDP2 and
    ZeRO-3); rank 0's failure is what every rank raises (here the collective is the identity)."""
    from gpg_vl.rollout.vllm.client import ServerError
    from gpg_vl.rollout.vllm.weight_transfer import DiskTransport, push_weights

    class Recording(Server):
        def __init__(self, fail: str | None = None) -> None:
            super().__init__("http://recorded", timeout_s=1)
            self.routes, self.fail = [], fail

        def request(self, method, route, body, **kwargs):
            self.routes.append(route)
            if route == self.fail:
                raise ServerGone(f"the vLLM server at {self.url} did not answer POST {route}.")
            return {}

    walked = []

    def weights():
        for name in ("a", "b"):
            walked.append(name)
            yield name, torch.ones(2)

    settings_ = RolloutSettings(vllm_server=settings("http://x", tmp_path)).vllm_server
    follower = Recording()
    push_weights([follower], DiskTransport(settings_, rank=1), weights(), version=3, pause_mode="wait",
                 collective=lambda failure: failure)
    assert follower.routes == [] and walked == ["a", "b"]
    leader = Recording(fail="/collective_rpc")
    with pytest.raises(ServerGone, match="did not answer POST /collective_rpc"):
        push_weights([leader], DiskTransport(settings_, rank=0), weights(), version=3, pause_mode="wait",
                     collective=lambda failure: failure)
    assert leader.routes == ["/pause?mode=wait", "/collective_rpc"]
    with pytest.raises(ServerError, match="rank 0 failed"):  # rank 0's sentence, on a rank whose own sync went well
        push_weights([Recording()], DiskTransport(settings_, rank=1), weights(), version=4, pause_mode="wait",
                     collective=lambda failure: ("error", "rank 0 failed"))


def test_videos_the_server_engine_cannot_place_are_refused_in_one_sentence():
    """Qwen3-VL and Qwen3.5 write a timestamp between a video's frame pairs (several runs of video tokens per video);
    the generic families hand no engine their videos."""
    from types import SimpleNamespace

    from gpg_vl.models.qwen import Qwen3_5Family, Qwen3VLFamily, QwenVLFamily
    from gpg_vl.rollout.vllm.server import VLLMServerEngine

    assert Qwen3VLFamily.video_times_in_text and Qwen3_5Family.video_times_in_text
    assert not QwenVLFamily.video_times_in_text
    engine = VLLMServerEngine.__new__(VLLMServerEngine)
    video = (torch.zeros(2, 3, 28, 28), {"fps": 2.0, "frames_indices": [0, 1], "total_num_frames": 2})
    engine.tokens = {"image": 1, "video": 2}
    engine.family = SimpleNamespace(name="qwen3_vl", engine_videos=lambda messages: [video], video_times_in_text=True,
                                    engine_takes_video=True)
    with pytest.raises(UserError, match=r"^the qwen3_vl family writes frame timestamps between a video's tokens, "
                                        r"which a vLLM server \(rollout.engine=vllm_server, teacher.urls\) does not "
                                        r"take yet; use"):
        engine._videos([])
    engine.family = SimpleNamespace(name="glm4v", engine_videos=lambda messages: [video], video_times_in_text=False,
                                    engine_takes_video=False)
    with pytest.raises(UserError, match=r"^the glm4v family's videos do not go through a vLLM server"):
        engine._videos([])
