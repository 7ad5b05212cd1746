"""The distillation measurements' table (docs/results/distillation.md) from finished runs' output folders.

    python scripts/distill_table.py RUNS_FOLDER [--threshold 0.70]

RUNS_FOLDER holds one output_dir per run, named <label>-s<seed> (e.g. reward-s0, teacher-s0, distill-s0), each
trained with trainer.eval_every=N, and beside it <label>-s<seed>.log, the run's output under `/usr/bin/time -v`
(its peak resident memory). Per run: the first step whose held-out accuracy (eval_accuracy) reaches the threshold
and the tokens sampled by then, the final held-out accuracy (summary.json), the peak memory, the mean
entropy_mean over the first and last 10 steps and over each 25 steps. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

WINDOW = 25  # steps per point of the entropy curve


def first_reach(metrics: list[dict], threshold: float) -> tuple[int, int] | None:
    """(step, tokens sampled by it) of the first held-out evaluation at or above `threshold`, or None."""
    for line in metrics:
        if line.get("eval_accuracy", -1.0) >= threshold:
            return int(line["step"]), int(line["tokens_sampled"])
    return None


def peak_memory_mib(log: Path) -> float | None:
    """`/usr/bin/time -v`'s maximum resident set size, in MiB, from a run's log (None without one)."""
    found = re.search(r"Maximum resident set size \(kbytes\): (\d+)", log.read_text(errors="replace")) \
        if log.is_file() else None
    return int(found.group(1)) / 1024 if found else None


def run_row(folder: Path, threshold: float) -> dict:
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((folder / "summary.json").read_text()) if (folder / "summary.json").is_file() else {}
    final = summary.get("accuracy_after")
    if final is None and metrics:  # an unfinished run: its last held-out evaluation
        final = next((m["eval_accuracy"] for m in reversed(metrics) if "eval_accuracy" in m), None)
    entropy = [m["entropy_mean"] for m in metrics if "entropy_mean" in m]
    return {"run": folder.name, "steps": len(metrics), "reached": first_reach(metrics, threshold), "final": final,
            "memory": peak_memory_mib(folder.parent / f"{folder.name}.log"),
            "entropy_windows": [statistics.mean(entropy[i:i + WINDOW]) for i in range(0, len(entropy), WINDOW)],
            "entropy_first": statistics.mean(entropy[:10]) if entropy else None,
            "entropy_last": statistics.mean(entropy[-10:]) if entropy else None,
            "teacher_kl_last": statistics.mean([m["teacher_kl"] for m in metrics[-10:] if "teacher_kl" in m] or [0])}


def fmt(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path)
    parser.add_argument("--threshold", type=float, default=0.70)
    args = parser.parse_args()
    rows = [run_row(folder, args.threshold) for folder in sorted(args.runs.iterdir())
            if folder.is_dir() and (folder / "metrics.jsonl").is_file()]
    print(f"| run | steps | first step at >= {args.threshold:.2f} | tokens sampled by then | final accuracy | "
          "peak RSS (MiB) | entropy_mean, first 10 steps | last 10 steps | teacher_kl, last 10 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        reached = row["reached"]
        print(f"| {row['run']} | {row['steps']} | {reached[0] if reached else 'not reached'} | "
              f"{reached[1] if reached else '-'} | {fmt(row['final'])} | {fmt(row['memory'], '.0f')} | "
              f"{fmt(row['entropy_first'], '.4f')} | {fmt(row['entropy_last'], '.4f')} | "
              f"{fmt(row['teacher_kl_last'], '.4f')} |")
    windows = max((len(row["entropy_windows"]) for row in rows), default=0)
    print(f"\nentropy_mean (nats per completion token), mean over each {WINDOW} steps\n")
    print("| run | " + " | ".join(f"steps {i * WINDOW + 1}-{(i + 1) * WINDOW}" for i in range(windows)) + " |")
    print("|---|" + "---|" * windows)
    for row in rows:
        print(f"| {row['run']} | " + " | ".join(fmt(v, ".4f") for v in row["entropy_windows"]) + " |")


if __name__ == "__main__":
    main()
