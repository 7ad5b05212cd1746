"""The update's micro-batches: a rollout's valid groups cut by count or by tokens of forward work (`forward_cost`:
padded, or packed where that saves), in mini-batches for the GRPO family's several optimizer steps. Whether a
micro-batch runs packed is decided once, as it is cut, and carried on it (`MicroBatch.packed`)."""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import numpy as np
import torch

from gpg_vl.models import scoring
from gpg_vl.models.batch import PromptBatch
from gpg_vl.models.scoring import ScoringPath
from gpg_vl.train.step.sample import Attempt


def update_chunks(attempts: list[Attempt], micro_batch_size: int, micro_batch_tokens: int = 0, *,
                  share_prompt: bool = False, packed: bool = False, min_padding: float = 0.0):
    """Sequences of valid groups only, as `MicroBatch`es (prompts, prompt index, ids [n, C], mask [n, C], adv [n],
    the sampler's log-probs [n, C] or None: engine-sampled log-probs for the on-policy check; for multi-turn
    trajectories their loss mask [n, C] and the trajectories themselves).

    With `micro_batch_tokens` > 0, a micro-batch holds as many sequences as fit in that many tokens of
    forward work (`forward_cost`: padding included, or real tokens only where it runs `packed`, which with
    `min_padding` is where padding would add that share of tokens); groups go longest first and each group's
    sequences longest first, so neighbours have similar lengths. A
    sequence over the budget on its own gets a micro-batch of its own. Otherwise `micro_batch_size`
    sequences at a time, in order. Where the path packs, each micro-batch carries whether it runs packed
    (`forward_cost`'s decision, made here once).
    """
    path = ScoringPath(prompt_once=share_prompt, packed=packed, min_padding=min_padding)
    for attempt in attempts:
        group_size = attempt.rollout.group_size if attempt.rollout else 1
        groups = attempt.valid.nonzero().flatten().tolist()
        if not groups:  # nothing to train on (an attempt of a process without prompts has no rollout)
            continue
        if micro_batch_tokens > 0:
            batches = _token_budget_batches(attempt, groups, group_size, micro_batch_tokens, path)
        else:
            sequences = [b * group_size + g for b in groups for g in range(group_size)]
            batches = [(chosen, _runs_packed(attempt, chosen, group_size, path)) for chosen in
                       (sequences[i:i + micro_batch_size] for i in range(0, len(sequences), micro_batch_size))]
        rollout = attempt.rollout
        for chosen, runs_packed in batches:
            mask = rollout.completion_mask[chosen]  # [n, C]
            width = max(int(mask.sum(dim=1).max()), 1)
            sampler, loss_mask = rollout.sampler_logps, rollout.loss_mask
            yield MicroBatch(attempt.prompts, [s // group_size for s in chosen],
                             rollout.completion_ids[chosen, :width], mask[:, :width],
                             attempt.advantages.flatten()[chosen], None if sampler is None else sampler[chosen, :width],
                             None if loss_mask is None else loss_mask[chosen, :width].bool(),
                             None if rollout.trajectories is None else [rollout.trajectories[s] for s in chosen],
                             rows=chosen, task=attempt.task, packed=runs_packed)


def _token_budget_batches(attempt: Attempt, groups: list[int], group_size: int, budget: int,
                          path: ScoringPath) -> list[tuple[list[int], bool | None]]:
    """(sequence indices, whether they run packed: None where the path never packs) of `groups`, longest group first
    and longest sequence first, cut at `budget` tokens."""
    lengths = attempt.rollout.completion_mask.sum(dim=1).tolist()  # [b * G]
    prompt_lengths = attempt.prompts.inputs["attention_mask"].sum(dim=1).tolist()  # [b]
    members = {b: sorted(range(b * group_size, (b + 1) * group_size), key=lambda s: -lengths[s]) for b in groups}
    batches, current, current_packed = [], [], None

    def cost_of(chosen: list[int]) -> tuple[int, bool]:
        return forward_cost(path, [prompt_lengths[s // group_size] for s in chosen], [s // group_size for s in chosen],
                            [lengths[s] for s in chosen])

    for sequence in (s for b in sorted(groups, key=lambda b: -lengths[members[b][0]]) for s in members[b]):
        candidate = current + [sequence]
        cost, packed = cost_of(candidate)
        if current and cost > budget:
            batches.append((current, current_packed))
            candidate = [sequence]
            _, packed = cost_of(candidate)
        current, current_packed = candidate, packed if path.packed else None
    return batches + ([(current, current_packed)] if current else [])


def _runs_packed(attempt: Attempt, chosen: list[int], group_size: int, path: ScoringPath) -> bool | None:
    """Whether the sequences `chosen` of `attempt` run packed on `path` (`forward_cost`); None where it never packs."""
    if not path.packed:
        return None
    prompt_lengths = attempt.prompts.inputs["attention_mask"].sum(dim=1).tolist()  # [b]
    lengths = attempt.rollout.completion_mask.sum(dim=1).tolist()  # [b * G]
    return forward_cost(path, [prompt_lengths[s // group_size] for s in chosen], [s // group_size for s in chosen],
                        [lengths[s] for s in chosen])[1]


def micro_batch_cost(prompt_lengths: list[int], prompt_index: list[int], completion_lengths: list[int], *,
                     share_prompt: bool, packed: bool = False) -> int:
    """Tokens one forward computes for these sequences (`prompt_lengths[n]` is sequence n's prompt's):
    padded, prompts are left-padded to the longest, completions right-padded to the longest; `packed`, the
    real tokens only. With `share_prompt` each distinct prompt runs once."""
    if packed:
        prompts = {p: length for p, length in zip(prompt_index, prompt_lengths, strict=True)}
        return (sum(prompts.values()) if share_prompt else sum(prompt_lengths)) + sum(completion_lengths)
    prompt_width, completion_width = max(prompt_lengths), max(max(completion_lengths), 1)
    prompts = len(set(prompt_index)) if share_prompt else len(prompt_index)
    return prompts * prompt_width + len(prompt_index) * completion_width


def forward_cost(path: ScoringPath, prompt_lengths: list[int], prompt_index: list[int],
                 completion_lengths: list[int]) -> tuple[int, bool]:
    """(tokens one forward of these sequences computes on `path`, whether it runs packed): packed where the path
    packs and padding would add at least `path.min_padding` of the real tokens, else padded."""
    padded = micro_batch_cost(prompt_lengths, prompt_index, completion_lengths, share_prompt=path.prompt_once)
    if not path.packed:
        return padded, False
    packed = micro_batch_cost(prompt_lengths, prompt_index, completion_lengths, share_prompt=path.prompt_once,
                              packed=True)
    return (packed, True) if padded >= packed * (1 + path.min_padding) else (padded, False)


class MicroBatch(NamedTuple):
    """The sequences of one forward/backward: sequence n continues prompt `prompt_index[n]` of `prompts`."""

    prompts: PromptBatch
    prompt_index: list[int]
    completion_ids: torch.Tensor  # [n, C]
    completion_mask: torch.Tensor  # [n, C]
    advantages: torch.Tensor  # [n]
    sampler_logps: torch.Tensor | None = None  # [n, C]: the engine's own log-probs (vLLM), for the on-policy check
    # multi-turn trajectories (rollout.max_turns > 1): completion_mask covers every token of a trajectory (its
    # observations too); the loss counts `loss_mask` [n, C] bool, the generated tokens only
    loss_mask: torch.Tensor | None = None
    trajectories: list | None = None  # n Trajectory: their observations' token types and images go in the forward
    rejected: torch.Tensor | None = None  # [n] bool: sequences the off-policy correction rejected (trainer.correction)
    rows: list[int] | None = None  # each sequence's row in its attempt's rollout (b * G + g)
    weights: torch.Tensor | None = None  # [n, C]: the correction's weights, where resolved before the update's steps
    task: str | None = None  # its task in a mixture (every sequence of a micro-batch is of one task), else None
    packed: bool | None = None  # whether it runs packed (decided as it was cut, `forward_cost`); None: not decided

    @property
    def counted(self) -> torch.Tensor:
        """[n, C] bool: the tokens the loss counts (generated ones, of sequences the correction did not reject)."""
        counted = self.completion_mask if self.loss_mask is None else self.loss_mask
        return counted if self.rejected is None else counted & ~self.rejected.to(counted.device).unsqueeze(1)

    @property
    def kept(self) -> int:
        """The sequences the loss counts (those the correction did not reject)."""
        return len(self.advantages) - (0 if self.rejected is None else int(self.rejected.sum()))

    def logps(self, policy, model, device, *, path: ScoringPath, temperature: float,
              logits_chunk_tokens: int, entropy: bool = False):
        """Log-probs [n, C] of the completions under `model` (a trajectory's observations in its forward),
        packed where the micro-batch was cut to run packed (`packed`; where undecided, as `forward_cost` says on
        `path`); with `entropy`, (log-probs, entropies [n, C])."""
        if path.packed:
            packed = self.packed
            if packed is None:  # a micro-batch cut without a packing path (a placeholder, another model's path)
                prompt_lengths = self.prompts.inputs["attention_mask"].sum(dim=1).tolist()
                _, packed = forward_cost(path, [prompt_lengths[p] for p in self.prompt_index], self.prompt_index,
                                         self.completion_mask.sum(dim=1).tolist())
            path = path if packed else replace(path, packed=False)
        score = scoring.token_logps_and_entropy if entropy else scoring.token_logps
        return score(policy.family, model, self.prompts.to(device), self.prompt_index, self.completion_ids.to(device),
                     self.completion_mask.to(device), path=path, observations=self.trajectories,
                     temperature=temperature, logits_chunk_tokens=logits_chunk_tokens)


def mini_batches(attempts: list[Attempt], parts: int) -> list[list[Attempt]]:
    """This process's valid groups in `parts` contiguous mini-batches of near-equal size, each the attempts
    with their valid masks cut down to its groups (one part: the attempts as they are)."""
    if parts == 1:
        return [attempts]
    groups = [(a, b) for a, attempt in enumerate(attempts) for b in attempt.valid.nonzero().flatten().tolist()]
    result = []
    for chosen in np.array_split(np.arange(len(groups)), parts):
        masks = [torch.zeros_like(attempt.valid) for attempt in attempts]
        for index in chosen.tolist():
            masks[groups[index][0]][groups[index][1]] = True
        result.append([replace(attempt, valid=mask) for attempt, mask in zip(attempts, masks, strict=True)])
    return result
