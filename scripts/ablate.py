"""Ablations of GPG on `task=shapes model=tiny` (CPU): variants x group sizes x seeds, at an equal cost.

    python scripts/ablate.py                      # the default grid (5 variants x G 2,4,8,16 x 3 seeds)
    python scripts/ablate.py --quick --out /tmp/a # machinery only (CI): tiny budget, 2 group sizes, 2 seeds
    python scripts/ablate.py --from-json runs/ablation/ablation.json --target 0.55 --out /tmp/b  # re-summarise

Every cell gets the same budget of sampled completions (`trainer.max_completions`; completions drawn by
threshold resampling count too), so a larger G gets fewer steps and a resampling variant fewer updates.
Each run is the trainer itself, called in-process through `gpg_vl.cli.train_main` with the variant's
command-line overrides, in `--workers` processes (gpg_vl/experiments.py, which scripts/compare.py shares).

Measured per run: held-out accuracy after training (greedy decoding of the first `--eval-limit` test
rows), and a RUNNING REWARD PROXY of learning: the accuracy reward of the completions sampled for
training (temperature 1), averaged over the last `--window` sampled completions. "Completions to
target" is the first point (with a full window behind it) where that proxy reaches `--target`; it is
not a held-out measurement. Writes ablation.json (every number), table.md and ablation.png (one panel
per variant: the proxy against completions sampled, mean and spread over seeds for each G).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path

from gpg_vl.experiments import completions_to_target, paired_differences, run_cell, run_jobs, running_proxy

# variant name -> the command-line overrides that select it (`python scripts/train.py <overrides>`)
VARIANTS: dict[str, list[str]] = {
    "gpg": [],  # the default: group-mean advantage, AGE alpha, threshold resampling (beta_th 0.4)
    "no_resampling": ["trainer.beta_th=0"],
    "no_age": ["trainer.age=false"],
    "std_normalized": ["trainer.advantage=std_normalized"],
    "no_baseline": ["trainer.advantage=none"],
}
DEFAULT = {"groups": [2, 4, 8, 16], "seeds": [0, 1, 2], "budget": 1024, "batch_size": 8, "eval_limit": 200,
           "window": 256, "target": 0.6}
QUICK = {"groups": [2, 4], "seeds": [0, 1], "budget": 8, "batch_size": 2, "eval_limit": 4, "window": 4,
         "target": 0.6}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a seconds-long grid that checks the machinery")
    parser.add_argument("--out", default="runs/ablation", help="output folder (runs/, ablation.json, table.md, png)")
    parser.add_argument("--workers", type=int, default=2,
                        help="worker processes, each on the cores divided among them (OMP_NUM_THREADS where set)")
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--groups", type=int, nargs="+", help="group sizes G")
    parser.add_argument("--seeds", type=int, nargs="+")
    parser.add_argument("--budget", type=int, help="sampled completions per run (a multiple of B x max G)")
    parser.add_argument("--batch-size", type=int, help="B, prompts per step")
    parser.add_argument("--eval-limit", type=int, help="held-out rows evaluated after training")
    parser.add_argument("--window", type=int, help="completions averaged by the running reward proxy")
    parser.add_argument("--target", type=float, help="running proxy accuracy that counts as reached")
    parser.add_argument("--from-json", help="re-summarise the runs of an earlier ablation.json (no training); its "
                        "grid settings are kept, --target and --window may change")
    args = parser.parse_args(argv)
    if args.from_json:
        stored = json.loads(Path(args.from_json).read_text())["settings"]
        for key in ("groups", "seeds", "budget", "batch_size", "eval_limit", "workers"):
            setattr(args, key, stored[key])
        args.variants = list(stored["variants"])
        args.window, args.target = args.window or stored["window"], args.target or stored["target"]
    for key, value in (QUICK if args.quick else DEFAULT).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    step = args.batch_size * max(args.groups)
    if args.budget % step:
        parser.error(f"--budget {args.budget} must be a multiple of B x max G = {step}, so that every run without "
                     "resampling samples exactly the budget")
    return args


# ---------------------------------------------------------------------------------------------
# one run, in a worker process
# ---------------------------------------------------------------------------------------------
def run_overrides(variant: str, group_size: int, seed: int, args: argparse.Namespace, output_dir: Path) -> list[str]:
    """The command line of one run: the shapes/tiny defaults, the cell's G and budget, the variant's keys."""
    return ["task=shapes", "model=tiny", f"seed={seed}", f"output_dir={output_dir}",
            f"trainer.group_size={group_size}", f"trainer.batch_size={args.batch_size}",
            f"trainer.max_completions={args.budget}",
            f"trainer.max_steps={args.budget // (args.batch_size * group_size)}",
            "trainer.eval_before=false", f"eval.limit={args.eval_limit}", *VARIANTS[variant]]


def evaluate_start(args: argparse.Namespace) -> float:
    """Held-out accuracy of the starting checkpoint, on the same rows as every run's final evaluation."""
    from gpg_vl.cli import build_policy, build_task
    from gpg_vl.config.compose import load_config
    from gpg_vl.config.schema import RolloutSettings
    from gpg_vl.rollout.engine import build_engine
    from gpg_vl.train.eval.evaluate import evaluate

    cfg = load_config("train", ["task=shapes", "model=tiny"])
    task = build_task(cfg.task, cfg.data)
    rows = task.load(cfg.eval.split or task.eval_split)[:args.eval_limit]
    policy = build_policy(cfg.model, "cpu")
    metrics, _ = evaluate(policy, task, rows, engine=build_engine(RolloutSettings(), policy),
                          batch_size=cfg.eval.batch_size,
                          max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens)
    return metrics["accuracy"]


