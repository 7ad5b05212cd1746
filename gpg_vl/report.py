"""Run reports: the learning curves of a metrics.jsonl as a PNG."""

from __future__ import annotations

import json
from pathlib import Path


def write_curves(metrics_path: Path, out_path: Path) -> None:
    """Plot reward, valid fraction and alpha over the steps of a run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in rows]
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for axis, key, label in zip(axes, ("reward_mean", "valid_fraction", "alpha"),
                                ("mean reward", "valid fraction (first rollout)", "alpha = B / (B - M)"),
                                strict=True):
        axis.plot(steps, [r[key] for r in rows], linewidth=1.2)
        axis.set_title(label)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(out_path, dpi=110)
    plt.close(figure)
