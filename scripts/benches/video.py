"""--video FRAMES: video prompts, gpg-vl's default path against its plain one (TRL has no video)."""

from __future__ import annotations

import random
import statistics

import psutil
import torch

from benches.common import GpgRunner, make_rows
from gpg_vl.experiments import Meter


def run_video(args, group_size: int, image_size: int) -> dict:
    """Video prompts: gpg-vl's variants alternating step by step (TRL has no video)."""
    steps = args.warmup + args.steps
    rows = make_rows(args.prompts * steps * 2, image_size, args.seed, frames=args.video)
    meter = Meter(args.device)
    runners = {v: GpgRunner(args, rows, group_size, image_size, v) for v in args.gpg_variants}
    records: dict[str, list[dict]] = {name: [] for name in runners}
    order = random.Random(args.seed)
    for index in range(1, steps + 1):
        for name in order.sample(list(runners), len(runners)):
            records[name].append(runners[name].step(meter))
        kind = "warm-up" if index <= args.warmup else "measured"
        print(f"  step {index} ({kind}): " + " | ".join(
            f"{name} {r[-1]['step_s']:.2f} s (rollout {r[-1]['rollout_s']:.2f} + update {r[-1]['update_s']:.2f})"
            for name, r in records.items()), flush=True)
    summary = {"group_size": group_size, "image_size": image_size}
    for name, rows_ in records.items():
        measured = rows_[args.warmup:]
        summary[name] = {key: statistics.mean(r[key] for r in measured) for key in measured[0]}
        summary[name]["peak_mib"] = max(r["peak_mib"] for r in measured)
    return summary


def report_video(args, summary: dict) -> None:
    g, size = summary["group_size"], summary["image_size"]
    print(f"\nB={args.prompts} video prompts of {args.video} frames ({size}x{size}) x G={g}, {args.new_tokens} new "
          f"tokens (EOS ignored), {torch.get_num_threads()} threads; means over {args.steps} measured steps")
    base = summary.get("plain")
    print(f"  {'variant':18s} {'s/step':>7s} {'rollout':>8s} {'update':>7s} {'cpu s':>6s} {'prompt tok':>10s} "
          f"{'peak MiB':>9s} {'vs plain':>8s}")
    for name in args.gpg_variants:
        r = summary[name]
        ratio = f"{base['step_s'] / r['step_s']:7.2f}x" if base else f"{'-':>8s}"
        print(f"  {name:18s} {r['step_s']:7.2f} {r['rollout_s']:8.2f} {r['update_s']:7.2f} {r['cpu_s']:6.2f} "
              f"{r['prompt_tokens']:10.0f} {r['peak_mib']:9.0f} {ratio}")


def main_video(args) -> None:
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, model {args.family}, device "
          f"{args.device}, dtype {args.dtype}, torch threads {torch.get_num_threads()}, {psutil.cpu_count()} CPUs, "
          f"load average {', '.join(f'{x:.1f}' for x in psutil.getloadavg())}")
    for image_size in [int(x) for x in args.image_sizes.split(",")]:
        for group_size in [int(x) for x in args.group_sizes.split(",")]:
            print(f"\n== video: G={group_size}, {args.video} frames of {image_size}x{image_size}")
            report_video(args, run_video(args, group_size, image_size))
    print(f"load average at the end: {', '.join(f'{x:.1f}' for x in psutil.getloadavg())}")