# ---------------------------------------------------------------------------------------------
# measurements
# ---------------------------------------------------------------------------------------------
def summarise(runs: list[dict], args: argparse.Namespace) -> list[dict]:
    """One entry per (variant, G): mean and std over seeds of every reported number."""
    cells = []
    for variant in args.variants:
        for group_size in args.groups:
            chosen = sorted((r for r in runs if r["variant"] == variant and r["group_size"] == group_size),
                            key=lambda r: r["seed"])
            accuracy = [r["accuracy_after"] for r in chosen]
            reached = [completions_to_target(r["curve"], args.window, args.target) for r in chosen]
            hits = [c for c in reached if c is not None]
            alphas = [p["alpha"] for r in chosen for p in r["curve"] if p["alpha"] > 0]
            cells.append({
                "variant": variant, "group_size": group_size, "seeds": [r["seed"] for r in chosen],
                "accuracy_after": accuracy, "accuracy_mean": statistics.fmean(accuracy),
                "accuracy_std": statistics.stdev(accuracy) if len(accuracy) > 1 else 0.0,
                "completions_to_target": reached, "reached": len(hits),
                "completions_to_target_mean": statistics.fmean(hits) if hits else None,
                "completions_sampled": [r["completions_sampled"] for r in chosen],
                "steps": [r["steps"] for r in chosen],
                "alpha_mean": statistics.fmean(alphas) if alphas else 0.0,
                "attempts_mean": statistics.fmean(p["attempts"] for r in chosen for p in r["curve"]),
            })
    return cells


def tables(cells: list[dict], args: argparse.Namespace, accuracy_before: float, paired: list[dict]) -> str:
    """Two markdown tables (variants x G): held-out accuracy after training; completions to target."""
    header = "| variant | " + " | ".join(f"G={g}" for g in args.groups) + " |\n|---|" + "---|" * len(args.groups)
    by_key = {(c["variant"], c["group_size"]): c for c in cells}
    accuracy = [f"Held-out accuracy after training ({args.budget} sampled completions per run, B={args.batch_size}, "
                f"first {args.eval_limit} test rows, greedy; mean ± std over seeds {args.seeds}); "
                f"before training: {accuracy_before:.3f}", "", header]
    target = [f"Sampled completions until the running reward proxy (accuracy of the training samples over the last "
              f"{args.window}) first reaches {args.target}: mean over the seeds that reached it (seeds reached)",
              "", header]
    for variant in args.variants:
        row = [by_key[(variant, g)] for g in args.groups]
        accuracy.append(f"| {variant} | " + " | ".join(f"{c['accuracy_mean']:.3f} ± {c['accuracy_std']:.3f}"
                                                        for c in row) + " |")
        target.append(f"| {variant} | " + " | ".join(
            (f"{c['completions_to_target_mean']:.0f}" if c["reached"] else "not reached")
            + f" ({c['reached']}/{len(c['seeds'])})" for c in row) + " |")
    versus = ["Held-out accuracy of gpg minus the variant, paired by (G, seed): mean ± standard error", "",
              "| variant | gpg - variant | pairs |", "|---|---|---|"]
    versus += [f"| {p['variant']} | {p['gpg_minus_variant']:+.3f} ± {p['standard_error']:.3f} | {p['pairs']} |"
               for p in paired]
    return "\n".join(accuracy) + "\n\n" + "\n".join(target) + "\n" + ("\n" + "\n".join(versus) + "\n" if paired else "")


