"""The GPU check's pure parts: FLOPs per token from a config, MFU, device peaks; its CPU error; the bench's meter and
smoke run, and its bound on async / sync; and the experiment workers' threads."""

import importlib
import importlib.util
import sys
import threading
from types import SimpleNamespace

import pytest
import torch
from helpers import procs
from helpers.procs import ROOT

from gpg_vl.observe import perf


def test_mfu_and_flops_by_hand():
    # 6 N + 12 layers x width x context: N = 1e9, 2 full-attention layers of width 1024, context 2048
    assert perf.train_flops_per_token(10**9, 2, 1024, 2048) == 6e9 + 12 * 2 * 1024 * 2048
    # 1e10 FLOPs per token x 1000 tokens in 0.1 s on a 989 TFLOPS device
    assert perf.mfu(1e10, 1000, 0.1, 989e12) == pytest.approx(1e14 / 989e12)
    assert perf.peak_bf16_flops("NVIDIA H200") == 989e12 and perf.peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert perf.peak_bf16_flops("NVIDIA GH200 480GB") == 989e12
    assert perf.peak_bf16_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert perf.peak_bf16_flops("Some Accelerator") is None


def test_flops_per_token_from_a_model_and_its_config():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config)
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 96  # q, k + v (2 kv heads of 16), o, gate/up/down
    assert perf.linear_weights(model) == 3 * per_layer + 100 * 64  # embeddings are lookups, lm_head a matmul
    assert perf.linear_weights(model, skip=("mlp",)) == 3 * (64 * 64 * 2 + 2 * 64 * 32) + 100 * 64
    assert perf.attention_shape(config) == (3, 64)
    hybrid = Qwen2Config(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=32,
                         layer_types=["linear_attention"] * 3 + ["full_attention"])
    hybrid.head_dim = 32
    assert perf.attention_shape(hybrid) == (1, 128)  # linear-attention layers have no context-long products


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_gpu_check_fails_in_one_sentence_without_a_gpu():
    run = procs.run(["scripts/gpu_check.py"], timeout=120)  # forked: helpers/procs.py
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().startswith("error: gpu_check.py needs a CUDA GPU") and run.stderr.strip().count("\n") == 0


