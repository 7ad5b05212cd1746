"""Gradient variance of the policy-gradient estimators, measured on a fixed checkpoint and prompt set.

    python scripts/grad_variance.py                       # embedded tiny model, 8 shapes prompts, K=32 batches
    python scripts/grad_variance.py --model runs/a/final --batches 64 --age

For every G, K independent batches are drawn: the same P prompts, G fresh completions each (temperature
and length from the shapes config), scored by the task. Each batch's flattened policy gradient is
computed with the trainer's update maths (`scoring.token_logps`, an estimator from
`objective.ADVANTAGE_ESTIMATORS`, `objective.policy_loss` with a `LOSS_NORMALIZERS` denominator), once
per estimator on the SAME completions; no optimizer step is taken. Reported per (estimator, G):

    relative variance = mean_k ||g_k - mean(g)||^2 / ||mean(g)||^2

which is scale-free, so estimators whose gradients differ in scale (std-normalized) or in expectation
(the group mean's (G-1)/G shrink) compare fairly. The mean gradient is itself estimated from the K
batches, so a gradient whose true mean is zero still reads about K - 1 (the noise level): values near
K - 1 mean that the K batches could not resolve the mean gradient from the noise.
By default the loss is the mean over all B x G sequences (alpha = 1), so AGE's random rescaling does
not mix into the estimator's variance; `--age` uses the AGE normalizer instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ESTIMATORS = ("none", "group_mean", "std_normalized")  # no baseline, group-mean baseline, GRPO-style


def relative_variance(grads: torch.Tensor) -> float:
    """grads [K, P] -> mean squared distance of the rows to their mean, over the mean's squared norm."""
    grads = grads.double()  # [K, P]
    mean = grads.mean(dim=0)  # [P]
    spread = (grads - mean).pow(2).sum(dim=1).mean()  # []
    signal = mean.pow(2).sum()  # []
    return float(spread / signal) if signal > 0 else float("inf")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="a model alias (configs/model/) or a checkpoint directory")
    parser.add_argument("--prompts", type=int, default=8, help="P, the fixed prompts (first rows of shapes train)")
    parser.add_argument("--batches", type=int, default=32, help="K, independent batches per G")
    parser.add_argument("--groups", type=int, nargs="+", default=[2, 4, 8, 16], help="group sizes G")
    parser.add_argument("--age", action="store_true", help="normalize by the valid groups' sequences (AGE)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/grad_variance", help="output folder (json, table.md, png)")
    args = parser.parse_args(argv)
    if args.batches < 2:
        parser.error("--batches must be at least 2 to measure a variance")
    return args


