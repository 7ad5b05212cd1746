"""rollout.engine=vllm_server against vLLM itself (its CPU build) with several trainer processes and several servers:

- 2 trainer processes of one machine (accelerate's environment, helpers/launch.py) sharing the test run's server,
  synchronous and one step behind, and under FSDP2 and DeepSpeed ZeRO-3 (every sync gathers the sharded weights);
- one trainer against two servers (the data-parallel split over two URLs): request i to server (rank + i) mod 2, a
  prompt too long for one server refused by that server alone, every sync reaching both.

Two "machines" launched for real against the same server: tests/distributed/test_two_machines.py, which compares
with the 2-process run here (`two_process_run`). Skipped, with the reason, where the vLLM environment is absent."""

from __future__ import annotations

import json

import pytest
from helpers.launch import WORKER, launch, require_deepspeed
from helpers.runs import train_run
from helpers.vllm_real import (
    TINY,
    TWO_PROCESSES,
    RealServer,
    metrics,
    needs_vllm_env,
    recorded_requests,
    request,
    run_overrides,
    server_lock,
    shared_server,
    two_process_run,
)

from gpg_vl.config.schema import RolloutSettings
from gpg_vl.rollout.engine import Sampling, build_engine, encode_prompts

pytestmark = needs_vllm_env


@pytest.mark.slow
def test_two_trainer_processes_share_one_server_and_both_take_part_in_every_sync(tmp_path_factory):
    """Synchronous: both processes send their prompts (the groups counted over both), step n is sampled by the
    weights after step n - 1 (rank 0 sends them, every rank walks them), the sampler's log-probs are the trainer's,
    and the server ends on the last step's weights."""
    reference = two_process_run(tmp_path_factory)
    lines = metrics(reference / "run")
    assert [m["step"] for m in lines] == [1, 2, 3] and all(m["groups_sampled"] == 4 for m in lines)
    assert [m["rollout_weight_version"] for m in lines] == [0, 1, 2]
    assert all(m["logp_mismatch_mean"] < 1e-4 for m in lines)
    assert (reference / "server-version").read_text() == "3"


@pytest.mark.slow
def test_two_trainer_processes_one_step_behind_sync_the_server_from_their_samplers(tmp_path_factory, tmp_path):
    """trainer.max_staleness=1: each process's sampler thread syncs the server by the schedule (step 3: the weights
    after step 1), on the samplers' own process group beside the learners' gradient all-reduce."""
    url = shared_server(tmp_path_factory)
    out = tmp_path / "out"
    with server_lock(tmp_path_factory):
        launch("scripts/train.py", f"output_dir={out}",
               *run_overrides(url, tmp_path / "transfer", "trainer.max_steps=3", "trainer.max_staleness=1",
                              *TWO_PROCESSES))
        version = request(url, "/weight_info")["weight_version"]
    lines = metrics(out)
    assert all(m["groups_sampled"] == 4 for m in lines)
    assert [m["rollout_weight_version"] for m in lines] == [0, 0, 1] and lines[0]["logp_mismatch_mean"] < 1e-4
    assert [m["version_lag_max"] for m in lines] == [0, 1, 1] and version == "3"  # the learner's last pushed at the end


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["fsdp", "zero3"])
def test_sharded_trainers_gather_their_weights_for_every_sync(engine, tmp_path_factory, tmp_path):
    """FSDP2 and DeepSpeed ZeRO-3 on 2 trainer processes against the server: every sync gathers the sharded weights
    (collective: both ranks walk them, rank 0 sends), so the server samples each step with exactly the trainer's
    weights (its log-probs are the trainer's)."""
    if engine == "zero3":
        require_deepspeed()
    url = shared_server(tmp_path_factory)
    out = tmp_path / "out"
    with server_lock(tmp_path_factory):
        launch(str(WORKER), "train", str(out), "--engine", engine, "--no-resume", "--",
               *run_overrides(url, tmp_path / "transfer", "trainer.max_steps=2", *TWO_PROCESSES),
               config="zero3.yaml" if engine == "zero3" else None)
    assert json.loads((out / "rank0.json").read_text())["engine"] == (
        "DistributedType.FSDP" if engine == "fsdp" else "DistributedType.DEEPSPEED")
    lines = metrics(out / "a")
    assert [m["rollout_weight_version"] for m in lines] == [0, 1]
    assert all(m["logp_mismatch_mean"] < 1e-4 for m in lines)


@pytest.mark.slow
def test_two_servers_split_the_prompts_refuse_what_one_cannot_hold_and_follow_every_sync(policy, shapes,
                                                                                       tmp_path_factory, tmp_path):
    """The test run's server (--max-model-len 2048) and a second one (1536). Prompt i goes to server i mod 2: the
    long prompts (about 1700 tokens) reach the shorter server, which refuses them (the prompts are skipped, the
    others sampled); a 2-step run against both sends each its share, syncs both every step (their log-probs stay
    the trainer's) and leaves both on the same weights."""
    url = shared_server(tmp_path_factory)
    second = RealServer(TINY, tmp_path / "second.log", max_model_len=1536).wait()
    try:
        with server_lock(tmp_path_factory):
            urls = f"{url},{second.url}"
            settings = {"urls": urls, "weight_transfer": "disk", "transfer_dir": str(tmp_path / "transfer")}
            engine = build_engine(RolloutSettings(engine="vllm_server", max_prompt_tokens=1024, max_new_tokens=8,
                                                  vllm_server=settings), policy)
            rows = shapes.load("train")[:4]
            messages = [shapes.messages(row) for row in rows]
            for k in (1, 3):
                messages[k][-1]["content"] = [*messages[k][-1]["content"], {"type": "text", "text": " word" * 1600}]
            prompts = encode_prompts(policy, messages, ids=list("abcd"))
            result = engine.generate(prompts, 2, Sampling(max_new_tokens=8))
            assert result.rejected == [1, 3], result.rejected_reasons
            assert "longer than the maximum model length of 1536" in result.rejected_reasons[1]
            assert result.completion_mask[[0, 1, 4, 5]].any(dim=1).all()  # prompts 0 and 2 sampled
            with recorded_requests() as calls:
                train_run(tmp_path / "out", *run_overrides(f'"{urls}"', tmp_path / "run-transfer",
                                                           "trainer.max_steps=2", "trainer.lr=1e-3"))
            versions = [request(u, "/weight_info")["weight_version"] for u in (url, second.url)]
            sums = [request(u, "/weight_checker", {"action": "checksum"})["checksums"] for u in (url, second.url)]
    finally:
        second.kill()
    for server in (url, second.url):
        assert sum(1 for u, _, route, _ in calls if u == server and route == "/inference/v1/generate") >= 2
    assert versions == ["2", "2"] and sums[0] == sums[1]
    assert all(m["logp_mismatch_mean"] < 1e-4 for m in metrics(tmp_path / "out"))
    assert [m["rollout_weight_version"] for m in metrics(tmp_path / "out")] == [0, 1]
