"""What a process without data of its own feeds the model, so that it still makes the same collective calls
as the processes that have data (the rules are in gpg_vl/distributed.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from gpg_vl.models.batch import PromptBatch
    from gpg_vl.models.load import Policy


def placeholder_prompts(policy: Policy) -> PromptBatch:
    """One prompt holding a blank image: what a process without data feeds the model so that it still runs
    the same modules (the vision tower included) as the processes that have data (the family builds it)."""
    return policy.family.placeholder_prompts()


def placeholder_chunk(policy: Policy, attempts: list, device: torch.device):
    """A micro-batch (prompts, prompt_index, ids [1, 1], mask [1, 1], adv [1]) with one real sequence of
    this process (the first token of its first completion), or the blank-image prompt if it has none.
    Its loss is multiplied by zero: it adds nothing to the gradient, but runs every module."""
    for attempt in attempts:
        if attempt.rollout is not None:
            rollout = attempt.rollout
            return (attempt.prompts, [0], rollout.completion_ids[:1, :1], rollout.completion_mask[:1, :1],
                    torch.zeros(1))
    prompts = placeholder_prompts(policy)
    ids = torch.full((1, 1), policy.family.pad_id, dtype=torch.long)
    return prompts, [0], ids, torch.ones(1, 1, dtype=torch.bool), torch.zeros(1)
