"""--packing: the update alone under each trainer.packing mode, on one sampled step."""

from __future__ import annotations

import random
import statistics
import tempfile
from dataclasses import replace

import psutil
import torch

from benches.common import GpgRunner, alternate_updates, make_rows
from gpg_vl.experiments import Meter
from gpg_vl.models.scoring import choose_scoring_path
from gpg_vl.train.step.update import update


# ---------------------------------------------------------------------------------------------
# --packing: the update alone, packed against padded, on the same sampled step
# ---------------------------------------------------------------------------------------------
def drawn_lengths(attempt, spec: str, seed: int):
    """The attempt with each completion cut to a length drawn uniformly from `spec` ("8:256"), the rest padding."""
    low, high = (int(x) for x in spec.split(":"))
    rollout = attempt.rollout
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (rollout.completion_ids.shape[0],), generator=generator)
    lengths = lengths.clamp(max=rollout.completion_ids.shape[1]).to(rollout.completion_ids.device)
    columns = torch.arange(rollout.completion_ids.shape[1], device=lengths.device)
    mask = columns[None, :] < lengths[:, None]  # [B * G, C]
    ids = rollout.completion_ids.masked_fill(~mask, 0)
    return replace(attempt, rollout=replace(rollout, completion_ids=ids, completion_mask=mask))


def packing_step(args):
    """(the learner, one sampled step's attempts, what they are) for --packing: the bench model's step (with
    --lengths, its completions cut to drawn lengths), the video bench's, or with --zoom one step of
    +experiment=zoom-tiny (multi-turn trajectories), sampled once and updated by every arm."""
    if args.zoom:
        from gpg_vl.config.compose import load_config
        from gpg_vl.train import loop

        folder = tempfile.mkdtemp(prefix="bench-zoom-")
        run = loop.setup(load_config("train", ["+experiment=zoom-tiny", f"output_dir={folder}", "eval.limit=null",
                                               "trainer.eval_before=false", "trainer.packing=off"]))
        run.learner.settings = replace(run.learner.settings, lr=args.lr)
        loop.step(run)  # one real step (sample, update); its attempts are what every arm updates on
        return run.learner, run.state.attempts, "one step of +experiment=zoom-tiny"
    image_size, group_size = int(args.image_sizes.split(",")[0]), int(args.group_sizes.split(",")[0])
    rows = make_rows(args.prompts * 2, image_size, args.seed, frames=args.video)
    runner = GpgRunner(args, rows, group_size, image_size, "default")
    attempts = runner.sample().attempts
    what = f"B={args.prompts} x G={group_size}, {'video of ' + str(args.video) + ' frames' if args.video else 'image'}"
    if args.lengths:
        attempts = [drawn_lengths(a, args.lengths, args.seed) for a in attempts]
        what += f", completion lengths drawn from {args.lengths}"
    else:
        what += f", completions of {args.new_tokens} tokens"
    return runner.learner, attempts, what


def main_packing(args) -> None:
    """Update tokens per second and peak memory of each trainer.packing mode on one sampled step, the modes
    alternating in a fresh order each round, at each --threads count, in this one process. The timed rounds run
    on the heap as a training loop leaves it (freed pages reused); the peak comes from one more update per mode
    after trimming the heap, since a trim before each timed round would make every update fault all its memory
    in again (0.3 to 0.5 s of system time per packed update at two threads on the ragged shape)."""
    modes = args.packing.split(",")
    learner, attempts, what = packing_step(args)
    learners = {}
    for mode in modes:
        settings = replace(learner.settings, packing=mode)
        path = choose_scoring_path(learner.policy.family, learner.model, share_prompt=settings.share_prompt,
                                   share_vision=settings.share_vision, packing=mode)
        learners[mode] = replace(learner, settings=settings, path=path)
    sequences = [a.rollout.completion_mask.shape[0] for a in attempts]
    real = sum(int(a.rollout.completion_mask.sum()) + int(a.prompts.inputs["attention_mask"].sum()) * (
        a.rollout.group_size) for a in attempts)
    print(f"{what}: {sum(sequences)} sequences, {real} real tokens (prompt + completion per sequence); load "
          f"average {', '.join(f'{x:.1f}' for x in psutil.getloadavg())}")
    meter, order = Meter(args.device), random.Random(args.seed)
    table = []
    for threads in [int(x) for x in str(args.threads).split(",")]:
        torch.set_num_threads(threads)
        records = alternate_updates(learners, attempts, meter, order, threads=threads,
                                    rounds=args.warmup + args.steps)
        peaks = {}
        for mode in order.sample(modes, len(modes)):  # the peak: one more update each, from a trimmed heap
            meter.start()
            update(learners[mode], attempts)
            peaks[mode] = meter.stop()["peak_mib"]
        for mode in modes:
            measured = records[mode][args.warmup:]
            seconds = statistics.mean(r["step_s"] for r in measured)
            table.append((threads, mode, seconds, statistics.mean(r["cpu_s"] for r in measured), real / seconds,
                          peaks[mode]))
    base = {threads: (seconds, cpu) for threads, mode, seconds, cpu, _, _ in table if mode == "off"}
    print("\n| threads | packing | update s | CPU s | update tok/s | peak MiB | vs off (wall) | vs off (CPU) |\n"
          "|---|---|---|---|---|---|---|---|")
    for threads, mode, seconds, cpu, rate, peak in table:
        wall, cpu_ratio = (f"{base[threads][0] / seconds:.2f}x", f"{base[threads][1] / cpu:.2f}x") \
            if threads in base else ("-", "-")
        print(f"| {threads} | {mode} | {seconds:.2f} | {cpu:.2f} | {rate:.0f} | {peak:.0f} | {wall} | {cpu_ratio} |")
    auto = choose_scoring_path(learner.policy.family, learner.model, share_prompt=learner.settings.share_prompt,
                               share_vision=learner.settings.share_vision, packing="auto")
    print("paths: " + "; ".join(f"{mode}: {learners[mode].path.describe()}" for mode in modes) +
          f"; auto takes: {auto.describe()}")
    print(f"load average at the end: {', '.join(f'{x:.1f}' for x in psutil.getloadavg())}")
