"""Grouped rollouts: what every engine (gpg_vl/rollout/) returns for B prompts, B x G completions.

A completion's mask covers its tokens up to and including the first end-of-sequence token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from gpg_vl.models.batch import PromptBatch


@dataclass
class Rollout:
    """B x G completions; row b * G + g is the g-th completion of prompt b."""

    completion_ids: Tensor  # [B * G, C]
    completion_mask: Tensor  # [B * G, C] bool, True up to and including the first EOS
    texts: list[str]  # B * G decoded completions (special tokens removed)
    group_size: int
    # [B * G, C] the sampler's log-prob of each sampled token (an engine with its own weights: vLLM), or None
    sampler_logps: Tensor | None = None
    # multi-turn (rollout.max_turns > 1): [B * G, C] float, 1 on generated tokens only (observations 0, and a
    # whole trajectory 0 when a limit cut it under on_limit=mask); None: completion_mask is the loss mask
    loss_mask: Tensor | None = None
    trajectories: list | None = None  # B * G Trajectory (rollout/multiturn/trajectory.py), or None for single turns
    # an engine with its own weights (vLLM server): per row, the oldest weight version (sync number) that sampled
    # any of its tokens; None: the trained model's own weights
    weight_versions: list[int] | None = None
    rejected: list[int] = field(default_factory=list)  # prompts the engine refused (too long for it): skip them
    # with a teacher (teacher.model): {"student": [B * G, C], "teacher": [B * G, C]} log-probs of the sampled tokens
    # as the update scored them (gpg_vl/train/teacher/signal.py), for the rollout log's per-token colours; else None
    token_logps: dict | None = None
    rejected_reasons: dict[int, str] = field(default_factory=dict)  # prompt -> the engine's own message

    def keep_prompts(self, prompts: list[int]) -> Rollout:
        """The rows of the prompts at `prompts` (b * G + g for each), in that order; nothing rejected left."""
        index = [b * self.group_size + g for b in prompts for g in range(self.group_size)]
        rows = torch.tensor(index, dtype=torch.long, device=self.completion_ids.device)

        def take(tensor):
            return tensor.index_select(0, rows) if tensor is not None else None

        return Rollout(take(self.completion_ids), take(self.completion_mask), [self.texts[i] for i in index],
                       self.group_size, take(self.sampler_logps), take(self.loss_mask),
                       [self.trajectories[i] for i in index] if self.trajectories is not None else None,
                       [self.weight_versions[i] for i in index] if self.weight_versions is not None else None)

    def sampled_tokens(self) -> int:
        """The tokens the policy sampled for these B * G completions (trainer.max_sampled_tokens counts them):
        a single turn's completion tokens (its mask: up to and including the first EOS); a multi-turn
        trajectory's generated tokens only (tool observations excluded; a trajectory that a limit masked out of
        the loss still counts: it was sampled)."""
        if self.trajectories is not None:
            return sum(sum(t.loss_mask) for t in self.trajectories)
        return int(self.completion_mask.sum())


def completion_mask_from_eos(completion_ids: Tensor, eos_ids: list[int], *, ignore_eos: bool = False) -> Tensor:
    """[N, C] bool mask: True up to and including the first EOS of each row (all True with ignore_eos)."""
    if ignore_eos or not eos_ids:
        return torch.ones_like(completion_ids, dtype=torch.bool)
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))  # [N, C]
    eos_seen_before = (is_eos.long().cumsum(dim=1) - is_eos.long()) > 0  # [N, C]
    return ~eos_seen_before


def in_task_frame(policy, task, texts: list[str], prompts: PromptBatch, group_size: int) -> list[str]:
    """Completions as the task scores them: with what the chat template opened in the prompt for them (a
    think block), and boxes (and, for a task that reads clicks, `uses_points`, points) moved from the model's frame
    into original pixels. `policy` is a
    gpg_vl.models.load.Policy (not imported: models.load reads the settings schema, whose rollout check reads
    the engines, which import this module)."""
    prefixes = [policy.family.completion_prefix(text) for text in prompts.texts] if prompts.texts else []
    if prefixes:
        texts = [prefixes[i // group_size] + text for i, text in enumerate(texts)]
    points = bool(getattr(task, "uses_points", False))
    if not (getattr(task, "uses_boxes", False) or points) or not prompts.image_sizes:
        return texts
    return [policy.family.completion_to_original(text, prompts.image_sizes[i // group_size], points=points)
            for i, text in enumerate(texts)]