def plot(runs: list[dict], args: argparse.Namespace, path: Path) -> None:
    """One panel per variant: running proxy vs completions sampled, mean over seeds and min-max band per G."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    grid = np.linspace(0, args.budget, 65)[1:]
    figure, axes = plt.subplots(1, len(args.variants), figsize=(3.6 * len(args.variants), 3.4), sharey=True,
                                squeeze=False)
    for axis, variant in zip(axes[0], args.variants, strict=True):
        for group_size in args.groups:
            curves = []
            for run in (r for r in runs if r["variant"] == variant and r["group_size"] == group_size):
                points = running_proxy(run["curve"], args.window)
                curves.append(np.interp(grid, [p[0] for p in points], [p[1] for p in points]))
            stack = np.stack(curves)
            line, = axis.plot(grid, stack.mean(0), label=f"G={group_size}")
            axis.fill_between(grid, stack.min(0), stack.max(0), color=line.get_color(), alpha=0.15)
        axis.axhline(args.target, color="grey", linestyle=":", linewidth=1)
        axis.set_title(variant)
        axis.set_xlabel("completions sampled")
        axis.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"train accuracy, last {args.window} samples")
    axes[0][-1].legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def run_grid(args: argparse.Namespace, out: Path) -> dict:
    """Every (variant, G, seed) run in `args.workers` processes, and the starting checkpoint's accuracy."""
    jobs = [(v, g, s, run_overrides(v, g, s, args, out / "runs" / f"{v}-G{g}-s{s}"))
            for v in args.variants for g in sorted(args.groups, reverse=True) for s in args.seeds]
    started = time.perf_counter()
    print(f"{len(jobs)} runs ({len(args.variants)} variants x G {args.groups} x seeds {args.seeds}), budget "
          f"{args.budget} completions each, {args.workers} workers", flush=True)
    runs, accuracy_before = run_jobs(
        run_cell, jobs, workers=args.workers, first=(evaluate_start, args),
        describe=lambda r: (f"{r['variant']:<15} G={r['group_size']:<3} seed={r['seed']}  accuracy "
                            f"{r['accuracy_after']:.3f}  steps {r['steps']:>3}  completions "
                            f"{r['completions_sampled']}  ({r['wall_seconds']:.0f} s)"))
    wall = time.perf_counter() - started
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # the workers, reaped when the pool closed
    return {"runs": runs, "accuracy_before": accuracy_before, "wall_seconds": wall,
            "worker_cpu_seconds": usage.ru_utime + usage.ru_stime}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    measured = json.loads(Path(args.from_json).read_text()) if args.from_json else run_grid(args, out)
    runs, accuracy_before = measured["runs"], measured["accuracy_before"]
    wall, cpu = measured["wall_seconds"], measured["worker_cpu_seconds"]
    cells = summarise(runs, args)
    paired = paired_differences(runs, args)
    text = tables(cells, args, accuracy_before, paired)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "from_json")}
    settings["variants"] = {v: VARIANTS[v] for v in args.variants}
    settings["proxy"] = (f"accuracy reward of the training samples (temperature 1) averaged over the last "
                         f"{args.window} sampled completions; completions_to_target is the first point with a full "
                         f"window at or above {args.target}")
    report = {"settings": settings, "accuracy_before": accuracy_before, "wall_seconds": wall,
              "worker_cpu_seconds": cpu, "cpu_count": os.cpu_count(), "python": sys.version.split()[0],
              "cells": cells, "paired_vs_gpg": paired, "runs": runs}
    (out / "ablation.json").write_text(json.dumps(report, indent=1))
    (out / "table.md").write_text(text)
    plot(runs, args, out / "ablation.png")
    print("\n" + text)
    print(f"wall time of the grid {wall:.0f} s ({math.ceil(wall / 60)} min); CPU time of the workers {cpu:.0f} s "
          f"({cpu / args.workers / 60:.1f} min per worker); wrote {out / 'ablation.json'}, {out / 'table.md'}, "
          f"{out / 'ablation.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
