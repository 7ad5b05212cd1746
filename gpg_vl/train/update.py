"""The update: a rollout's valid groups in micro-batches (by count or by tokens of forward work), in
mini-batches for the GRPO family's several optimizer steps, each optimizer step with its loss normalized over
all processes, gradients averaged explicitly under DDP; the frozen reference of a KL loss; the optimizer.

Every count that drives a decision (the loss normalizer, the number of forwards under FSDP / ZeRO-3) is
all-reduced, so every process takes the same branches and reaches the same collectives.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np
import torch
from accelerate import Accelerator

from gpg_vl.config.schema import TrainerSettings
from gpg_vl.distill import high_entropy_mask
from gpg_vl.distributed import forward_is_collective, require_images
from gpg_vl.errors import UserError
from gpg_vl.models import router, scoring
from gpg_vl.models.batch import PromptBatch
from gpg_vl.models.load import Policy
from gpg_vl.models.scoring import ScoringPath
from gpg_vl.objective import (
    AGGREGATIONS,
    LOSS_NORMALIZERS,
    TOKEN_NORMALIZED,
    get_policy_loss,
    loss_aggregation,
    loss_needs,
    loss_options,
)
from gpg_vl.rollout.correction import logp_mismatch
from gpg_vl.rollout.corrections import (
    CORRECTION_METRICS,
    CorrectionSums,
    apply_correction,
    correction_metrics,
    get_correction,
)
from gpg_vl.rollout.engine import Correction
from gpg_vl.train.placeholder import placeholder_chunk
from gpg_vl.train.sample import Attempt
from gpg_vl.train.teacher import scored_chunk, taught_metrics, teach


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
    sequences at a time, in order.
    """
    for attempt in attempts:
        group_size = attempt.rollout.group_size if attempt.rollout else 1
        groups = attempt.valid.nonzero().flatten().tolist()
        if not groups:  # nothing to train on (an attempt of a process without prompts has no rollout)
            continue
        if micro_batch_tokens > 0:
            path = ScoringPath(prompt_once=share_prompt, packed=packed, min_padding=min_padding)
            batches = _token_budget_batches(attempt, groups, group_size, micro_batch_tokens, path)
        else:
            sequences = [b * group_size + g for b in groups for g in range(group_size)]
            batches = [sequences[i:i + micro_batch_size] for i in range(0, len(sequences), micro_batch_size)]
        rollout = attempt.rollout
        for chosen in batches:
            mask = rollout.completion_mask[chosen]  # [n, C]
            width = max(int(mask.sum(dim=1).max()), 1)
            sampler, loss_mask = rollout.sampler_logps, rollout.loss_mask
            yield MicroBatch(attempt.prompts, [s // group_size for s in chosen],
                             rollout.completion_ids[chosen, :width], mask[:, :width],
                             attempt.advantages.flatten()[chosen], None if sampler is None else sampler[chosen, :width],
                             None if loss_mask is None else loss_mask[chosen, :width].bool(),
                             None if rollout.trajectories is None else [rollout.trajectories[s] for s in chosen],
                             rows=chosen)


def _token_budget_batches(attempt: Attempt, groups: list[int], group_size: int, budget: int,
                          path: ScoringPath) -> list[list[int]]:
    """Sequence indices of `groups`, longest group first and longest sequence first, cut at `budget` tokens."""
    lengths = attempt.rollout.completion_mask.sum(dim=1).tolist()  # [b * G]
    prompt_lengths = attempt.prompts.inputs["attention_mask"].sum(dim=1).tolist()  # [b]
    members = {b: sorted(range(b * group_size, (b + 1) * group_size), key=lambda s: -lengths[s]) for b in groups}
    batches, current = [], []
    for sequence in (s for b in sorted(groups, key=lambda b: -lengths[members[b][0]]) for s in members[b]):
        candidate = current + [sequence]
        cost, _ = forward_cost(path, [prompt_lengths[s // group_size] for s in candidate],
                               [s // group_size for s in candidate], [lengths[s] for s in candidate])
        if current and cost > budget:
            batches.append(current)
            candidate = [sequence]
        current = candidate
    return batches + ([current] if current else [])


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
        packed where `forward_cost` says so; with `entropy`, (log-probs, entropies [n, C])."""
        if path.packed:
            prompt_lengths = self.prompts.inputs["attention_mask"].sum(dim=1).tolist()
            _, packed = forward_cost(path, [prompt_lengths[p] for p in self.prompt_index], self.prompt_index,
                                     self.completion_mask.sum(dim=1).tolist())
            path = path if packed else replace(path, packed=False)
        score = scoring.token_logps_and_entropy if entropy else scoring.token_logps
        return score(policy.family, model, self.prompts.to(device), self.prompt_index, self.completion_ids.to(device),
                     self.completion_mask.to(device), path=path, observations=self.trajectories,
                     temperature=temperature, logits_chunk_tokens=logits_chunk_tokens)


@dataclass
class Reference:
    """The frozen reference model (the initial weights) for a loss with a KL term: a copy of them, or with
    LoRA (`model` None) the policy itself with its adapters disabled (PEFT's `disable_adapter()`)."""

    model: torch.nn.Module | None

    def scoring(self, policy_model):
        """(the model to score, the context to score it in)."""
        if self.model is not None:
            return self.model, contextlib.nullcontext()
        return policy_model, getattr(policy_model, "module", policy_model).disable_adapter()  # under DDP's wrapper




LOSS_REPORTS = ("kl", "clip_fraction_low", "clip_fraction_high", "ratio_mean")  # token means, when a loss has them


@dataclass
class Learner:
    """What the update trains and how: the policy and its prepared (possibly wrapped) `model` with their
    optimizer and schedule on `accelerator`; the trainer's `settings`; the rollout's sampling `temperature`;
    the run's scoring `path` (chosen once at setup: `scoring.choose_scoring_path`); the frozen `reference` of a
    KL loss; the completion limit `max_new_tokens` (a loss's max_tokens); the engine's `correction` (its on-policy
    check); under FSDP2 with trainer.max_staleness >= 1, `whole_copy`, a copy of the model taken before it was
    sharded, for the sampler (gpg_vl/train/pipeline.py)."""

    policy: Policy
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    accelerator: Accelerator
    settings: TrainerSettings
    temperature: float
    path: ScoringPath
    reference: Reference | None = None
    max_new_tokens: int | None = None
    correction: Correction = field(default_factory=Correction)
    whole_copy: torch.nn.Module | None = None  # FSDP2 at trainer.max_staleness >= 1: the sampler's, taken unsharded
    teacher: object = None  # teacher.model's frozen Teacher (gpg_vl/train/teacher.py), or None

    @property
    def off_policy(self) -> tuple[str, dict]:
        """trainer.correction and its options; rollout.vllm.tis_cap > 0 (the engine's) is token_tis with that cap."""
        if self.settings.correction == "none" and self.correction.tis_cap > 0:
            return "token_tis", {"cap": self.correction.tis_cap}
        from gpg_vl.rollout.corrections import correction_options

        return self.settings.correction, correction_options(self.settings.correction,
                                                            self.settings.correction_options)

    @property
    def reports_correction(self) -> bool:
        """Whether the update weighs the loss and logs the correction's metrics (the same on every process)."""
        return self.settings.max_staleness > 0 or self.off_policy[0] != "none"


@dataclass
class StepInputs:
    """One optimizer step's share of the update: its micro-batches and what the loss of each takes."""

    chunks: list[MicroBatch]
    loss_fn: object
    old: list[torch.Tensor] | None  # the rollout policy's log-probs, one [n, C] per micro-batch
    ref: list[torch.Tensor] | None  # the reference's
    normalizer: float  # the loss's global denominator
    steps_needed: int  # the most micro-batches any process has for this step
    aggregation: str
    options: dict  # the loss's keyword options (`loss_options`)
    later: bool  # not the rollout's first optimizer step
    sequences: int  # the step's valid sequences over all processes


def trainer_loss_options(settings: TrainerSettings, max_new_tokens: int | None) -> dict:
    """The keyword options of trainer.loss: trainer.loss_options, else the trainer settings of that name,
    else max_tokens = the completion limit (objective.loss_options). Fails in one sentence on an option the
    loss does not declare."""
    defaults = {"clip_low": settings.clip_low, "clip_high": settings.clip_high, "kl_coef": settings.kl_coef,
                "max_tokens": max_new_tokens}
    return loss_options(get_policy_loss(settings.loss), dict(settings.loss_options or {}), defaults,
                        name=settings.loss)


def update(learner: Learner, attempts: list[Attempt]) -> dict[str, float]:
    """The optimizer steps of one rollout: `settings.ppo_epochs` passes over its valid groups, each pass in
    mini-batches of `settings.ppo_mini_batch` sequences (0: the whole rollout, one step per pass).

    GPG (the default) takes one step, on the valid groups only, and needs nothing but the current log-probs.
    A loss whose KL to the reference is on (`kl_on_every_group`) forwards every sampled group instead, the
    invalid ones with zero advantages (only their KL acts), normalized over all sampled sequences as TRL's and
    R1-V's GRPO do, and steps even when no group is valid; its metrics then say `groups_used` (every group
    forwarded), `groups_kl_only` (those forwarded for their KL alone) and `alpha` 1. A loss that declares
    "old" gets the rollout policy's log-probs, computed once here, without gradient, before the first step,
    when there is more than one step (with one, old = current detached: ratio 1); one that declares "ref"
    (with settings.kl_coef > 0) gets the frozen reference's, through the same scoring path.
    `learner.correction`: the on-policy check of an engine that samples with its own weights (see
    `_optimizer_step`). `learner.teacher` (teacher.model: on-policy distillation, gpg_vl/train/teacher.py) forwards
    every sampled group too, each token's advantage its group's plus the teacher's term (or the JSD in the loss);
    a group counts as valid when that combined advantage is not all zero, and the metrics say teacher_kl.
    """
    settings, accelerator = learner.settings, learner.accelerator
    kl_everywhere = kl_on_every_group(settings)
    teacher = learner.teacher
    if kl_everywhere or teacher is not None:  # the KL (as in TRL's and R1-V's GRPO) or the teacher acts on every
        attempts, kl_only = _every_group(attempts, accelerator)  # sampled sequence: invalid groups too
    loss_fn = get_policy_loss(settings.loss)
    aggregation = loss_aggregation(loss_fn, settings.aggregation)
    parts = 1
    if settings.ppo_mini_batch:  # collective: every process takes the same number of optimizer steps
        valid = accelerator.reduce(torch.tensor(sum(int(a.valid.sum()) for a in attempts),
                                                device=accelerator.device), "sum")
        parts = max(1, math.ceil(int(valid) * settings.group_size / settings.ppo_mini_batch))
    plan = [list(update_chunks(part, settings.micro_batch_size, settings.micro_batch_tokens,
                               share_prompt=learner.path.prompt_once, packed=learner.path.packed,
                               min_padding=learner.path.min_padding))
            for part in mini_batches(attempts, parts)]
    groups_rejected = None
    if getattr(get_correction(learner.off_policy[0]), "rejects", False):  # the normalizer leaves rejected sequences
        plan, groups_rejected = _reject_sequences(learner, plan, attempts)
    taught = teach(learner, plan, attempts, _score_plan) if teacher is not None else None  # AGE: combined advantage
    if taught is not None:
        plan = taught.pop("plan")
    counts = _plan_counts(plan, attempts, accelerator)  # [processes, 4 * parts + 2]
    per_part = counts[:, :4 * parts].reshape(counts.shape[0], parts, 4)  # [processes, parts, 4]
    require_images(int(per_part[..., 3].sum()) == 0, accelerator.num_processes, "a training micro-batch")
    if int(per_part[..., 0].sum()) == 0:
        return {"loss": 0.0, "grad_norm": 0.0, "skipped": 1.0, **taught_metrics(taught, settings)}
    column = 1 if aggregation in TOKEN_NORMALIZED else 0  # the normalizer counts tokens, or sequences
    counted, sampled_count = int(per_part[..., column].sum()), int(counts[:, -2 + column].sum())
    needs = loss_needs(loss_fn)
    # Collective under FSDP / ZeRO-3 like the update's forwards: every process scores max-over-processes
    # micro-batches per mini-batch, padding with placeholders whose log-probs are dropped.
    calls = [int(per_part[:, part, 2].max()) for part in range(parts)]
    old, ref = _old_and_ref(learner, plan, attempts, calls, needs, steps=settings.ppo_epochs * parts)
    if settings.max_staleness > 0 and "old" in needs:  # stale rollouts: the ratio is to the policy that sampled them
        old = [[c.sampler_logps for c in chunks] for chunks in plan]
    options = trainer_loss_options(settings, learner.max_new_tokens)
    results, reports = [], []
    for _epoch in range(settings.ppo_epochs):
        for part, chunks in enumerate(plan):
            valid_count = int(per_part[:, part, column].sum())
            share = sampled_count if parts == 1 else sampled_count * valid_count / counted  # AGE off: pro rata
            result, report = _optimizer_step(learner, attempts, StepInputs(
                chunks, loss_fn, old=old[part] if old is not None else None,
                ref=ref[part] if ref is not None else None,
                normalizer=LOSS_NORMALIZERS[settings.age](valid_count, share),
                steps_needed=int(per_part[:, part, 2].max()), aggregation=aggregation, options=options,
                later=bool(results), sequences=int(per_part[:, part, 0].sum())))
            results.append(result)
            reports.append(report)
            if result.get("nonfinite"):  # no weight changed in that step; the rollout's later steps are dropped
                break
        if results[-1].get("nonfinite"):
            break
    metrics = _combine_results(results)
    if groups_rejected is not None:
        metrics["groups_rejected"] = groups_rejected
    metrics.update(taught_metrics(taught, settings))
    if kl_everywhere:  # every sampled group forwarded, normalized over all of them (alpha 1)
        metrics.update({"groups_used": int(per_part[..., 0].sum()) // settings.group_size,
                        "groups_kl_only": kl_only, "alpha": 1.0})
    if needs:  # the same on every process (it depends on the loss only): the collective below matches
        metrics.update(_loss_reports(reports, accelerator))
    return metrics


def kl_on_every_group(settings: TrainerSettings) -> bool:
    """Whether trainer.loss's KL to the reference is on (it declares "ref" and its kl_coef > 0): its KL term then
    acts on every sampled sequence, and the update forwards the groups without signal too (TRL, R1-V)."""
    return needs_reference(settings)


def _every_group(attempts: list[Attempt], accelerator: Accelerator) -> tuple[list[Attempt], int]:
    """The attempts with every group marked for the update, the invalid ones with zero advantages, and the
    number of those (over all processes). Collective: update() calls it on every process or on none."""
    widened, invalid = [], 0
    for attempt in attempts:
        if attempt.rollout is None:  # a process without prompts in this attempt
            widened.append(attempt)
            continue
        keep = attempt.valid.unsqueeze(1)  # [b, 1]
        invalid += int((~attempt.valid).sum())
        widened.append(replace(attempt, valid=torch.ones_like(attempt.valid), advantages=torch.where(
            keep, attempt.advantages, torch.zeros_like(attempt.advantages))))
    total = accelerator.reduce(torch.tensor(invalid, device=accelerator.device), "sum")
    return widened, int(total)


def _plan_counts(plan: list[list[MicroBatch]], attempts: list[Attempt], accelerator: Accelerator) -> torch.Tensor:
    """Per process: for each mini-batch its sequences, tokens, micro-batches and micro-batches without images;
    then every sampled sequence and token. Collective: train() calls update() on every process or on none (its
    test uses global counts), and this gather runs first and unconditionally; every branch of the update
    depends only on its result."""
    sampled = [a.rollout.completion_mask if a.rollout.loss_mask is None else a.rollout.loss_mask.bool()
               for a in attempts if a.rollout is not None]  # [b * G, C] each: the tokens a loss counts
    chunks = [c for part in plan for c in part]
    rejected = [sum(len(c.advantages) - c.kept for c in chunks),  # what the correction rejected leaves the counts
                sum(int((c.completion_mask if c.loss_mask is None else c.loss_mask).sum()) - int(c.counted.sum())
                    for c in chunks)]
    local = torch.tensor([[*(value for chunks in plan for value in (
        sum(c.kept for c in chunks), sum(int(c.counted.sum()) for c in chunks), len(chunks),
        sum(not c.prompts.has_images for c in chunks))),
        sum(len(m) for m in sampled) - rejected[0], sum(int(m.sum()) for m in sampled) - rejected[1]]],
        device=accelerator.device)
    return accelerator.gather(local)  # [processes, 4 * parts + 2]


def _old_and_ref(learner: Learner, plan: list[list[MicroBatch]], attempts: list[Attempt], calls: list[int],
                 needs: tuple[str, ...], *, steps: int):
    """The rollout policy's log-probs (a loss that declares "old", when the rollout takes more than one step)
    and the reference's (one that declares "ref", with kl_coef > 0), per mini-batch and micro-batch."""
    settings = learner.settings
    old = _score_plan(learner, learner.model, plan, attempts, calls) if "old" in needs and steps > 1 else None
    ref = None
    if "ref" in needs and needs_reference(settings):
        if learner.reference is None:
            raise ValueError(f"trainer.loss={settings.loss} with kl_coef > 0 needs a reference model")
        ref_model, scope = learner.reference.scoring(learner.model)
        with scope:
            ref = _score_plan(learner, ref_model, plan, attempts, calls)
    return old, ref


def _combine_results(results: list[dict]) -> dict[str, float]:
    """The update's metrics from its optimizer steps' (means of loss and gradient norm over several)."""
    metrics = dict(results[0]) if len(results) == 1 else {
        "loss": sum(r["loss"] for r in results) / len(results),
        "grad_norm": sum(r["grad_norm"] for r in results) / len(results),
        "skipped": float(all(r["skipped"] for r in results)),
        **({"nonfinite": 1.0} if results[-1].get("nonfinite") else {}),
        **{k: results[0][k] for k in ("logp_mean", "entropy_mean", "teacher_jsd") if k in results[0]},
        **{k: results[0][k] for k in ("logp_mismatch_mean", "logp_mismatch_max", *CORRECTION_METRICS)
           if k in results[0]}}
    metrics["optimizer_steps"] = float(sum(not r["skipped"] for r in results))
    return metrics


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


@torch.no_grad()
def _score_plan(learner: Learner, model, plan: list[list[MicroBatch]], attempts: list[Attempt],
                calls: list[int]) -> list[list[torch.Tensor]]:
    """Log-probs [n, C] of every micro-batch of every mini-batch, without gradient (old or reference), with
    `model` (the learner's, or the reference's). Where `model`'s forward is collective (FSDP / ZeRO-3),
    mini-batch p runs `calls[p]` forwards on every process (the most micro-batches any process has), the
    missing ones on placeholders, dropped here."""
    policy, settings = learner.policy, learner.settings
    device = next(model.parameters()).device

    def score(c: MicroBatch) -> torch.Tensor:
        return c.logps(policy, model, device, temperature=learner.temperature, path=learner.path,
                       logits_chunk_tokens=settings.logits_chunk_tokens)

    collective = forward_is_collective(model)
    scored = []
    for chunks, needed in zip(plan, calls, strict=True):
        scored.append([score(c) for c in chunks])
        for _ in range(needed - len(chunks) if collective else 0):
            score(MicroBatch(*placeholder_chunk(policy, attempts, device)))
    return scored


def _loss_reports(reports: list[dict], accelerator: Accelerator) -> dict[str, float]:
    """Token means over every optimizer step and process of the loss's own metrics (`LOSS_REPORTS`), the
    largest ratio, and `logp_drift` (new minus old log-prob) over the steps after the first. Collective."""
    keys = ("tokens", *LOSS_REPORTS, "later_tokens", "logp_drift")
    local = torch.tensor([[sum(r.get(k, 0.0) for r in reports) for k in keys]
                          + [max((r.get("ratio_max", 0.0) for r in reports), default=0.0)]],
                         dtype=torch.float64, device=accelerator.device)
    gathered = accelerator.gather(local)  # [processes, len(keys) + 1]
    totals = dict(zip(keys, gathered[:, :-1].sum(0).tolist(), strict=True))
    result = {k: totals[k] / max(totals["tokens"], 1.0) for k in LOSS_REPORTS}
    result["ratio_max"] = float(gathered[:, -1].max())
    if totals["later_tokens"]:
        result["logp_drift"] = totals["logp_drift"] / totals["later_tokens"]
    return result


@dataclass
class _Sums:
    """What one optimizer step's micro-batches add up on this process."""

    loss: float = 0.0
    logp: float = 0.0
    tokens: int = 0
    gap: float = 0.0  # the on-policy check: summed |logp - sampler logp|, its largest, its token count
    gap_max: float = 0.0
    gap_count: int = 0
    entropy: float = 0.0  # summed entropy of the counted tokens (entropy_mean = entropy / tokens)
    jsd: float = 0.0  # teacher.loss=jsd: the JSD term of the loss, summed over micro-batches
    report: dict = field(default_factory=dict)
    correction: CorrectionSums = field(default_factory=CorrectionSums)


def _corrected(name: str, options: dict, chunk: MicroBatch, logps: torch.Tensor, sampler: torch.Tensor,
               sums: CorrectionSums) -> torch.Tensor:
    """The correction's weights [n, C] (detached, in `logps`' dtype) for one micro-batch, its metrics added to
    `sums`; the sequences `_reject_sequences` rejected (chunk.rejected) weigh 0."""
    mask = (chunk.completion_mask if chunk.loss_mask is None else chunk.loss_mask).to(logps.device)
    weights, rejected, capped = apply_correction(name, options, logps, sampler, mask, chunk.advantages)
    if chunk.rejected is not None:
        rejected = chunk.rejected.to(rejected.device)
        weights = torch.where(rejected.unsqueeze(1) & mask.bool(), torch.zeros_like(weights), weights)
    sums.add(logps, sampler, mask, weights, rejected, capped)
    return weights.to(logps.dtype)


def _reject_sequences(learner: Learner, plan: list[list[MicroBatch]],
                      attempts: list[Attempt]) -> tuple[list[list[MicroBatch]], int]:
    """The plan with each micro-batch's `rejected` sequences marked (a correction that rejects: pi_theta scored
    once, without gradient, before the step, so the normalizer leaves them out), and the number of valid groups,
    over all processes, whose sequences were all rejected (they count in AGE's M). Collective."""
    accelerator = learner.accelerator
    name, options = learner.off_policy
    calls = accelerator.gather(torch.tensor([[len(chunks) for chunks in plan]], device=accelerator.device))
    scored = _score_plan(learner, learner.model, plan, attempts, calls.max(dim=0).values.tolist())
    marked, groups = [], {}  # (prompts, prompt index) -> [rejected, sequences]
    for chunks, logps in zip(plan, scored, strict=True):
        marked.append([])
        for chunk, current in zip(chunks, logps, strict=True):
            rejected = None
            if chunk.sampler_logps is not None:
                mask = chunk.completion_mask if chunk.loss_mask is None else chunk.loss_mask
                _, rejected, _ = apply_correction(name, options, current, chunk.sampler_logps.to(current.device),
                                                  mask.to(current.device), chunk.advantages)
                rejected = rejected.cpu()
                for row, prompt in enumerate(chunk.prompt_index):
                    count = groups.setdefault((id(chunk.prompts), prompt), [0, 0])
                    count[0], count[1] = count[0] + int(rejected[row]), count[1] + 1
            marked[-1].append(chunk._replace(rejected=rejected))
    all_rejected = sum(1 for rejected, total in groups.values() if rejected == total)
    total = accelerator.reduce(torch.tensor(all_rejected, device=accelerator.device), "sum")
    return marked, int(total)


def _optimizer_step(learner: Learner, attempts: list[Attempt],
                    step: StepInputs) -> tuple[dict[str, float], dict[str, float]]:
    """One optimizer step on `step.chunks`, the loss their sum over the global `step.normalizer` (AGE: the
    valid groups' count; without AGE every sampled sequence's, alpha = 1).

    The normalizer is the count over ALL processes (sequences, or tokens for `token_mean`), and each
    process's loss is multiplied by the number of processes because gradients are then averaged over
    processes: the update's gradient is the mean over every valid sequence of every process.
    Under DDP the fast paths of `token_logps` run the bare model, outside DDP's hooks, so every
    micro-batch runs under no_sync and the gradients are averaged once, explicitly, at the end. Under
    FSDP and DeepSpeed every process runs the same number of forward/backward calls, each through the
    vision tower (gpg_vl/distributed.py says why); a process short of micro-batches runs zero-weighted
    placeholders. A NaN or infinite loss or gradient (on any process) skips the step: no weight changes.
    `step.sequences`: the step's valid sequences over all processes (the MoE router loss is averaged over them).
    `learner.path` is the run's scoring path (`choose_scoring_path`, chosen once in `setup`): the forward and the
    micro-batch cost both follow it, so a micro-batch never holds more tokens than trainer.micro_batch_tokens.
    `learner.correction.sampler_check` (an engine that returns its own log-probs: vLLM; the same on every
    process) adds the on-policy check, `logp_mismatch_mean` / `_max` over all processes' tokens; with its
    `tis_cap` > 0 each token's loss is multiplied by its truncated importance weight min(p / q, tis_cap)
    (gpg_vl/rollout/correction.py).
    Returns (metrics, this process's token-weighted sums of the loss's own metrics).
    """
    model, accelerator, optimizer = learner.model, learner.accelerator, learner.optimizer
    device = accelerator.device
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    sums = _backward_micro_batches(learner, attempts, step, ddp)
    if ddp:
        _average_gradients(model, accelerator)  # collective: every process calls it once per update
    # Collective under FSDP (the norm of sharded gradients); the gradients are already reduced, so the
    # norm, and the decision below, are the same on every process. Under DeepSpeed the engine clipped
    # (its own gradient_clipping) and stepped in the last backward, and this only reads the norm back.
    norm = accelerator.clip_grad_norm_(model.parameters(), learner.settings.max_grad_norm)
    grad_norm = 0.0 if norm is None else float(norm)
    # Collective, before any branch: every process reaches it exactly once per update.
    totals = accelerator.reduce(torch.tensor([sums.loss, sums.logp, sums.tokens, sums.entropy, sums.jsd],
                                             device=device, dtype=torch.float64), "sum")
    if not (math.isfinite(grad_norm) and math.isfinite(float(totals[0]))):  # global: every process agrees
        optimizer.zero_grad(set_to_none=True)
        return {"loss": float(totals[0]), "grad_norm": grad_norm, "skipped": 1.0, "nonfinite": 1.0}, sums.report
    optimizer.step()
    learner.scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    result = {"loss": float(totals[0]), "grad_norm": grad_norm, "skipped": 0.0,
              "logp_mean": float(totals[1] / max(float(totals[2]), 1.0)),
              "entropy_mean": float(totals[3] / max(float(totals[2]), 1.0))}
    if learner.teacher is not None and learner.teacher.settings.loss == "jsd":
        result["teacher_jsd"] = float(totals[4])
    if learner.reports_correction:  # collective, on every process alike (the settings are the same everywhere)
        rows = accelerator.gather(torch.tensor([sums.correction.as_list()], device=device, dtype=torch.float64))
        result.update(correction_metrics(rows.cpu()))
    if learner.correction.sampler_check:  # collective, on every process alike (the engine is the same everywhere)
        gaps = accelerator.gather(torch.tensor([[sums.gap, sums.gap_max, sums.gap_count]], device=device,
                                               dtype=torch.float64))  # [processes, 3]
        result["logp_mismatch_mean"] = float(gaps[:, 0].sum() / max(float(gaps[:, 2].sum()), 1.0))
        result["logp_mismatch_max"] = float(gaps[:, 1].max())
    return result, sums.report


def _backward_micro_batches(learner: Learner, attempts: list[Attempt], step: StepInputs, ddp: bool) -> _Sums:
    """The forward and backward of every micro-batch of one optimizer step (placeholders included outside
    DDP, up to `step.steps_needed`); gradients accumulate, synced on the last (see `_optimizer_step`)."""
    policy, model, accelerator = learner.policy, learner.model, learner.accelerator
    device = accelerator.device
    correct = learner.reports_correction
    name, options = learner.off_policy
    chunks, old, ref = step.chunks, step.old, step.ref
    real = len(chunks)
    if step.steps_needed > real and not ddp:  # DDP needs no matching calls: its reduction is the explicit one
        chunks = chunks + [MicroBatch(*placeholder_chunk(policy, attempts, device))] * (step.steps_needed - real)
    sums = _Sums()
    try:
        for index, chunk in enumerate(chunks):
            # The same index on every process outside DDP (len(chunks) == steps_needed there); DeepSpeed
            # takes its optimizer step inside the backward that has sync_gradients set.
            sync = index == len(chunks) - 1 and not ddp
            accelerator.sync_gradients = sync
            with contextlib.nullcontext() if sync else accelerator.no_sync(model):
                mask, adv, sampler = chunk.counted.to(device), chunk.advantages, chunk.sampler_logps
                # Collective under FSDP / ZeRO-3 (weights gathered per module): every process runs this
                # forward steps_needed times, each with images (require_images), so the calls match.
                logps, entropy, distill = scored_chunk(learner, chunk, device)  # [n, C], [n, C] (no grad), [] or None
                if index < real:
                    sums.entropy += float(torch.where(mask, entropy, torch.zeros_like(entropy)).sum())
                if learner.settings.top_entropy_quantile < 1.0:  # only the top-rho entropy tokens give gradient
                    keep = high_entropy_mask(entropy, mask, learner.settings.top_entropy_quantile)  # [n, C]
                    logps = torch.where(keep, logps, logps.detach())
                if sampler is not None and index < real:  # the engine's own log-probs (vLLM)
                    sampler = sampler.to(device)
                    total, worst, count = logp_mismatch(logps, sampler, mask)
                    sums.gap, sums.gap_max, sums.gap_count = sums.gap + total, max(sums.gap_max, worst), \
                        sums.gap_count + count
                    if correct:  # -sg(w) * A * log pi: w from pi_theta / pi_behaviour (rollout/corrections.py)
                        logps = logps * _corrected(name, options, chunk, logps, sampler, sums.correction)  # [n, C]
                router_loss = router.router_aux_loss(model)  # MoE load balancing (None unless turned on)
                if index >= real:  # placeholder: every parameter takes part, with a zero gradient
                    loss = torch.where(mask, logps, torch.zeros_like(logps)).sum() * 0.0
                else:
                    loss, info = checked_loss(learner.settings.loss, step.loss_fn, logps, mask, adv.to(device),
                                              old_logps=old[index] if old is not None else None,
                                              ref_logps=ref[index] if ref is not None else None,
                                              aggregation=step.aggregation, normalizer=step.normalizer,
                                              **step.options)
                    if router_loss is not None:  # averaged over the micro-batches, weighted by their sequences
                        loss = loss + router_loss * (len(adv) / step.sequences)
                    if distill is not None:  # teacher.loss=jsd: coef x the JSD, aggregated as the policy loss
                        jsd = AGGREGATIONS[step.aggregation](distill, mask, step.normalizer, learner.max_new_tokens)
                        loss = loss + learner.teacher.settings.coef * jsd
                        sums.jsd += float(jsd.detach())
                    sums.loss += float(loss.detach())
                    sums.logp += info["logp_mean"] * info["num_tokens"]
                    sums.tokens += int(info["num_tokens"])
                    _add_report(sums.report, info, later=step.later and old is not None)
                # Collective on the last micro-batch (ZeRO all-reduce) or on each (FSDP reduce-scatter):
                # a backward after a forward, the same count on every process. Local under DDP (no_sync).
                accelerator.backward(loss * accelerator.num_processes)
    finally:
        accelerator.sync_gradients = True
    return sums


LOSS_METRICS = ("num_tokens", "logp_mean")  # what the trainer reads from every loss's metrics
LOSS_CONTRACT = ("it must return (loss, metrics): a 0-d tensor with grad, and a dict of numbers holding at least "
                 f"{', '.join(LOSS_METRICS)} (and with ratio_mean also {', '.join(LOSS_REPORTS[:3])}, ratio_max, "
                 "logp_drift)")


def checked_loss(name: str, loss_fn, *args, **kwargs) -> tuple[torch.Tensor, dict]:
    """trainer.loss=`name` called on one micro-batch, its contract checked here (`LOSS_CONTRACT`): a raise, or
    anything else returned, fails in one sentence naming the setting and what came back."""
    try:
        result = loss_fn(*args, **kwargs)
    except (UserError, torch.OutOfMemoryError):
        raise
    except Exception as error:  # a plugin's own failure, told in one sentence
        raise UserError(f"trainer.loss={name} raised {type(error).__name__}: {error}; {LOSS_CONTRACT}.") from error
    if not (isinstance(result, tuple | list) and len(result) == 2):
        what = "a bare tensor" if isinstance(result, torch.Tensor) else f"a {type(result).__name__}"
        raise UserError(f"trainer.loss={name} returned {what}; {LOSS_CONTRACT}.")
    loss, metrics = result
    problem = None
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        problem = f"a loss of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else \
            f"a loss of type {type(loss).__name__}"
    elif not loss.requires_grad:
        problem = "a loss without grad (detached, or computed under no_grad)"
    elif not isinstance(metrics, dict):
        problem = f"metrics of type {type(metrics).__name__}"
    else:
        required = LOSS_METRICS + ((*LOSS_REPORTS, "ratio_max", "logp_drift") if "ratio_mean" in metrics else ())
        missing = [key for key in required if key not in metrics]
        wrong = [key for key in required if key in metrics and not _is_number(metrics[key])]
        if missing:
            problem = f"metrics without {', '.join(missing)}"
        elif wrong:
            problem = f"metrics whose {', '.join(wrong)} is not a number"
    if problem:
        raise UserError(f"trainer.loss={name} returned {problem}; {LOSS_CONTRACT}.")
    return loss, metrics


def _is_number(value) -> bool:
    try:
        float(value)
    except (TypeError, ValueError, RuntimeError):
        return False
    return not isinstance(value, str | bytes)


def _add_report(report: dict[str, float], info: dict[str, float], *, later: bool) -> None:
    """Add one micro-batch's loss metrics (token-weighted) to this step's sums."""
    if "ratio_mean" not in info:
        return
    tokens = info["num_tokens"]
    report["tokens"] = report.get("tokens", 0.0) + tokens
    for key in LOSS_REPORTS:
        report[key] = report.get(key, 0.0) + info[key] * tokens
    report["ratio_max"] = max(report.get("ratio_max", 0.0), info["ratio_max"])
    if later:
        report["later_tokens"] = report.get("later_tokens", 0.0) + tokens
        report["logp_drift"] = report.get("logp_drift", 0.0) + info["logp_drift"] * tokens


def _average_gradients(model, accelerator: Accelerator, bucket_elements: int = 1 << 25) -> None:
    """Average gradients over DDP processes explicitly, as DDP's hooks would: `token_logps` runs the bare
    model (outside those hooks), and a process without valid sequences runs no forward at all. Gradients
    are flattened into buckets of one dtype (at most `bucket_elements` each): one all-reduce per bucket."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    buckets: dict[torch.dtype, list[list[torch.Tensor]]] = {}
    filled: dict[torch.dtype, int] = {}  # elements in each dtype's last bucket
    for parameter in model.parameters():
        if parameter.requires_grad:
            if parameter.grad is None:  # same parameters, same order on every process: the buckets match
                parameter.grad = torch.zeros_like(parameter)
            dtype, size = parameter.grad.dtype, parameter.grad.numel()
            lists = buckets.setdefault(dtype, [[]])
            if lists[-1] and filled[dtype] + size > bucket_elements:
                lists.append([])
                filled[dtype] = 0
            lists[-1].append(parameter.grad)
            filled[dtype] = filled.get(dtype, 0) + size
    for bucket in (bucket for lists in buckets.values() for bucket in lists):
        flat = _flatten_dense_tensors(bucket)
        torch.distributed.all_reduce(flat)
        flat.div_(accelerator.num_processes)
        for grad, averaged in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
            grad.copy_(averaged)


FUSED_ADAMW_DEVICES = ("cpu", "cuda")  # devices torch has the fused AdamW kernel for


def build_optimizer(model: torch.nn.Module, trainer: TrainerSettings) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters: fused (one kernel per parameter group instead of a dozen
    elementwise passes, as transformers' Trainer defaults to) where torch has the fused kernel for the
    parameters' device, else the multi-tensor one."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = bool(params) and all(p.device.type in FUSED_ADAMW_DEVICES and p.is_floating_point() for p in params)
    return torch.optim.AdamW(params, lr=trainer.lr, weight_decay=trainer.weight_decay, fused=fused or None)


def needs_reference(trainer: TrainerSettings) -> bool:
    """Whether trainer.loss scores a frozen reference model (it declares "ref" and its kl_coef > 0:
    trainer.loss_options.kl_coef, else trainer.kl_coef)."""
    if "ref" not in loss_needs(get_policy_loss(trainer.loss)):
        return False
    return float(trainer_loss_options(trainer, None).get("kl_coef", trainer.kl_coef) or 0.0) > 0


def build_reference(model: torch.nn.Module, trainer: TrainerSettings, reference: torch.nn.Module | None, *,
                    resuming: bool) -> Reference | None:
    """The frozen reference of `setup` (None when the loss needs none)."""
    if not needs_reference(trainer):
        return None
    if hasattr(model, "disable_adapter"):  # a PEFT model: the base weights are the initial ones
        return Reference(None)
    if reference is None:
        if resuming:
            raise UserError(f"trainer.loss={trainer.loss} with trainer.kl_coef={trainer.kl_coef} scores a reference "
                            "model, the initial weights, which a checkpoint does not hold: pass reference= (the "
                            "command line rebuilds it from model.name_or_path).")
        if any(hasattr(p, "ds_id") for p in model.parameters()):  # a copy's shards belong to no engine
            raise UserError(f"trainer.loss={trainer.loss} with trainer.kl_coef={trainer.kl_coef} scores a reference "
                            "model, and a model loaded partitioned by DeepSpeed ZeRO-3 cannot be copied into one: "
                            "pass reference= (a second load of the initial weights, as the command line does).")
        reference = copy.deepcopy(model)
    reference.requires_grad_(False)
    reference.eval()
    return Reference(reference)


def place_reference(frozen: Reference | None, accelerator: Accelerator) -> Reference | None:
    """Place a frozen reference copy like the policy: on each process's device (one copy each, as the
    policy's weights under DDP), sharded across the processes under FSDP2 the way accelerate shards the
    policy (its forwards are then collective: `_score_plan` keeps them in step). With LoRA (no copy) the
    reference is the policy itself."""
    if frozen is None or frozen.model is None:
        return frozen
    if getattr(accelerator, "is_fsdp2", False):
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        return Reference(fsdp2_prepare_model(accelerator, frozen.model.to(accelerator.device)))
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None and plugin.zero_stage == 3:  # loaded partitioned (zero.Init): only an engine gathers it
        import deepspeed  # no optimizer; its forwards are collective like the policy's (as TRL's prepare_deepspeed)

        config = {k: v for k, v in plugin.deepspeed_config.items() if k not in ("optimizer", "scheduler")}
        engine = deepspeed.initialize(model=frozen.model, config=config)[0]
        engine.eval()  # DeepSpeedEngine.eval() returns None
        return Reference(engine)
    frozen.model.to(accelerator.device)
    return frozen

