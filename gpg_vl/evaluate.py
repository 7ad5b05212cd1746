"""Batched greedy decoding on held-out rows, scored by the task's metrics."""

from __future__ import annotations

from collections.abc import Sequence

from gpg_vl.models.base import Policy
from gpg_vl.rollout import generate


def generate_greedy(
    policy: Policy, task, rows: Sequence[dict], *, batch_size: int, max_new_tokens: int, rank: int = 0,
    world_size: int = 1, gather=None, progress=None,
) -> list[str]:
    """Greedy completions for `rows`, in order. Each process decodes its own share of the rows;
    `gather` (e.g. accelerate's gather_object) joins the shares when there are several processes."""
    local = list(range(rank, len(rows), world_size))
    texts: list[tuple[int, str]] = []
    for start in range(0, len(local), batch_size):
        chunk = local[start:start + batch_size]
        prompts = policy.adapter.encode([task.messages(rows[i]) for i in chunk])
        rollout = generate(policy, prompts, group_size=1, max_new_tokens=max_new_tokens, do_sample=False)
        texts += list(zip(chunk, rollout.texts, strict=True))
        if progress is not None:
            progress(len(chunk))
    if world_size > 1 and gather is not None:
        texts = gather(texts)
    return [text for _, text in sorted(texts)]


def evaluate(policy: Policy, task, rows: Sequence[dict], **kwargs) -> tuple[dict[str, float], list[str]]:
    """The task's metrics for greedy completions of `rows`, and the completions."""
    completions = generate_greedy(policy, task, rows, **kwargs)
    return task.metrics(rows, completions), completions
