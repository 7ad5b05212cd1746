"""--staleness K: the asynchronous trainer (the sampler beside the learner) against the synchronous one and TRL,
and the most async / sync can reach on this machine (`side_by_side`)."""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import replace

import psutil
import torch

from benches.common import GpgRunner, make_rows, trl_trainer
from gpg_vl.train.step.update import update


def _bench_run(runner: GpgRunner, k: int, start: int):
    """What gpg_vl/train/step/pipeline.py reads of a run, around a GpgRunner's policy, engine, learner and data."""
    from types import SimpleNamespace

    trainer = replace(runner.settings, max_staleness=k, reward_workers=1, max_steps=10**9)
    return SimpleNamespace(trainer=trainer, learner=runner.learner, engine=runner.engine, warn=print,
                           accelerator=runner.accelerator, data=SimpleNamespace(task=runner.task, stream=runner.stream),
                           settings=SimpleNamespace(rollout=runner.rollout, seed=0),
                           state=SimpleNamespace(start_step=start, step=start,
                                                 counters={"completions_sampled": 0, "tokens_sampled": 0}))


def staleness_block(args, runner: GpgRunner, k: int, start: int) -> dict[str, float]:
    """--warmup + --steps steps of `runner` at trainer.max_staleness=k (0: synchronous) from step `start`: steps/s
    and the learner's idle fraction over the measured steps."""
    from gpg_vl.train.step.pipeline import start_pipeline

    run = _bench_run(runner, k, start)
    pipeline = start_pipeline(run)
    times, idle = [], []
    try:
        for n in range(start + 1, start + args.warmup + args.steps + 1):
            run.state.step = n
            began = time.perf_counter()
            sampled = pipeline.take(n)
            update(runner.learner, sampled.collected.attempts)
            pipeline.learned(n)
            pipeline.released(n)
            times.append(time.perf_counter() - began)
            idle.append(sampled.learner_idle_s)
    finally:
        pipeline.close()
    measured, waited = times[args.warmup:], idle[args.warmup:]
    return {"steps_per_s": len(measured) / sum(measured), "learner_idle": sum(waited) / sum(measured)}


def trl_block(args, rows: list[dict], group_size: int, image_size: int) -> float:
    """TRL's GRPOTrainer on the same work: steps per second over its measured steps."""
    from transformers import PrinterCallback, TrainerCallback

    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.began = time.perf_counter()

        def on_step_end(self, *_, **__):
            times.append(time.perf_counter() - self.began)

    trainer = trl_trainer(args, rows, group_size, image_size, args.warmup + args.steps, Clock())
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    measured = times[args.warmup:]
    return len(measured) / sum(measured)


def _median_s(action, times: int) -> float:
    spent = []
    for _ in range(times):
        began = time.perf_counter()
        action()
        spent.append(time.perf_counter() - began)
    return statistics.median(spent)


def side_by_side(learner: GpgRunner, sampler: GpgRunner, times: int = 5) -> dict[str, float]:
    """What bounds async / sync at 2 threads on this machine, from each side's median seconds: the sampling stage
    (`sampler`'s) and the update (`learner`'s, on one sampled step, again and again) alone at 2 threads and at 1
    thread, and at 1 thread each side by side (the sampler in a thread of its own, as the pipeline runs it).

    A side costs the machine at least min(its side-by-side seconds, twice its 2-thread seconds) core-seconds,
    however its work is spread over the two cores: on its own thread beside the other side, or on both threads
    alone (a thread alone with the other core idle costs more). So no schedule makes a step faster than half the
    two sides' least costs, and async / sync at 2 threads is at most the synchronous step (both sides at 2 threads,
    one after the other) over that."""
    restore, attempts = torch.get_num_threads(), learner.sample().attempts
    stages = {"sample": sampler.sample, "update": lambda: update(learner.learner, attempts)}
    seconds = {}
    for threads in (2, 1):
        torch.set_num_threads(threads)
        for name, action in stages.items():
            seconds[f"{name}_{threads}"] = _median_s(action, times)
    stop, sampled, updated, failed = threading.Event(), [], [], []

    def sample_until_stopped() -> None:
        torch.set_num_threads(1)  # OpenMP's thread count is per thread
        try:
            while not stop.is_set():
                began = time.perf_counter()
                sampler.sample()
                sampled.append(time.perf_counter() - began)
        except BaseException as error:  # raised in the main thread
            failed.append(error)

    beside = threading.Thread(target=sample_until_stopped, name="bench-sampler")
    beside.start()
    try:  # the first and last samplings may run partly alone: left out, so updates go on until `times` more
        while not failed and (len(updated) < times or len(sampled) < times + 2):
            updated.append(_median_s(stages["update"], 1))
    finally:
        stop.set()
        beside.join()
        torch.set_num_threads(restore)
    if failed:
        raise failed[0]
    seconds["update_beside"] = statistics.median(updated)
    seconds["sample_beside"] = statistics.median(sampled[1:-1])
    return {**seconds, **staleness_bound(seconds)}


