"""GPG against the GRPO family (grpo, dr_grpo, dapo by default; any preset of configs/algorithm/ or any registered
loss with --algorithms) on any task and model, at an equal budget of sampled completions (or of sampled tokens:
--budget-tokens).

    python scripts/compare.py                                  # task=shapes model=tiny, 4 algorithms x 3 seeds
    python scripts/compare.py --quick --out /tmp/c             # machinery only (CI): a tiny budget, 2 seeds
    python scripts/compare.py --budget 512 task=geoqa model=qwen2.5-vl-3b trainer.lr=1e-6   # any task/model/keys
    python scripts/compare.py --zoom --out runs/compare-zoom   # multi-turn: +experiment=zoom-tiny (zoom_in tool)
    python scripts/compare.py --zoom --budget-tokens 40000     # an equal budget of sampled tokens instead
    python scripts/compare.py --algorithms gpg gspo sapo vespo gmpo bnpo   # the 2026 losses (docs/algorithms.md)

Each run is the trainer itself (`gpg_vl.cli.train_main`, through gpg_vl/experiments.py's `run_cell`) with
`algorithm=<name>` (configs/algorithm/; a registered loss without a preset, e.g. bnpo, runs as
`algorithm=grpo trainer.kl_coef=0 trainer.loss=<name> trainer.aggregation=<the loss's own>`), the same B, G,
seed and budget (`trainer.max_completions`; completions drawn by resampling count too; with --budget-tokens N,
`trainer.max_sampled_tokens=N` instead: tokens the policy generated, tool observations excluded, each run
stopping at the first step that reaches N), in `--workers` processes (gpg_vl/experiments.py, which
scripts/ablate.py shares). Per run: held-out accuracy after training, wall time, seconds per step and the peak
memory of the run above its start (gpg_vl/experiments.py's Meter, as scripts/bench.py measures: CUDA's peak
allocation on a GPU, the kernel's resident high-water mark on Linux CPUs). Writes compare.json (every number),
table.md (accuracy mean ± std, cost, paired differences against gpg as in ablate.py, one sentence per claim
marked supported or not supported by these data) and compare.png (one panel per algorithm: the training-sample
accuracy proxy against completions sampled, and against wall time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from gpg_vl.experiments import mean_std, paired_differences, run_jobs, run_measured, running_proxy

ALGORITHMS = ("gpg", "grpo", "dr_grpo", "dapo")  # the default comparison
PRESETS = Path(__file__).resolve().parent.parent / "configs" / "algorithm"


def runnable() -> list[str]:
    """What --algorithms takes: every preset of configs/algorithm/ and every registered policy loss."""
    from gpg_vl.config import names

    return sorted({path.stem for path in PRESETS.glob("*.yaml")} | set(names.REGISTRIES["losses"][2]))


def algorithm_overrides(name: str) -> list[str]:
    """The keys that pick `name`: its preset, else GRPO's settings without the KL, with the loss and the
    aggregation it fixes (a registered loss without a preset)."""
    if (PRESETS / f"{name}.yaml").is_file():
        return [f"algorithm={name}"]
    from gpg_vl.objective import get_policy_loss, loss_aggregation

    aggregation = loss_aggregation(get_policy_loss(name), "seq_mean_token_mean")
    return ["algorithm=grpo", "trainer.kl_coef=0", f"trainer.loss={name}", f"trainer.aggregation={aggregation}"]
DEFAULT = {"seeds": [0, 1, 2], "budget": 512, "batch_size": 8, "group_size": 8, "eval_limit": 200, "window": 128}
QUICK = {"seeds": [0, 1], "budget": 8, "batch_size": 2, "group_size": 2, "eval_limit": 4, "window": 4}
# --zoom: thinking with images on CPU (docs/thinking-with-images.md), rollouts of up to 2 turns with zoom_in
ZOOM = {**DEFAULT, "budget": 768, "eval_limit": 100}  # 12 steps: where GPG has learnt to zoom (docs/results/zoom.md)
BASES = {"shapes": ["task=shapes", "model=tiny"], "zoom": ["+experiment=zoom-tiny"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="key=value for every run (task=..., model=..., trainer.*)")
    parser.add_argument("--quick", action="store_true", help="a seconds-long comparison that checks the machinery")
    parser.add_argument("--zoom", action="store_true",
                        help="the multi-turn zoom task (+experiment=zoom-tiny: the cold-start model, zoom_in)")
    parser.add_argument("--out", default="runs/compare")
    parser.add_argument("--workers", type=int, default=2,
                        help="worker processes, each on the cores divided among them (OMP_NUM_THREADS where set)")
    parser.add_argument("--algorithms", nargs="+", choices=runnable(), default=list(ALGORITHMS),
                        help="presets of configs/algorithm/ or registered losses (gpg among them)")
    parser.add_argument("--seeds", type=int, nargs="+")
    parser.add_argument("--budget", type=int, help="sampled completions per run (a multiple of B x G)")
    parser.add_argument("--budget-tokens", type=int,
                        help="sampled tokens per run (trainer.max_sampled_tokens) instead of --budget's completions")
    parser.add_argument("--batch-size", type=int, help="B, prompts per step")
    parser.add_argument("--group-size", type=int, help="G, completions per prompt")
    parser.add_argument("--eval-limit", type=int, help="held-out rows evaluated after training")
    parser.add_argument("--window", type=int, help="completions averaged by the running reward proxy")
    args = parser.parse_args(argv)
    if args.budget_tokens is not None and (args.budget is not None or args.budget_tokens < 1):
        parser.error("--budget-tokens takes a number of tokens >= 1, in place of --budget (not with it)")
    for key, value in (QUICK if args.quick else ZOOM if args.zoom else DEFAULT).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if "gpg" not in args.algorithms:
        parser.error("--algorithms must include gpg: every difference is taken against it")
    if args.budget_tokens is None and args.budget % (args.batch_size * args.group_size):
        parser.error(f"--budget {args.budget} must be a multiple of B x G = {args.batch_size * args.group_size}")
    # what ablate.py's summaries read
    args.variants, args.groups, args.target = args.algorithms, [args.group_size], 1.0
    return args


def budget_overrides(args: argparse.Namespace) -> list[str]:
    """The budget every run shares: completions (max_steps = budget / (B x G) when no group is resampled), or
    tokens (max_steps = budget / (B x G) bounds the run: every completion samples at least one token)."""
    per_step = args.batch_size * args.group_size
    if args.budget_tokens is not None:
        return [f"trainer.max_sampled_tokens={args.budget_tokens}",
                f"trainer.max_steps={max(1, -(-args.budget_tokens // per_step))}"]
    return [f"trainer.max_completions={args.budget}", f"trainer.max_steps={args.budget // per_step}"]


def budget_text(args: argparse.Namespace) -> str:
    return f"{args.budget_tokens} sampled tokens" if args.budget_tokens is not None else \
        f"{args.budget} sampled completions"


def run_overrides(algorithm: str, seed: int, args: argparse.Namespace, output_dir: Path) -> list[str]:
    return [*BASES["zoom" if args.zoom else "shapes"], *args.overrides, *algorithm_overrides(algorithm), f"seed={seed}",
            f"output_dir={output_dir}", f"trainer.group_size={args.group_size}",
            f"trainer.batch_size={args.batch_size}", *budget_overrides(args),
            "trainer.eval_before=false", f"eval.limit={args.eval_limit}"]


def run_all(args: argparse.Namespace, out: Path) -> dict:
    jobs = [(a, args.group_size, s, run_overrides(a, s, args, out / "runs" / f"{a}-s{s}"))
            for a in args.algorithms for s in args.seeds]
    print(f"{len(jobs)} runs ({', '.join(args.algorithms)} x seeds {args.seeds}), {budget_text(args)} each, "
          f"B={args.batch_size} G={args.group_size}, {args.workers} workers", flush=True)
    started = time.perf_counter()
    # a fresh process per run: every run's memory is measured from the same start; --quick checks the machinery
    # only, so its workers take run after run (the meter still resets the peak for each)
    runs, _ = run_jobs(run_measured, jobs, workers=args.workers, fresh_process=not args.quick,
                       describe=lambda r: (f"{r['variant']:<8} seed={r['seed']}  accuracy {r['accuracy_after']:.3f}  "
                                           f"steps {r['steps']}  tokens {r['tokens_sampled']}  "
                                           f"{r['seconds_per_step']:.2f} s/step  peak {r['peak_mib']:.0f} MiB  "
                                           f"({r['wall_seconds']:.0f} s)"))
    return {"runs": runs, "wall_seconds": time.perf_counter() - started}


def claims(cells: dict, paired: list[dict]) -> list[dict]:
    """One sentence per claim of the paper, with its measurement, marked supported or not by these data.

    Accuracy: supported when the mean paired difference (gpg - other) is >= 0; the sentence gives the standard
    error and says when the difference is within 2 standard errors (not significant). Cost: supported when
    gpg's mean seconds per step AND peak memory are below every other algorithm's."""
    by = {p["variant"]: p for p in paired}
    result = []

    def accuracy_claim(text: str, others: list[str]) -> None:
        present = [o for o in others if o in by]
        if not present:
            return
        ok = all(by[o]["gpg_minus_variant"] >= 0 for o in present)
        parts = []
        for o in present:
            difference, error = by[o]["gpg_minus_variant"], by[o]["standard_error"]
            noise = ", within 2 SE: not significant" if abs(difference) <= 2 * error else ""
            parts.append(f"gpg - {o} = {difference:+.3f} ± {error:.3f} ({by[o]['pairs']} seed pairs{noise})")
        result.append({"claim": text, "supported": ok, "measurement": "; ".join(parts)})

    accuracy_claim("GPG ≥ GRPO at equal samples", ["grpo"])
    accuracy_claim("GPG ≥ Dr. GRPO / DAPO", ["dr_grpo", "dapo"])
    others = [a for a in cells if a != "gpg"]
    if others:
        gpg = cells["gpg"]
        ok = all(gpg["seconds_per_step"] < cells[o]["seconds_per_step"] and gpg["peak_mib"] < cells[o]["peak_mib"]
                 for o in others)
        parts = [f"{a} {c['seconds_per_step']:.2f} s/step, {c['peak_mib']:.0f} MiB" for a, c in cells.items()]
        result.append({"claim": "GPG is cheaper per step (time and memory)", "supported": ok,
                       "measurement": "; ".join(parts)})
    return result


def summarise(runs: list[dict], args: argparse.Namespace) -> tuple[dict, list[dict], list[dict], str]:
    cells = {}
    for algorithm in args.algorithms:
        chosen = [r for r in runs if r["variant"] == algorithm]
        accuracy, spread = mean_std([r["accuracy_after"] for r in chosen])
        cells[algorithm] = {"accuracy_mean": accuracy, "accuracy_std": spread,
                            "seconds_per_step": statistics.fmean(r["seconds_per_step"] for r in chosen),
                            "wall_seconds": statistics.fmean(r["wall_seconds"] for r in chosen),
                            "peak_mib": statistics.fmean(r["peak_mib"] for r in chosen),
                            "steps": statistics.fmean(r["steps"] for r in chosen),
                            "completions_sampled": statistics.fmean(r["completions_sampled"] for r in chosen),
                            "tokens_sampled": statistics.fmean(r["tokens_sampled"] for r in chosen)}
    paired = paired_differences(runs, args)
    stated = claims(cells, paired)
    lines = [f"Held-out accuracy after training, {budget_text(args)} per run (B={args.batch_size}, "
             f"G={args.group_size}, first {args.eval_limit} test rows, greedy), mean ± std over seeds {args.seeds}; "
             "cost: mean over seeds of seconds per step (one rollout and its optimizer steps), wall seconds of the "
             "run (model load and evaluation included), peak memory above the run's start; what each run sampled "
             "(mean over seeds): completions, and tokens (generated only, tool observations excluded)", "",
             "| algorithm | accuracy | s/step | run wall s | peak MiB | steps | completions | tokens |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {a} | {c['accuracy_mean']:.3f} ± {c['accuracy_std']:.3f} | {c['seconds_per_step']:.2f} | "
              f"{c['wall_seconds']:.0f} | {c['peak_mib']:.0f} | {c['steps']:.1f} | {c['completions_sampled']:.0f} | "
              f"{c['tokens_sampled']:.0f} |" for a, c in cells.items()]
    lines += ["", "Paired by seed: gpg minus the algorithm, mean ± standard error", "",
              "| algorithm | gpg - algorithm | pairs |", "|---|---|---|"]
    lines += [f"| {p['variant']} | {p['gpg_minus_variant']:+.3f} ± {p['standard_error']:.3f} | {p['pairs']} |"
              for p in paired]
    lines += ["", "Claims:", ""]
    lines += [f"- {c['claim']}: **{'supported' if c['supported'] else 'not supported'}** by these data "
              f"({c['measurement']})." for c in stated]
    return cells, paired, stated, "\n".join(lines) + "\n"


def plot(runs: list[dict], args: argparse.Namespace, path: Path) -> None:
    """Two rows, one panel per algorithm: the running proxy against completions sampled (with --budget-tokens:
    tokens sampled); against wall time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_tokens = args.budget_tokens is not None

    figure, axes = plt.subplots(2, len(args.algorithms), figsize=(3.6 * len(args.algorithms), 6.4), sharey=True,
                                squeeze=False)
    for column, algorithm in enumerate(args.algorithms):
        for run in (r for r in runs if r["variant"] == algorithm):
            points = running_proxy(run["curve"], args.window)
            seconds, elapsed = [], 0.0
            for point in run["curve"]:
                elapsed += point["step_s"]
                seconds.append(elapsed)
            values = [p[1] for p in points]
            spent = [point["tokens"] for point in run["curve"]] if by_tokens else [p[0] for p in points]
            axes[0][column].plot(spent, values, label=f"seed {run['seed']}")
            axes[1][column].plot(seconds, values, label=f"seed {run['seed']}")
        axes[0][column].set_title(algorithm)
        axes[0][column].set_xlabel("tokens sampled" if by_tokens else "completions sampled")
        axes[1][column].set_xlabel("training seconds")
        for axis in (axes[0][column], axes[1][column]):
            axis.grid(alpha=0.3)
    for row in range(2):
        axes[row][0].set_ylabel(f"train accuracy, last {args.window} samples")
    axes[0][-1].legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    measured = run_all(args, out)
    cells, paired, stated, text = summarise(measured["runs"], args)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "variants", "groups", "target")}
    report = {"settings": settings, "wall_seconds": measured["wall_seconds"], "cpu_count": os.cpu_count(),
              "cells": cells, "paired_vs_gpg": paired, "claims": stated, "runs": measured["runs"]}
    (out / "compare.json").write_text(json.dumps(report, indent=1))
    (out / "table.md").write_text(text)
    plot(measured["runs"], args, out / "compare.png")
    print("\n" + text)
    print(f"wall time {measured['wall_seconds']:.0f} s; wrote {out / 'compare.json'}, {out / 'table.md'}, "
          f"{out / 'compare.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
