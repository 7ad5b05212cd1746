"""Several processes on CPU (gloo): the launch, equal weights for 1 and 2 processes, no hangs, checkpoints
written once and resumed exactly, FSDP2, and the shipped accelerate configs.

The processes (tests/distributed/distributed_worker.py holds their code) get the environment `accelerate launch`
gives them, computed by accelerate's own launcher code, and torchrun's rank variables; they are forked from a
server that has imported torch and transformers once (tests/helpers/procs.py: a fresh interpreter costs each rank
about 10 s of CPU before its first line). The test of a failed save runs `accelerate launch` itself (torchrun's
agent and its failure report). Every launch has a timeout, and the workers give gloo a 120 s collective timeout,
so a hang fails a test.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import procs
from helpers.launch import (
    CONFIGS,
    LAUNCH,
    WORKER,
    free_port,
    launch,
    launch_env,
    launch_environment,
    require_deepspeed,
)
from helpers.once import once
from helpers.runs import untimed
from helpers.scoring import token_logps
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
CASES = ("even", "uneven", "one_without_valid", "one_without_prompts", "entropy_uneven")
TINY_RUN = ["trainer.batch_size=4", "trainer.group_size=4", "trainer.micro_batch_size=6", "rollout.max_new_tokens=16",
            "trainer.lr=1e-3", "task.options.train_size=64", "task.options.test_size=8", "trainer.save_every=1",
            "trainer.keep_checkpoints=3"]


def one_process(*arguments: str) -> None:
    done = procs.run(list(arguments), env=launch_env(), timeout=900)
    assert done.returncode == 0, done.stderr[-6000:]


def metrics_lines(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def without_timing(metrics: dict) -> dict:
    return untimed(metrics)


def assert_same_weights(first: Path, second: Path) -> None:
    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("name", ["ddp", "fsdp", "fsdp_offload", "zero2", "zero3", "zero3_offload"])
def test_accelerate_config_loads_into_its_plugin(name, monkeypatch):
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin

    environment = launch_environment(CONFIGS / f"{name}.yaml")
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    assert environment["ACCELERATE_MIXED_PRECISION"] == "bf16"
    if name == "ddp":
        assert "ACCELERATE_USE_FSDP" not in environment and "ACCELERATE_USE_DEEPSPEED" not in environment
    elif name.startswith("fsdp"):
        plugin = FullyShardedDataParallelPlugin()
        assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
        assert plugin.state_dict_type.name == "FULL_STATE_DICT"
        from torch.distributed.fsdp import CPUOffloadPolicy

        assert isinstance(plugin.cpu_offload, CPUOffloadPolicy) == (name == "fsdp_offload")
    else:
        plugin = DeepSpeedPlugin()
        stage = int(name[4])
        assert plugin.zero_stage == stage and plugin.deepspeed_config["zero_optimization"]["stage"] == stage
        assert plugin.deepspeed_config["gradient_clipping"] == 1.0
        assert plugin.deepspeed_config["gradient_accumulation_steps"] == 1
        if stage == 3:  # the trainer saves gathered weights: accelerate refuses without this flag
            assert plugin.deepspeed_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"]


@pytest.mark.parametrize("name", ["zero2", "zero3", "zero3_offload"])
def test_deepspeed_parses_the_zero_configs(name, monkeypatch):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install deepspeed)")
    from accelerate.utils import DeepSpeedPlugin
    from deepspeed.runtime.config import DeepSpeedConfig

    for key, value in launch_environment(CONFIGS / f"{name}.yaml").items():
        monkeypatch.setenv(key, value)
    config = dict(DeepSpeedPlugin().deepspeed_config)
    config.pop("train_batch_size")
    config.update(train_micro_batch_size_per_gpu=1, bf16={"enabled": True})  # what training fills in
    parsed = DeepSpeedConfig(config)
    assert parsed.zero_optimization_stage == int(name[4]) and parsed.gradient_clipping == 1.0


# ---------------------------------------------------------------------------------------------
# in one process: the pieces that keep processes in step
# ---------------------------------------------------------------------------------------------
def test_placeholder_micro_batch_reaches_every_parameter_with_a_zero_gradient(policy):
    """A process without data runs a blank-image sequence: every parameter, the vision tower's included,
    takes part in the backward (DDP reduces them all; FSDP / ZeRO-3 gather them all), and none moves."""
    from gpg_vl.train.step.placeholder import placeholder_chunk

    prompts, prompt_index, ids, mask, _ = placeholder_chunk(policy, [], torch.device("cpu"))
    assert "pixel_values" in prompts.inputs
    logps = token_logps(policy.family, policy.model, prompts, prompt_index, ids, mask)  # [1, 1]
    (torch.where(mask, logps, torch.zeros_like(logps)).sum() * 0.0).backward()
    untouched = [n for n, p in policy.model.named_parameters() if p.grad is None]
    assert not untouched
    assert all(float(p.grad.abs().max()) == 0.0 for p in policy.model.parameters())


def test_several_processes_need_an_image_in_every_batch():
    from gpg_vl.distributed import require_images
    from gpg_vl.errors import UserError

    require_images(True, 2, "a batch")
    require_images(False, 1, "a batch")  # one process: text-only batches are fine
    with pytest.raises(UserError, match="a batch holds no image, and training on 2 processes needs one"):
        require_images(False, 2, "a batch")


# ---------------------------------------------------------------------------------------------
# the 2-process launch: metrics, checkpoints, resume
# ---------------------------------------------------------------------------------------------
TWO_STEPS = ["trainer.max_steps=2", "eval.limit=5", "eval.batch_size=2", *TINY_RUN]  # evaluated before and after
DDP_RUN = [*TWO_STEPS, "trainer.beta_th=0.5"]


@pytest.fixture(scope="module")
def ddp_launch(tmp_path_factory) -> Path:
    """The update cases (test_two_process_update_gives_the_one_process_weights), then scripts/train.py's 2 steps
    into a/, in one launch of configs/accelerate/ddp.yaml, once per test run (helpers/once.py)."""
    def make(out: Path) -> None:
        output = launch(str(WORKER), "update", str(out / "update"), "++", "record", str(out / "views"), "--",
                        "scripts/train.py", f"output_dir={out / 'a'}", *DDP_RUN, config="ddp.yaml")
        (out / "output.txt").write_text(output)

    return once(tmp_path_factory, "ddp", make)


@pytest.mark.slow
def test_two_process_launch_logs_global_metrics_saves_once_and_resumes_exactly(ddp_launch, tmp_path):
    first, second, views = ddp_launch / "a", tmp_path / "b", tmp_path / "views"
    assert "accuracy before:" in (ddp_launch / "output.txt").read_text()
    lines = metrics_lines(first)
    assert [m["step"] for m in lines] == [1, 2]  # one line per step: only the main process writes
    for m in lines:  # counts over both processes: B prompts per attempt, not B / 2
        assert m["groups_sampled"] == 4 * m["attempts"] and len(m["valid_fractions"]) == m["attempts"]
    assert {p.name for p in first.iterdir() if p.is_dir()} == {"checkpoint-1", "checkpoint-2", "final", "rollouts"}
    logged = json.loads((first / "rollouts" / "step-1.json").read_text())  # step 1 (then every 10): the main
    assert sorted(p.name for p in (first / "rollouts").glob("*.json")) == ["step-1.json"]  # process's own share
    assert logged["groups_per_attempt"] == [2] * lines[0]["attempts"]

    # Resume from step 1, each process observed: what it computed, and whether it saved. Launched with
    # the FSDP config, which accelerate 1.15 turns on for GPUs only: on CPU it keeps data parallelism.
    output = launch(str(WORKER), "record", str(views), "--", "scripts/train.py", f"output_dir={second}",
                    f"resume={first / 'checkpoint-1'}", *DDP_RUN, config="fsdp.yaml")
    assert "the launch asked for FSDP, but accelerate runs MULTI_CPU" in output
    rank0, rank1 = (json.loads((views / f"rank{r}.json").read_text()) for r in (0, 1))
    assert (rank0["saves"], rank1["saves"]) == (2, 0)  # checkpoint-2 and final, by the main process only
    for key in ("collected", "step_metrics", "update"):  # every global number is the same on both
        assert rank0[key] == rank1[key] and len(rank0[key]) == 1, key
    (logged,) = metrics_lines(second)
    collected = rank0["collected"][0]
    assert logged["groups_sampled"] == collected["groups_sampled"]
    assert logged["groups_used"] == collected["groups_valid"]
    assert logged["valid_fractions"] == collected["valid_fractions"]
    assert logged["alpha"] == collected["groups_sampled"] / collected["groups_valid"]
    assert {k: logged[k] for k in rank0["step_metrics"][0]} == rank0["step_metrics"][0]
    assert {k: logged[k] for k in rank0["update"][0]} == rank0["update"][0]
    # the resumed run continues exactly: same step-2 line, same final weights
    assert without_timing(logged) == without_timing(lines[1])
    assert_same_weights(first / "final", second / "final")


ASYNC_RUN = ["trainer.max_steps=3", "trainer.max_staleness=1", "trainer.eval_before=false", "trainer.eval_after=false",
             "trainer.beta_th=0.5", *TINY_RUN]


@pytest.fixture(scope="module")
def async_ddp(tmp_path_factory) -> Path:
    """3 steps at trainer.max_staleness=1 on 2 processes (configs/accelerate/ddp.yaml) into a/, each process's
    view in views/, once per test run."""
    def make(out: Path) -> None:
        launch(str(WORKER), "record", str(out / "views"), "--", "scripts/train.py", f"output_dir={out / 'a'}",
               *ASYNC_RUN, config="ddp.yaml")

    return once(tmp_path_factory, "async-ddp", make)


@pytest.mark.slow
def test_k1_under_ddp_samples_each_share_with_global_counts_and_resumes_a_step_in_flight(async_ddp, tmp_path):
    """trainer.max_staleness=1 on 2 processes: each samples its share on its own sampler thread, the counts of
    threshold resampling are global (the same on both, B prompts per attempt), the schedule's lag holds, and a run
    resumed from checkpoint-2 (step 3 in flight, regenerated from each process's saved sampler state) samples step
    3 again exactly on each process and ends on the uninterrupted run's weights with the same step-3 line."""
    first, second, views = async_ddp / "a", tmp_path / "b", async_ddp / "views"
    lines = metrics_lines(first)
    assert [m["version_lag_max"] for m in lines] == [0, 1, 1]  # step n samples with the weights after n - 2
    for m in lines:
        assert m["groups_sampled"] == 4 * m["attempts"]
    rank0, rank1 = (json.loads((views / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0["collected"] == rank1["collected"] and len(rank0["collected"]) == 3  # counted over both
    assert [c["groups_sampled"] for c in rank0["collected"]] == [m["groups_sampled"] for m in lines]
    assert rank0["update"] == rank1["update"]
    assert rank0["sampled"] != rank1["sampled"]  # each its own share
    again = tmp_path / "again"
    launch(str(WORKER), "record", str(again), "--", "scripts/train.py", f"output_dir={second}",
           f"resume={first / 'checkpoint-2'}", *ASYNC_RUN, config="ddp.yaml")
    (resumed,) = metrics_lines(second)
    assert without_timing(resumed) == without_timing(lines[2])
    for rank, before in ((0, rank0), (1, rank1)):  # step 3 sampled again by each process exactly as before
        assert json.loads((again / f"rank{rank}.json").read_text())["sampled"] == before["sampled"][2:], rank
    assert_same_weights(first / "final", second / "final")


@pytest.mark.slow
def test_k1_under_fsdp2_gathers_the_samplers_weights_and_trains_as_under_ddp(async_ddp, tmp_path):
    """FSDP2 at trainer.max_staleness=1 on 2 processes: each sampler holds a whole copy of the model taken before
    sharding, and the learner's snapshots are gathered from the shards. The run samples what the DDP run samples
    (step 3 with the weights after step 1: the same losses) and ends near its weights (FSDP's reduce-scatter sums
    in another order, and AdamW turns those last bits into up to 1e-4 after 3 steps of lr 1e-3). (A resume with a
    step in flight is the DDP test's: the in-flight weights are whole tensors under FSDP2 too.)"""
    out = tmp_path / "fsdp"
    launch(str(WORKER), "train", str(out), "--engine", "fsdp", "--no-resume", "--", *ASYNC_RUN)
    assert json.loads((out / "rank0.json").read_text())["engine"] == "DistributedType.FSDP"
    ours, ddp = metrics_lines(out / "a"), metrics_lines(async_ddp / "a")
    assert [m["version_lag_max"] for m in ours] == [0, 1, 1]
    assert [m["groups_sampled"] for m in ours] == [m["groups_sampled"] for m in ddp]
    # step 3's loss is of weights AdamW moved apart by FSDP's other summation order (up to 1e-4 after 3 steps, the
    # weights' atol below): measured 4.3e-5 relative on AMD EPYC (abs 1e-6 held where it was written); a wrong
    # gather is far off
    assert [m["loss"] for m in ours] == pytest.approx([m["loss"] for m in ddp], rel=2e-4, abs=1e-6)
    a, b = load_file(out / "a" / "final" / "model.safetensors"), load_file(async_ddp / "a" / "final" /
                                                                           "model.safetensors")
    assert all(torch.allclose(a[name], b[name], atol=5e-4) for name in b)


# ---------------------------------------------------------------------------------------------
# equal weights: a fixed set of rollouts, updated on 1 and on 2 processes
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_process_update(tmp_path_factory) -> Path:
    return once(tmp_path_factory, "update-1", lambda out: one_process(str(WORKER), "update", str(out)))


# How far the metrics every process logs may be from one process's, relative, at the first update and after it.
# The first update scores the same weights: only the float order of the forward (other batch shapes) and of the
# sums differs (measured on AMD EPYC: at most 4e-6, the loss's). The second scores weights the first step already
# moved apart by its gradient's float order (the weights below are compared at rtol 1e-5), which a step of lr 0.1
# on gradients of norm 11 amplifies: measured on AMD EPYC, loss 1.2e-5 (abs 1.9e-7), grad_norm 6.7e-6,
# entropy_mean 1.9e-6 (7.9e-6 here and 1.3e-5 on another AMD EPYC, issue 59, before the entropy was summed from
# terms >= 0: models/logits.py); 5e-5 leaves room for another processor's kernels.
METRIC_REL = (1e-5, 5e-5)
# How far a weight may be from one process's, in units of the largest change the update made to any weight: two SGD
# steps of lr 0.1 on float32 gradients, each summed over the micro-batches and processes in another order (and the
# second taken at weights the first already moved apart). Measured on AMD EPYC: up to 1.1e-5 of the largest change
# (8.9e-7 against 0.083, `uneven`), which the former atol 1e-6 held by a factor of 1.3 only; a wrong scale or a
# missing share moves weights by a sizeable fraction of it.
WEIGHT_ATOL = 1e-4


def assert_update_matches(reference: Path, out: Path, engine: str, cases: tuple[str, ...] = CASES) -> None:
    rank0, rank1 = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    single = json.loads((reference / "rank0.json").read_text())
    assert (single["world"], rank0["world"], rank0["engine"]) == (1, 2, engine)
    assert set(cases) <= set(rank0["cases"])  # the worker ran (at least) the cases compared
    for case in cases:
        one, two = torch.load(reference / f"{case}.pt"), torch.load(out / f"{case}.pt")
        print(f"{engine} {case}: sha256 1 process {single['cases'][case]['sha256']}, "
              f"2 processes {rank0['cases'][case]['sha256']}")
        assert set(one) == set(two)
        moved = single["cases"][case]["largest_change"]
        for name in one:
            torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=WEIGHT_ATOL * moved, msg=f"{case} {name}")
        # the update did change the weights, so equal weights mean something
        assert moved > 1e-3, case
        # the metrics every process logs are the same on both, and equal to one process's
        assert rank0["cases"][case]["metrics"] == rank1["cases"][case]["metrics"], case
        for step, (mine, theirs) in enumerate(zip(rank0["cases"][case]["metrics"], single["cases"][case]["metrics"],
                                                  strict=True)):
            assert mine.keys() == theirs.keys()
            for key in mine:  # the loss sums terms of both signs (advantages have zero mean): absolute error
                assert mine[key] == pytest.approx(theirs[key], rel=METRIC_REL[min(step, 1)], abs=1e-6), (case, key)


@pytest.mark.slow
def test_two_process_update_gives_the_one_process_weights(one_process_update, ddp_launch):
    """Also when the processes hold different numbers of valid groups, none, or no prompt at all."""
    out = ddp_launch / "update"
    assert_update_matches(one_process_update, out, "DistributedType.MULTI_CPU")
    for case in CASES:  # DDP keeps the replicas identical, bit for bit
        shas = {json.loads((out / f"rank{r}.json").read_text())["cases"][case]["sha256"] for r in (0, 1)}
        assert len(shas) == 1, case


# ---------------------------------------------------------------------------------------------
# FSDP2 on CPU: one launch for its three checks
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fsdp_launch(tmp_path_factory) -> Path:
    """The update cases with FSDP2, again with its CPU offload, then a run and its resume, in one launch of 2
    processes (starting them costs as much as a job: the suite's time on 2 cores), once per test run."""
    def make(out: Path) -> None:
        launch(str(WORKER), "update", str(out / "update"), "--engine", "fsdp",
               "++", "update", str(out / "offload"), "--engine", "fsdp_offload",
               "++", "train", str(out / "train"), "--engine", "fsdp", "--", *TWO_STEPS)

    return once(tmp_path_factory, "fsdp", make)


@pytest.mark.slow
def test_fsdp_update_gives_the_one_process_weights(one_process_update, fsdp_launch):
    """FSDP2 gathers weights inside every forward: a process with no valid group, or no prompt, must still
    run every module (placeholder micro-batches), or this launch would hang."""
    assert_update_matches(one_process_update, fsdp_launch / "update", "DistributedType.FSDP")
    rank0 = json.loads((fsdp_launch / "update" / "rank0.json").read_text())
    assert rank0["offload"] == ["OffloadPolicy"]  # none
    assert rank0["reference_sharded"]  # the GRPO case's frozen reference is sharded like the policy


@pytest.mark.slow
def test_fsdp_with_cpu_offload_update_gives_the_one_process_weights(one_process_update, fsdp_launch):
    """configs/accelerate/fsdp_offload.yaml: the sharded parameters, gradients and AdamW step on CPU."""
    assert_update_matches(one_process_update, fsdp_launch / "offload", "DistributedType.FSDP")
    assert json.loads((fsdp_launch / "offload" / "rank0.json").read_text())["offload"] == ["CPUOffloadPolicy"]


@pytest.mark.slow
def test_fsdp_trains_evaluates_saves_and_resumes_exactly(fsdp_launch):
    """Rollouts, evaluation (5 rows on 2 processes: one makes a placeholder call), update, checkpoints,
    and a resume from step 1 that ends on the same weights (optimizer state gathered and re-sharded)."""
    out = fsdp_launch / "train"
    result = json.loads((out / "rank0.json").read_text())
    assert result["engine"] == "DistributedType.FSDP"
    assert result["a"]["accuracy_before"] is not None and result["a"]["accuracy_after"] is not None
    first, second = metrics_lines(out / "a"), metrics_lines(out / "b")
    assert [m["step"] for m in first] == [1, 2] and [m["step"] for m in second] == [2]
    assert without_timing(second[0]) == without_timing(first[1])
    assert_same_weights(out / "a" / "final", out / "b" / "final")


# ---------------------------------------------------------------------------------------------
# DeepSpeed ZeRO-2 / ZeRO-3 on CPU
# ---------------------------------------------------------------------------------------------
# `accelerate launch --config_file configs/accelerate/zero<N>.yaml` takes the DeepSpeed branch on a CPU machine
# when the Accelerator is made without cpu=True and with the gloo backend named (the trainer does so:
# _command_line_accelerator; the worker too). DeepSpeed then runs on its CPU accelerator, and builds its
# shared-memory communication op with the machine's C++ compiler on first use (cached in ~/.cache/torch_extensions).
DEEPSPEED_CASES = ("uneven", "one_without_prompts")  # uneven valid groups, an empty attempt, a placeholder process
DEEPSPEED_TRAIN = ["trainer.max_steps=2", "trainer.eval_before=false", "trainer.eval_after=false", *TINY_RUN]


def deepspeed_launch(out: Path, config: str, *, update: bool, algorithm: str | None) -> Path:
    """Under configs/accelerate/<config>.yaml, in one launch of 2 processes: the update cases (when `update`), and
    a run of `algorithm` and its resume from step 1 (when one is named)."""
    require_deepspeed()
    jobs = []
    if update:
        jobs += ["update", str(out / "update"), "--engine", config, "--cases", ",".join(DEEPSPEED_CASES)]
    if algorithm:
        jobs += [*(["++"] if jobs else []), "train", str(out / "train"), "--engine", config, "--",
                 f"algorithm={algorithm}", *DEEPSPEED_TRAIN, *(["trainer.beta_th=0.5"] if algorithm == "grpo" else []),
                 *(["trainer.max_staleness=1"] if config == "zero2" else [])]
    launch(str(WORKER), *jobs, config=f"{config}.yaml")
    return out


@pytest.fixture(scope="module")
def zero2_launch(tmp_path_factory) -> Path:
    return once(tmp_path_factory, "zero2", lambda out: deepspeed_launch(out, "zero2", update=True, algorithm="grpo"))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_update_gives_the_one_process_weights(stage, one_process_update, request):
    """ZeRO-2 (gradients and optimizer state sharded) and ZeRO-3 (weights too, gathered module by module in
    every forward: a process without prompts runs placeholders) on 2 CPU processes: the one-process weights.
    The worker turns DeepSpeed's gradient clipping off (plain SGD, as the one process runs it)."""
    launched = request.getfixturevalue(f"zero{stage}_launch")
    assert_update_matches(one_process_update, launched / "update", "DistributedType.DEEPSPEED", cases=DEEPSPEED_CASES)


@pytest.mark.slow
@pytest.mark.parametrize("config", ["zero2", "zero3_offload"])
def test_deepspeed_trains_saves_and_resumes_exactly(config, request, tmp_path):
    """ZeRO-2 and ZeRO-3 on 2 CPU processes: a run resumed from step 1 ends on the same weights and logs the same
    step-2 metrics as the run it continues: each process's partition of the ZeRO optimizer state (AdamW's moments)
    is saved by the engine into the checkpoint and loaded back. ZeRO-2 trains GRPO (its KL reference is a plain
    frozen copy there, 0 at the first step, positive after; ZeRO-3's is an engine: the checkpoint test below) one
    step behind (trainer.max_staleness=1: ZeRO-1/2 keep whole weights, so each process's sampler copies them as
    under DDP; the resume regenerates step 2, in flight at checkpoint-1);
    ZeRO-3 runs through configs/accelerate/zero3_offload.yaml with GPG (the ZeRO-3 partitioning, and parameters and
    optimizer state in CPU memory: accelerate swaps the AdamW for DeepSpeedCPUAdam, whose op DeepSpeed compiles on
    first use)."""
    launched = request.getfixturevalue("zero2_launch") if config == "zero2" else \
        deepspeed_launch(tmp_path, config, update=False, algorithm="gpg")
    out = launched / "train"
    rank0, rank1 = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0["engine"] == rank1["engine"] == "DistributedType.DEEPSPEED"
    # checkpoint-1, -2 and final by the main process only; the resumed run writes checkpoint-2 and final
    assert (rank0["saves"], rank1["saves"]) == ({"a": 3, "b": 2}, {"a": 0, "b": 0})
    assert sorted(p.name for p in (out / "a" / "checkpoint-1" / "zero" / "zero").glob("*optim_states.pt")) \
        == [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]
    first, second = metrics_lines(out / "a"), metrics_lines(out / "b")
    assert [m["step"] for m in first] == [1, 2] and [m["step"] for m in second] == [2]
    assert without_timing(second[0]) == without_timing(first[1])
    assert_same_weights(out / "a" / "final", out / "b" / "final")
    if config == "zero2":
        assert first[0]["kl"] == pytest.approx(0.0, abs=1e-6) and first[1]["kl"] > 0
        assert [m["version_lag_max"] for m in first] == [0, 1]


@pytest.fixture(scope="module")
def zero3_launch(tmp_path_factory) -> Path:
    """Under configs/accelerate/zero3.yaml, in one launch of 2 processes (once per test run): the update cases, then
    scripts/train.py algorithm=grpo for 2 steps into run/, each process observed (views/)."""
    require_deepspeed()

    def make(out: Path) -> None:
        launch(str(WORKER), "update", str(out / "update"), "--engine", "zero3", "--cases", ",".join(DEEPSPEED_CASES),
               "++", "record", str(out / "views"), "--", "scripts/train.py", f"output_dir={out / 'run'}",
               "algorithm=grpo", "trainer.beta_th=0.5", *DEEPSPEED_TRAIN, config="zero3.yaml")

    return once(tmp_path_factory, "zero3", make)


@pytest.mark.slow
def test_zero3_final_checkpoint_reloads_with_transformers_alone(zero3_launch):
    """scripts/train.py algorithm=grpo under configs/accelerate/zero3.yaml (the model and the KL's reference
    loaded partitioned, zero3_init_flag) on 2 CPU processes, 2 steps: final/ is written through the gathered
    16-bit state dict (zero3_save_16bit_model; the weights are float32 here) and reloads with transformers alone,
    equal to the trained weights (each parameter gathered before the save, by the worker)."""
    from transformers import AutoModelForImageTextToText

    run, views = zero3_launch / "run", zero3_launch / "views"
    lines = metrics_lines(run)
    assert sum(m["groups_used"] for m in lines) > 0  # some step had valid groups: the weights moved
    # GRPO's KL scores the frozen reference, loaded partitioned like the policy: it runs as a DeepSpeed engine
    # (place_reference), and the policy drifts from it after the first step
    assert lines[0]["kl"] == pytest.approx(0.0, abs=1e-6) and lines[-1]["kl"] > 0
    rank0, rank1 = (json.loads((views / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0["engine"] == rank1["engine"] == "DistributedType.DEEPSPEED"
    assert (rank0["saves"], rank1["saves"]) == (3, 0)  # checkpoint-1, -2 and final, by the main process only
    trained = torch.load(views / "trained-run.pt")
    # named as the shipped checkpoint names them (not transformers' ZeRO-3 legacy model.model.embed_tokens): an
    # engine (vLLM) loads them
    shipped = set(load_file(ROOT / "gpg_vl" / "assets" / "tiny-qwen2.5-vl" / "model.safetensors"))
    assert set(load_file(run / "final" / "model.safetensors")) <= shipped | {"lm_head.weight"}
    loaded = dict(AutoModelForImageTextToText.from_pretrained(run / "final", dtype=torch.float32).named_parameters())
    initial = dict(AutoModelForImageTextToText.from_pretrained(ROOT / "gpg_vl" / "assets" / "tiny-qwen2.5-vl",
                                                               dtype=torch.float32).named_parameters())
    assert set(loaded) == set(trained)
    for name in trained:
        torch.testing.assert_close(loaded[name], trained[name], rtol=1e-5, atol=1e-6, msg=name)
    assert max(float((trained[k] - initial[k].detach()).abs().max()) for k in trained) > 1e-4  # the steps moved them


def test_a_bad_deepspeed_value_fails_in_one_sentence_naming_the_file_key():
    require_deepspeed()
    from gpg_vl.distributed import check_deepspeed_config
    from gpg_vl.errors import UserError

    check_deepspeed_config({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}}})
    with pytest.raises(UserError) as error:
        check_deepspeed_config({"zero_optimization": {"stage": 7}})
    message = str(error.value)
    assert message.startswith("the DeepSpeed config has zero_optimization.stage=7 (zero_stage in the accelerate "
                              "config file), which DeepSpeed refuses: input should be 0, 1, 2 or 3; fix it")
    assert "\n" not in message and message.endswith(".")
    with pytest.raises(UserError, match=r"offload_param.device='gpu' \(offload_param_device in the accelerate.*"
                                        r"input should be 'none', 'cpu' or 'nvme'; fix"):
        check_deepspeed_config({"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}})


@pytest.mark.slow
def test_a_launch_with_zero_stage_7_ends_in_one_sentence_before_the_model_loads(tmp_path):
    """No pydantic ValidationError from inside accelerator.prepare: each process says the sentence and exits 2
    (under `accelerate launch` the launcher then reports the failed processes, as it does for any failed run)."""
    require_deepspeed()
    config = tmp_path / "zero7.yaml"
    config.write_text((CONFIGS / "zero2.yaml").read_text().replace("zero_stage: 2", "zero_stage: 7"))
    environment = launch_environment(config, LAUNCH)  # accelerate's launcher accepts the stage
    done = procs.launch(["scripts/train.py", f"output_dir={tmp_path / 'run'}", *TINY_RUN],
                        env={**launch_env(), **environment}, port=free_port())
    # each process's sentence, wherever it starts: the other process's progress bar may end without a newline
    said = re.findall(r"error: [^\n]*", done.stderr)
    assert done.returncode != 0 and len(said) == 2 and said[0] == said[1], done.stderr[-4000:]
    assert "zero_optimization.stage=7 (zero_stage in the accelerate config file)" in said[0]
    assert "ValidationError" not in done.stderr and "Loading weights" not in done.stderr
    assert not (tmp_path / "run").exists()


def test_a_failed_save_on_the_main_process_ends_every_process_at_once_with_its_sentence(tmp_path):
    """The main process cannot write checkpoint-1 (its disk is full); the other process, which saves nothing
    itself, ends with the same sentence at once instead of waiting for the collective timeout (30 minutes by
    default: the launch's timeout would fail this test first)."""
    run = tmp_path / "run"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
               str(free_port()), str(WORKER), "fail_save", str(tmp_path / "views"), "--", "scripts/train.py",
               f"output_dir={run}", "trainer.max_steps=2", "trainer.eval_before=false", "trainer.eval_after=false",
               *TINY_RUN]
    done = subprocess.run(command, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=600)
    # each process's sentence, wherever it starts: the other process's progress bar may end without a newline
    said = re.findall(r"error: [^\n]*", done.stderr)
    assert done.returncode != 0 and len(said) == 2 and said[0] == said[1], done.stderr[-4000:]
    assert "could not save checkpoint-1" in said[0] and "the disk is full (No space left on device)" in said[0]
    assert not list(run.glob("checkpoint-*")) and "[rank0]: Traceback" not in done.stderr
    assert "[rank1]: Traceback" not in done.stderr  # no collective timed out