def batch_gradients(policy, task, rows, *, group_size: int, rollout, age: bool) -> tuple[dict, dict]:
    """Sample one batch (G completions for each row) and return {estimator: flat gradient [P]} and stats."""
    from gpg_vl.config.schema import TrainerSettings
    from gpg_vl.data.stream import PromptStream
    from gpg_vl.models import scoring
    from gpg_vl.objective import ADVANTAGE_ESTIMATORS, LOSS_NORMALIZERS, policy_loss
    from gpg_vl.rollout.engine import build_engine
    from gpg_vl.train.step.sample import sample_attempt

    stream = PromptStream(rows, seed=0)
    trainer = TrainerSettings(batch_size=len(rows), group_size=group_size, reward_workers=1)
    attempt = sample_attempt(policy, task, stream, engine=build_engine(rollout, policy), trainer=trainer,
                             rollout=rollout, warn=print)
    mask = attempt.rollout.completion_mask  # [N, C]
    width = max(int(mask.sum(dim=1).max()), 1)
    mask, ids = mask[:, :width], attempt.rollout.completion_ids[:, :width]  # [N, C']
    sequences = mask.shape[0]
    path = scoring.choose_scoring_path(policy.family, policy.model, share_prompt=False, share_vision=True)
    logps = scoring.token_logps(policy.family, policy.model, attempt.prompts,
                                [n // group_size for n in range(sequences)], ids, mask, path=path,
                                temperature=rollout.temperature)  # [N, C']
    params = [p for p in policy.model.parameters() if p.requires_grad]
    grads, stats = {}, {"reward_mean": float(attempt.rewards.mean())}
    for name in ESTIMATORS:
        advantages, valid = ADVANTAGE_ESTIMATORS[name](attempt.rewards)  # [B, G], [B]
        normalizer = LOSS_NORMALIZERS[age](int(valid.sum()) * group_size, sequences)
        loss, _ = policy_loss(logps, mask, advantages.flatten(), normalizer=normalizer)
        parts = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        grads[name] = torch.cat([(g if g is not None else torch.zeros_like(p)).flatten().float()
                                 for g, p in zip(parts, params, strict=True)])  # [P]
        stats[f"valid_fraction/{name}"] = float(valid.float().mean())
    return grads, stats


def measure(args: argparse.Namespace) -> dict:
    from omegaconf import OmegaConf

    from gpg_vl.cli import build_policy, build_task
    from gpg_vl.config.compose import load_config
    from gpg_vl.config.schema import RolloutSettings

    cfg = load_config("train", ["task=shapes", f"model={args.model}"])
    task = build_task(cfg.task, cfg.data)
    policy = build_policy(cfg.model, "cpu")
    policy.model.train()
    rollout = RolloutSettings(**OmegaConf.to_container(cfg.rollout, resolve=True))
    rows = list(task.load(task.train_split)[:args.prompts])
    torch.manual_seed(args.seed)
    results = {}
    for group_size in args.groups:
        started = time.perf_counter()
        stacks = {name: [] for name in ESTIMATORS}
        stats = []
        for _ in range(args.batches):
            grads, info = batch_gradients(policy, task, rows, group_size=group_size, rollout=rollout, age=args.age)
            for name in ESTIMATORS:
                stacks[name].append(grads[name])
            stats.append(info)
        for name in ESTIMATORS:
            grads = torch.stack(stacks[name])  # [K, P]
            mean = grads.double().mean(dim=0)  # [P]
            distances = (grads.double() - mean).pow(2).sum(dim=1)  # [K]
            results[f"{name}/G={group_size}"] = {
                "estimator": name, "group_size": group_size, "relative_variance": relative_variance(grads),
                "mean_grad_norm": float(mean.norm()), "mean_squared_distance": float(distances.mean()),
                "largest_batch_share": float(distances.max() / distances.sum()) if distances.sum() > 0 else 0.0,
                "valid_fraction": sum(s[f"valid_fraction/{name}"] for s in stats) / len(stats),
            }
        reward = sum(s["reward_mean"] for s in stats) / len(stats)
        print(f"G={group_size:<3} {args.batches} batches in {time.perf_counter() - started:.0f} s, mean reward "
              f"{reward:.3f}", flush=True)
    return results


def table(results: dict, args: argparse.Namespace) -> str:
    normalizer = "AGE (valid sequences)" if args.age else "all B x G sequences (alpha = 1)"
    lines = [f"Relative gradient variance (K={args.batches} batches of P={args.prompts} prompts x G completions; "
             f"loss normalized by {normalizer}; pure-noise level K-1 = {args.batches - 1})", "",
             "| estimator | " + " | ".join(f"G={g}" for g in args.groups) + " |",
             "|---|" + "---|" * len(args.groups)]
    for name in ESTIMATORS:
        lines.append(f"| {name} | " + " | ".join(f"{results[f'{name}/G={g}']['relative_variance']:.2f}"
                                                 for g in args.groups) + " |")
    lines += ["", "Share of the spread (sum of squared distances to the mean) due to the single farthest batch", "",
              *lines[2:4]]
    for name in ESTIMATORS:
        lines.append(f"| {name} | " + " | ".join(f"{results[f'{name}/G={g}']['largest_batch_share']:.2f}"
                                                 for g in args.groups) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict, args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(5.2, 3.6))
    for name in ESTIMATORS:
        axis.plot(args.groups, [results[f"{name}/G={g}"]["relative_variance"] for g in args.groups], marker="o",
                  label=name)
    axis.axhline(args.batches - 1, color="grey", linestyle=":", linewidth=1, label="noise level K-1")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xticks(args.groups, [str(g) for g in args.groups])
    axis.set_xlabel("group size G")
    axis.set_ylabel("relative variance of the gradient")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results = measure(args)
    wall = time.perf_counter() - started
    text = table(results, args)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    (out / "grad_variance.json").write_text(json.dumps({"settings": settings, "wall_seconds": wall,
                                                        "results": results}, indent=1))
    (out / "table.md").write_text(text)
    plot(results, args, out / "grad_variance.png")
    print("\n" + text)
    print(f"wall time {wall:.0f} s; wrote {out / 'grad_variance.json'}, {out / 'table.md'}, "
          f"{out / 'grad_variance.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
