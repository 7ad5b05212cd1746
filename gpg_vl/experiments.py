"""What the experiment scripts share: scripts/ablate.py (GPG's ablations) and scripts/compare.py (GPG against the
GRPO family) both train many runs of the trainer itself, each in a worker process, and summarise them the same way.

- `run_cell`: one run in this process (`gpg_vl.cli.train_main` on a command line), its summary and per-step
  curve; `run_measured` adds its wall time and peak memory (`Meter`, which scripts/bench.py uses too);
- `run_jobs`: many runs on `workers` spawned processes, each with its share of the cores, printed as they end;
- `running_proxy` / `completions_to_target`: the learning proxy (the accuracy of the training samples over a
  window of completions) and when it reaches a target;
- `paired_differences`: held-out accuracy of gpg minus each other variant, paired by (G, seed).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import torch


# ---------------------------------------------------------------------------------------------
# runs
# ---------------------------------------------------------------------------------------------
def init_worker(threads: int) -> None:
    """A worker process's torch threads (`worker_threads`)."""
    torch.set_num_threads(threads)


def worker_threads(workers: int) -> int:
    """Torch threads per worker process: OMP_NUM_THREADS where it is set (the user's cap on the whole run, also
    what the test suite sets: one thread per test process), else the cores divided among the workers."""
    capped = os.environ.get("OMP_NUM_THREADS", "").strip()
    if capped.isdigit() and int(capped) > 0:
        return int(capped)
    return max(1, (os.cpu_count() or 1) // workers)


def run_cell(variant: str, group_size: int, seed: int, overrides: list[str]) -> dict:
    """Train one run in this process; return its summary and per-step curve (the checkpoint is deleted)."""
    from gpg_vl.cli import train_main
    from gpg_vl.config.compose import load_config

    cfg = load_config("train", overrides)
    output_dir = Path(cfg.output_dir)
    shutil.rmtree(output_dir, ignore_errors=True)
    output_dir.mkdir(parents=True)
    started = time.perf_counter()
    with (output_dir / "log.txt").open("w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        summary = train_main(cfg)
    wall = time.perf_counter() - started
    shutil.rmtree(output_dir / "final", ignore_errors=True)  # 35 MB per run, not needed here
    steps = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    curve = [{"completions": m["completions_sampled"], "tokens": m["tokens_sampled"], "accuracy": m["reward/accuracy"],
              "reward": m["reward_mean"], "alpha": m["alpha"], "attempts": m["attempts"],
              "valid_fraction": m["valid_fraction"], "step_s": m["step_s"]} for m in steps]
    return {"variant": variant, "group_size": group_size, "seed": seed, "overrides": overrides,
            "accuracy_after": summary["accuracy_after"], "steps": summary["steps"],
            "completions_sampled": summary["completions_sampled"], "tokens_sampled": summary["tokens_sampled"],
            "train_seconds": summary["train_seconds"], "wall_seconds": wall, "curve": curve}


def run_measured(variant: str, group_size: int, seed: int, overrides: list[str]) -> dict:
    """One run in this worker (`run_cell`), with its wall time, seconds per step and peak memory above the level
    it started at (`Meter`: the kernel's RSS high-water mark on Linux, CUDA's peak allocation on a GPU)."""
    meter = Meter("cuda" if torch.cuda.is_available() else "cpu")
    meter.start()
    run = run_cell(variant, group_size, seed, overrides)
    measured = meter.stop()
    meter.close()
    run.update(peak_mib=measured["peak_mib"], seconds_per_step=run["train_seconds"] / max(run["steps"], 1))
    return run


def run_jobs(run: Callable[..., dict], jobs: list[tuple], *, workers: int, describe: Callable[[dict], str],
             fresh_process: bool = False, first: tuple | None = None) -> tuple[list[dict], object]:
    """`run(*job)` for every job, on `workers` spawned processes sharing the cores, in the jobs' order; each
    result printed by `describe` as it comes. `fresh_process`: one process per run (each run's memory measured
    from the same start). `first`: (function, *args) submitted before the jobs; its result is returned beside
    the runs (None without one)."""
    threads = worker_threads(workers)
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=init_worker, initargs=(threads,),
                             max_tasks_per_child=1 if fresh_process else None) as pool:
        early = pool.submit(*first) if first is not None else None
        futures = [pool.submit(run, *job) for job in jobs]
        runs = []
        for future in futures:
            runs.append(future.result())
            print(f"  [{len(runs)}/{len(jobs)}] {describe(runs[-1])}", flush=True)
        return runs, early.result() if early is not None else None


# ---------------------------------------------------------------------------------------------
# measurements
# ---------------------------------------------------------------------------------------------
def running_proxy(curve: list[dict], window: int) -> list[tuple[int, float, bool]]:
    """(completions so far, accuracy of the completions sampled in the last `window`, full window?) per step.

    A step's completions all fall in the window if the step ended less than `window` completions ago.
    """
    points = []
    for i, now in enumerate(curve):
        previous = 0
        total, weight = 0.0, 0
        for j in range(i, -1, -1):
            if now["completions"] - curve[j]["completions"] >= window:
                break
            start = curve[j - 1]["completions"] if j else 0
            count = curve[j]["completions"] - start
            total, weight = total + curve[j]["accuracy"] * count, weight + count
            previous = start
        points.append((now["completions"], total / weight, now["completions"] - previous >= window))
    return points


def completions_to_target(curve: list[dict], window: int, target: float) -> int | None:
    """The first completion count at which the full-window running proxy reaches `target` (None: never)."""
    return next((c for c, value, full in running_proxy(curve, window) if full and value >= target), None)


def paired_differences(runs: list[dict], args: argparse.Namespace) -> list[dict]:
    """Held-out accuracy of gpg minus each other variant, paired by (G, seed): mean and standard error."""
    accuracy = {(r["variant"], r["group_size"], r["seed"]): r["accuracy_after"] for r in runs}
    pairs = [(g, s) for g in args.groups for s in args.seeds]
    result = []
    for variant in (v for v in args.variants if v != "gpg" and "gpg" in args.variants):
        diffs = [accuracy[("gpg", g, s)] - accuracy[(variant, g, s)] for g, s in pairs]
        error = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else 0.0
        result.append({"variant": variant, "gpg_minus_variant": statistics.fmean(diffs), "standard_error": error,
                       "pairs": len(diffs)})
    return result


def mean_std(values: list[float]) -> tuple[float, float]:
    """The mean and the sample standard deviation (0 for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


# ---------------------------------------------------------------------------------------------
# the meter
# ---------------------------------------------------------------------------------------------
class Meter:
    """Wall and CPU seconds, and the peak memory above the starting level, of one window at a time.

    On Linux the peak is the kernel's own high-water mark of the resident set (VmHWM in /proc/self/status),
    reset at the start of each window (writing 5 to /proc/self/clear_refs): exact, and nothing runs beside
    the trainers. Elsewhere a sampling thread reads RSS every 2 ms (it takes the interpreter lock and a
    core now and then, so the times carry a little of its cost).
    """

    STATUS, CLEAR = "/proc/self/status", "/proc/self/clear_refs"

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        import psutil  # the dev and bench extras

        self.process = psutil.Process()
        self.peak = 0
        self._lock = threading.Lock()  # a sample read before start() must not land in the new window
        self._closed = threading.Event()
        self.kernel_peak = not self.cuda and self._reset_kernel_peak()
        if not self.cuda and not self.kernel_peak:
            threading.Thread(target=self._sample, daemon=True).start()
        try:
            self._trim = ctypes.CDLL("libc.so.6").malloc_trim
        except OSError:  # not glibc: RSS then also counts freed pages the allocator kept
            self._trim = None

    def _reset_kernel_peak(self) -> bool:
        """Reset the kernel's resident high-water mark to the current RSS; False where it cannot be."""
        try:
            with open(self.CLEAR, "w") as clear:
                clear.write("5")
            return self._kernel_peak() is not None
        except OSError:
            return False

    def _kernel_peak(self) -> int | None:
        with open(self.STATUS) as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
        return None

    def close(self) -> None:
        """End the sampling thread, where there is one."""
        self._closed.set()

    def _sample(self) -> None:
        while not self._closed.wait(0.002):
            with self._lock:
                self.peak = max(self.peak, self.process.memory_info().rss)

    def start(self, *, trim: bool = True) -> None:
        """`trim`: hand the heap's free pages back first, so the peak counts only this window's memory; the
        window then faults in every page it touches again, time a training loop (which reuses them) does not
        spend. Without it the times are a loop's, and the peak is not this window's alone."""
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            if trim and self._trim is not None:
                self._trim(0)
            if self.kernel_peak:
                self._reset_kernel_peak()
            with self._lock:
                self.base = self.peak = self.process.memory_info().rss
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def stop(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()  # the step's queued GPU work belongs to its time
        wall, cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu
        if self.cuda:
            peak = torch.cuda.max_memory_allocated()
        elif self.kernel_peak:
            peak = max(self._kernel_peak(), self.process.memory_info().rss)
        else:
            with self._lock:
                peak = max(self.peak, self.process.memory_info().rss)
        return {"step_s": wall, "cpu_s": cpu, "peak_mib": (peak - self.base) / 2**20}