def test_the_gpu_checks_packing_check_runs_its_comparison_on_the_cpu_buckets():
    """scripts/gpu_check.py --packing's comparison, run on the CPU (where the packed attention is the buckets, not
    the varlen call it checks on CUDA): it samples, cuts the lengths, updates both paths from the same weights
    (lr 0: they stay) and finds the gradients equal to float32 rounding."""
    import argparse
    import importlib.util

    from gpg_vl.models.load import load_policy

    spec = importlib.util.spec_from_file_location("gpu_check", procs.ROOT / "scripts/gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    torch.manual_seed(0)
    policy = load_policy("embedded:tiny-qwen2.5-vl", dtype="float32")
    before = [p.detach().clone() for p in policy.model.parameters()]
    result = gpu_check.packing_check(policy, argparse.Namespace(prompts=2, group_size=4, new_tokens=24, steps=1))
    assert result["on_path"].startswith("packed") and not result["off_path"].startswith("packed"), result
    assert result["gradient_gap"] < 1e-5 and result["on_s"] > 0 and result["off_s"] > 0, result
    assert 2 * 4 * 8 <= result["completion"] <= 2 * 4 * 24  # lengths drawn from 8 to --new-tokens
    assert all(torch.equal(a, b) for a, b in zip(before, policy.model.parameters(), strict=True))


def test_the_bench_meter_reads_a_window_s_memory_peak_without_a_sampling_thread():
    import threading

    from gpg_vl.experiments import Meter  # scripts/bench.py's and the experiment scripts'

    threads = threading.active_count()
    meter = Meter("cpu")
    if not meter.kernel_peak:
        pytest.skip("this kernel does not let a process reset its resident high-water mark (/proc/self/clear_refs)")
    assert threading.active_count() == threads  # the kernel keeps the peak: nothing samples beside the trainers
    meter.start()
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched, then freed before the window ends
    del block
    window = meter.stop()
    assert 60 <= window["peak_mib"] <= 80, window
    meter.start()  # the next window starts from the current level: the freed block is not counted again
    small = torch.ones(2**20 // 4)
    assert meter.stop()["peak_mib"] < 16 and small.numel() > 0


def test_the_bench_meter_trims_the_heap_before_a_window_only_when_asked():
    """The packing bench times its rounds on the heap as a training loop leaves it (trim=False) and reads the peak
    from a trimmed window: a trim makes the window fault its pages in again, time a loop does not spend."""
    from gpg_vl.experiments import Meter

    meter, trims = Meter("cpu"), []
    meter._trim = trims.append
    meter.start(trim=False)
    meter.stop()
    assert trims == []
    meter.start()
    assert meter.stop()["step_s"] >= 0 and trims == [0]


def test_the_bench_steps_gpg_vl_s_trainer_on_a_tiny_video_setup():
    """scripts/bench.py drives the trainer's own sample / collect / update functions (GpgRunner.step): one step of
    each variant on a tiny setup (TRL is not needed with --video), so a change of their signatures shows here."""
    run = procs.run(["scripts/bench.py", "--video", "2", "--steps", "1", "--warmup", "0", "--image-sizes", "56",
                     "--group-sizes", "2", "--prompts", "1", "--new-tokens", "2"], timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split() for line in run.stdout.splitlines() if line.strip().startswith(("default ", "plain "))]
    assert [row[0] for row in rows] == ["default", "plain"] and all(float(row[1]) > 0 for row in rows), run.stdout


def test_experiment_workers_take_omp_num_threads_where_set_else_share_the_cores(monkeypatch):
    from gpg_vl.experiments import worker_threads

    monkeypatch.setattr("os.cpu_count", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert [worker_threads(w) for w in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the test suite's cap: one thread whatever the workers
    assert [worker_threads(w) for w in (1, 2)] == [1, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert worker_threads(1) == 3
    for unset in ("", "0", "auto"):  # not a thread count: the cores are shared as without it
        monkeypatch.setenv("OMP_NUM_THREADS", unset)
        assert worker_threads(2) == 4


def _bench_module(name: str):
    """scripts/benches/<name>.py (scripts/bench.py's benchmarks), imported as scripts/bench.py imports it."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return importlib.import_module(f"benches.{name}")
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def test_the_staleness_bound_takes_each_side_s_least_core_seconds():
    """A hand-worked case: sampling 0.8 s alone at 2 threads (1.6 core-s) but 1.3 s on one thread beside the
    update, so 1.3 core-s; the update 0.9 s at 2 threads (1.8 core-s), 2.0 s beside the sampler, so 1.8. The
    synchronous step is 0.8 + 0.9 = 1.7 s, and no schedule beats (1.3 + 1.8) / 2 = 1.55 s: at most 1.7 / 1.55."""
    bound = _bench_module("staleness").staleness_bound({"sample_2": 0.8, "update_2": 0.9, "sample_beside": 1.3,
                                             "update_beside": 2.0, "sample_1": 9.9, "update_1": 9.9})
    assert bound["sync_step"] == pytest.approx(1.7)
    assert bound["bound"] == pytest.approx(1.7 / 1.55)
    # a second thread that doubles a side's speed leaves the bound at 1x: nothing to win by overlapping
    even = _bench_module("staleness").staleness_bound({"sample_2": 0.5, "update_2": 0.5, "sample_beside": 1.0,
                                            "update_beside": 1.0})
    assert even["bound"] == pytest.approx(1.0)


def test_side_by_side_times_both_sides_alone_and_together_on_a_tiny_setup():
    """scripts/bench.py --staleness's bound: every stage timed (positive seconds), the sampler's thread joined,
    the learner's thread count restored, on a tiny setup (56 px, G = 2, 2 new tokens)."""
    bench, common = _bench_module("staleness"), _bench_module("common")
    args = SimpleNamespace(prompts=1, new_tokens=2, family="qwen2_5_vl", lr=1e-6, seed=0, device="cpu",
                           torch_dtype=torch.float32, cache="default", video=0)
    rows = common.make_rows(8, 56, 0)
    learner, sampler = (common.GpgRunner(args, rows, 2, 56, "default") for _ in range(2))
    threads = torch.get_num_threads()
    seconds = bench.side_by_side(learner, sampler, times=1)
    assert torch.get_num_threads() == threads and not any(t.name == "bench-sampler" for t in threading.enumerate())
    keys = [f"{side}_{where}" for side in ("sample", "update") for where in ("2", "1", "beside")]
    assert all(seconds[key] > 0 for key in keys), seconds
    assert seconds["bound"] == pytest.approx(bench.staleness_bound(seconds)["bound"])