def staleness_bound(seconds: dict[str, float]) -> dict[str, float]:
    """The synchronous step at 2 threads (sampling, then the update) and the most async / sync can reach at 2
    threads: that step over half the two sides' least core-seconds (see side_by_side), from `seconds`'
    sample_2, update_2 (alone at 2 threads) and sample_beside, update_beside (1 thread each, side by side)."""
    sync = seconds["sample_2"] + seconds["update_2"]
    least = sum(min(seconds[f"{side}_beside"], 2 * seconds[f"{side}_2"]) for side in ("sample", "update"))
    return {"sync_step": sync, "bound": sync / (least / 2)}


def main_staleness(args) -> None:
    group_size, image_size = int(args.group_sizes.split(",")[0]), int(args.image_sizes.split(",")[0])
    print(f"torch {torch.__version__}, device {args.device}, B={args.prompts}, G={group_size}, image {image_size}, "
          f"{args.new_tokens} tokens, k={args.staleness}, {psutil.cpu_count()} CPUs, load average "
          f"{', '.join(f'{x:.1f}' for x in psutil.getloadavg())}")
    rows = make_rows(args.prompts * (args.warmup + args.steps) * 8, image_size, args.seed)
    runners = {0: GpgRunner(args, rows, group_size, image_size, "default"),
               args.staleness: GpgRunner(args, rows, group_size, image_size, "default")}
    results, done, trl_blocks = {}, {0: 0, args.staleness: 0}, {}
    for threads in (2, 1):
        for _ in range(2):  # two rounds, each a block of the synchronous run, the asynchronous one and TRL
            for k in (0, args.staleness):
                torch.set_num_threads(threads)
                block = staleness_block(args, runners[k], k, done[k])
                done[k] += args.warmup + args.steps
                results.setdefault((threads, k), []).append(block)
                print(f"  {threads} threads, k={k}: {block['steps_per_s']:.3f} steps/s, learner idle "
                      f"{block['learner_idle']:.0%}", flush=True)
            torch.set_num_threads(threads)
            trl_blocks.setdefault(threads, []).append(trl_block(args, rows, group_size, image_size))
            print(f"  {threads} threads, TRL: {trl_blocks[threads][-1]:.3f} steps/s", flush=True)
    trl_rates = {threads: statistics.mean(rates) for threads, rates in trl_blocks.items()}
    print(f"\n| threads | sync steps/s | async steps/s (k={args.staleness}) | async / sync | learner idle (sync, "
          "async) | TRL steps/s | async / TRL |")
    print("|---|---|---|---|---|---|---|")
    for threads in (2, 1):
        sync, stale = (statistics.mean(b["steps_per_s"] for b in results[(threads, k)]) for k in (0, args.staleness))
        idle = [statistics.mean(b["learner_idle"] for b in results[(threads, k)]) for k in (0, args.staleness)]
        print(f"| {threads} | {sync:.3f} | {stale:.3f} | {stale / sync:.2f}x | {idle[0]:.0%}, {idle[1]:.0%} | "
              f"{trl_rates[threads]:.3f} | {stale / trl_rates[threads]:.2f}x |")
    bound = side_by_side(runners[0], runners[args.staleness])
    print("\nThe bound on async / sync at 2 threads (median seconds; see side_by_side):\n")
    print("| side | 2 threads alone | 1 thread alone | 1 thread each, side by side |")
    print("|---|---|---|---|")
    for name in ("sample", "update"):
        print(f"| {name} | {bound[name + '_2']:.3f} | {bound[name + '_1']:.3f} | {bound[name + '_beside']:.3f} |")
    print(f"\nsynchronous step at 2 threads {bound['sync_step']:.3f} s; async / sync at 2 threads is at most "
          f"{bound['bound']:.2f}x")
    print(f"load average at the end: {', '.join(f'{x:.1f}' for x in psutil.getloadavg())}")
