"""Run reports: the learning curves of a metrics.jsonl as a PNG."""

from __future__ import annotations

import json
from pathlib import Path


def write_curves(metrics_path: Path, out_path: Path) -> None:
    """Plot reward, valid fraction and alpha over the steps of a run, and the held-out accuracy at the steps
    trainer.eval_every evaluated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in rows]
    evaluated = [(r["step"], r["eval_accuracy"]) for r in rows if isinstance(r.get("eval_accuracy"), (int, float))]
    figure, axes = plt.subplots(1, 4 if evaluated else 3, figsize=(17 if evaluated else 13, 3.6))
    if evaluated:
        axes[3].plot(*zip(*evaluated, strict=True), marker="o", linewidth=1.6)
        axes[3].set_title("held-out accuracy (trainer.eval_every)")
        axes[3].set_xlabel("step")
        axes[3].grid(alpha=0.3)
    for axis, key, label in zip(axes[:3], ("reward_mean", "valid_fraction", "alpha"),
                                ("mean reward", "valid fraction (first rollout)", "alpha = B / (B - M)"),
                                strict=True):
        values = [r[key] for r in rows]
        window = max(1, len(values) // 15)
        smooth = [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
                  for i in range(len(values))]
        axis.plot(steps, values, linewidth=0.8, alpha=0.35)
        axis.plot(steps, smooth, linewidth=1.6, label=f"mean of last {window}")
        axis.legend(loc="best", fontsize=8)
        axis.set_title(label)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(out_path, dpi=110)
    plt.close(figure)
