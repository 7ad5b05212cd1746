"""The update: a rollout's valid groups in micro-batches (by count or by tokens of forward work), in
mini-batches for the GRPO family's several optimizer steps, each optimizer step with its loss normalized over
all processes, gradients averaged explicitly under DDP; the optimizer. The micro-batches are cut in
micro_batch.py, the loss called and checked in loss_call.py, the frozen reference built in reference.py; the
policy's log-probs before the update (the ratio's, the teacher's, the correction's) computed once in before.py.

Every count that drives a decision (the loss normalizer, the number of forwards under FSDP / ZeRO-3) is
all-reduced, so every process takes the same branches and reaches the same collectives.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, replace

import torch
from accelerate import Accelerator

from gpg_vl.config.schema import TrainerSettings
from gpg_vl.distributed import require_images
from gpg_vl.models import router
from gpg_vl.models.batch import unwrap
from gpg_vl.models.load import Policy
from gpg_vl.models.scoring import ScoringPath
from gpg_vl.objective import AGGREGATIONS, LOSS_NORMALIZERS, TOKEN_NORMALIZED
from gpg_vl.objective.corrections import (
    ActiveCorrection,
    CorrectionSums,
    correction_metrics,
    logp_mismatch,
    resolve_correction,
)
from gpg_vl.objective.token_masks import covariance_cut, high_entropy_mask
from gpg_vl.rollout.engine import Correction
from gpg_vl.train.step.before import (
    FirstForward,
    before_update,
    chunk_weights,
    correct_up_front,
    score_plan,
)
from gpg_vl.train.step.loss_call import LossCall, _add_report, _loss_reports, checked_loss, resolve_loss
from gpg_vl.train.step.micro_batch import MicroBatch, mini_batches, update_chunks
from gpg_vl.train.step.placeholder import placeholder_chunk
from gpg_vl.train.step.reference import Reference
from gpg_vl.train.step.sample import Attempt
from gpg_vl.train.teacher.signal import Shaping, distilled_scores, taught, taught_metrics, teacher_shaping


@dataclass
class Learner:
    """What the update trains and how: the policy and its prepared (possibly wrapped) `model` with their
    optimizer and schedule on `accelerator`; the trainer's `settings`; the rollout's sampling `temperature`;
    the run's scoring `path` (chosen once at setup: `scoring.choose_scoring_path`); the frozen `reference` of a
    KL loss; the completion limit `max_new_tokens` (a loss's max_tokens); the engine's `correction` (its on-policy
    check); under FSDP2 with trainer.max_staleness >= 1, `whole_copy`, a copy of the model taken before it was
    sharded, for the sampler (gpg_vl/train/step/pipeline.py)."""

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
    teacher: object = None  # each task's teacher (gpg_vl/train/teacher/build.py's Teachers), or None
    # pi_prox's log-probs of the first step's micro-batches from its own forward (False: from one forward without
    # gradient before it, as before round 6: scripts/bench.py's --forwards baseline)
    share_first_forward: bool = True

    def off_policy(self, stale: bool) -> ActiveCorrection:
        """The correction this update applies (trainer.correction; rollout.vllm.tis_cap > 0, the engine's, is
        token_tis with that cap), worked out once per update; `stale`: the pipeline samples ahead of the learner."""
        return resolve_correction(self.settings.correction, self.settings.correction_options,
                                  engine_cap=self.correction.tis_cap, stale=stale)


@dataclass
class StepInputs:
    """One optimizer step's share of the update: its micro-batches and what the loss of each takes."""

    chunks: list[MicroBatch]
    loss: LossCall  # trainer.loss, resolved once per step
    old: list[torch.Tensor] | None  # the rollout policy's log-probs, one [n, C] per micro-batch
    ref: list[torch.Tensor] | None  # the reference's
    normalizer: float  # the loss's global denominator
    steps_needed: int  # the most micro-batches any process has for this step
    later: bool  # not the rollout's first optimizer step
    sequences: int  # the step's valid sequences over all processes
    correction: ActiveCorrection = field(default_factory=ActiveCorrection)  # resolved once per update
    correction_sums: CorrectionSums | None = None  # the update's: filled here at its first step, where not up front
    first: FirstForward | None = None  # the first step: its forward gives its micro-batches' pi_prox (before.py)


def update(learner: Learner, attempts: list[Attempt], *, stale: bool = False,
           loss: LossCall | None = None) -> dict[str, float]:
    """The optimizer steps of one rollout: `settings.ppo_epochs` passes over its valid groups, each pass in
    mini-batches of `settings.ppo_mini_batch` sequences (0: the whole rollout, one step per pass).

    GPG (the default) takes one step, on the valid groups only, and needs nothing but the current log-probs.
    A loss whose KL to the reference is on (`LossCall.kl_everywhere`) forwards every sampled group instead, the
    invalid ones with zero advantages (only their KL acts), normalized over all sampled sequences as TRL's and
    R1-V's GRPO do, and steps even when no group is valid; its metrics then say `groups_used` (every group
    forwarded), `groups_kl_only` (those forwarded for their KL alone) and `alpha` 1. A loss that declares
    "old" gets the rollout policy's log-probs when there is more than one step (with one, old = current detached:
    ratio 1): pi_prox's, each micro-batch's computed once (train/step/before.py: the first step's micro-batches take
    them from its own forward, the later mini-batches' come from one forward without gradient before it); one that
    declares "ref" (with settings.kl_coef > 0) gets the frozen reference's, through the same scoring path.
    `learner.correction`: the on-policy check of an engine that samples with its own weights (see
    `_optimizer_step`). The off-policy correction (`Learner.off_policy`; `stale`: the rollouts may be older than the
    learner, trainer.max_staleness >= 1) is resolved once: its weights come from pi_prox, the policy before this
    update, against the behaviour log-probs, and go to the loss as `weights` (before.py's `correct_up_front`).
    `learner.teacher`: every group of a task with a teacher forwarded, valid unless its combined advantage is all 0
    (a teacher that reads log-probs reads pi_prox's, the same ones as the ratio's).
    `loss`: trainer.loss resolved for this step (`resolve_loss`; resolved here when not given).
    """
    settings, accelerator = learner.settings, learner.accelerator
    loss = loss or resolve_loss(settings, learner.max_new_tokens)
    if loss.kl_everywhere or learner.teacher is not None:  # the KL (TRL's, R1-V's GRPO) or a task's teacher acts on
        attempts, kl_only = _every_group(attempts, accelerator, loss.kl_everywhere or learner.teacher)  # every one
    plan = _plan(learner, attempts)
    correction, steps, sums = learner.off_policy(stale), settings.ppo_epochs * len(plan), CorrectionSums()
    plan, groups_rejected, prox = correct_up_front(learner, correction, loss.fn, plan, attempts, sums, steps=steps)
    shaping = teacher_shaping(learner, plan, attempts) if learner.teacher is not None else None
    plan, old, first = before_update(learner, plan, attempts, loss, shaping, steps=steps, prox=prox)
    counts = _Counts.of(plan, attempts, accelerator, loss.aggregation)
    require_images(counts.without_images == 0, accelerator.num_processes, "a training micro-batch")
    if counts.sequences() == 0:
        return {"loss": 0.0, "grad_norm": 0.0, "skipped": 1.0, **_taught(shaping, plan, attempts, learner)}
    ref = _reference_logps(learner, plan, attempts, counts.calls, loss)
    results, reports = [], []
    for _epoch in range(settings.ppo_epochs):
        for part, chunks in enumerate(plan):
            inputs = StepInputs(chunks, loss, old=old[part] if old is not None else None,
                                ref=ref[part] if ref is not None else None,
                                normalizer=counts.normalizer(part, settings),
                                steps_needed=counts.steps_needed(part), later=bool(results),
                                sequences=counts.sequences(part), correction=correction,
                                correction_sums=sums if prox is None and not results else None,
                                first=first if not results else None)
            result, report = _optimizer_step(learner, attempts, inputs)
            if inputs.first is not None:  # the later steps train on its micro-batches as it resolved them
                plan, counts, sums, result, report = _after_first_step(learner, attempts, inputs, plan, old, counts,
                                                                       result, report)
                if result is None:  # the first step's teacher left every sequence out: no step
                    return {"loss": 0.0, "grad_norm": 0.0, "skipped": 1.0,
                            **_taught(shaping, plan, attempts, learner)}
            results.append(result)
            reports.append(report)
            if result.get("nonfinite"):  # no weight changed in that step; the rollout's later steps are dropped
                break
        if results[-1].get("nonfinite"):
            break
    metrics = {**_combine_results(results), **_taught(shaping, plan, attempts, learner)}
    if correction.reports:  # collective, on every process alike (the settings are the same everywhere)
        rows = accelerator.gather(torch.tensor([sums.as_list()], device=accelerator.device, dtype=torch.float64))
        metrics.update(correction_metrics(rows.cpu()))
    if groups_rejected is not None:
        metrics["groups_rejected"] = groups_rejected
    if loss.kl_everywhere:  # every sampled group forwarded, normalized over all of them (alpha 1)
        metrics.update({"groups_used": counts.sequences() // settings.group_size,
                        "groups_kl_only": kl_only, "alpha": 1.0})
    if loss.needs:  # the same on every process (it depends on the loss only): the collective below matches
        metrics.update(_loss_reports(reports, accelerator))
    return metrics


def _reference_logps(learner: Learner, plan: list[list[MicroBatch]], attempts: list[Attempt], calls: list[int],
                     loss: LossCall) -> list[list[torch.Tensor]] | None:
    """The frozen reference's log-probs per mini-batch and micro-batch (a loss that declares "ref", with kl_coef >
    0), through the same scoring path; else None."""
    if not ("ref" in loss.needs and loss.kl_everywhere):
        return None
    if learner.reference is None:
        raise ValueError(f"trainer.loss={loss.name} with kl_coef > 0 needs a reference model")
    ref_model, scope = learner.reference.scoring(learner.model)
    with scope:
        return score_plan(learner, ref_model, plan, attempts, calls)


@dataclass
class _Counts:
    """The update's counts over all processes (`_plan_counts`): per mini-batch its sequences, tokens (what the loss
    counts), micro-batches and micro-batches without images, per process; then every sampled sequence and token."""

    per_part: torch.Tensor  # [processes, parts, 4]
    sampled: torch.Tensor  # [processes, 2]
    column: int  # 1: the normalizer counts tokens (a token-normalized aggregation), 0: sequences

    @classmethod
    def of(cls, plan: list[list[MicroBatch]], attempts: list[Attempt], accelerator: Accelerator,
           aggregation: str) -> _Counts:
        counts = _plan_counts(plan, attempts, accelerator)  # [processes, 4 * parts + 2]; collective
        parts = len(plan)
        return cls(counts[:, :4 * parts].reshape(counts.shape[0], parts, 4), counts[:, -2:],
                   1 if aggregation in TOKEN_NORMALIZED else 0)

    @property
    def without_images(self) -> int:
        return int(self.per_part[..., 3].sum())

    @property
    def calls(self) -> list[int]:
        """Per mini-batch, the most micro-batches any process has (the forwards of a collective model)."""
        return [int(self.per_part[:, part, 2].max()) for part in range(self.per_part.shape[1])]

    def steps_needed(self, part: int) -> int:
        return int(self.per_part[:, part, 2].max())

    def sequences(self, part: int | None = None) -> int:
        """The sequences the loss counts, of mini-batch `part` or of all, over all processes."""
        return int((self.per_part if part is None else self.per_part[:, part])[..., 0].sum())

    def normalizer(self, part: int, settings: TrainerSettings) -> float:
        """Mini-batch `part`'s loss normalizer: AGE's count of what its valid groups hold, or without AGE every
        sampled sequence's (or token's), pro rata over the mini-batches."""
        valid = int(self.per_part[:, part, self.column].sum())
        counted, sampled = int(self.per_part[..., self.column].sum()), int(self.sampled[:, self.column].sum())
        share = sampled if self.per_part.shape[1] == 1 else sampled * valid / counted  # AGE off: pro rata
        return LOSS_NORMALIZERS[settings.age](valid, share)


def _plan(learner: Learner, attempts: list[Attempt]) -> list[list[MicroBatch]]:
    """The update's micro-batches, in mini-batches of settings.ppo_mini_batch sequences (one: the whole rollout).
    Collective with a mini-batch size: every process takes the same number of optimizer steps."""
    settings, accelerator = learner.settings, learner.accelerator
    parts = 1
    if settings.ppo_mini_batch:
        valid = accelerator.reduce(torch.tensor(sum(int(a.valid.sum()) for a in attempts),
                                                device=accelerator.device), "sum")
        parts = max(1, math.ceil(int(valid) * settings.group_size / settings.ppo_mini_batch))
    return [list(update_chunks(part, settings.micro_batch_size, settings.micro_batch_tokens,
                               share_prompt=learner.path.prompt_once, packed=learner.path.packed,
                               min_padding=learner.path.min_padding))
            for part in mini_batches(attempts, parts)]


def _after_first_step(learner: Learner, attempts: list[Attempt], inputs: StepInputs, plan: list[list[MicroBatch]],
                      old: list | None, counts: _Counts, result: dict | None, report: dict):
    """After the first optimizer step: its micro-batches as it resolved them (a teacher's advantages) go into the
    plan, and its forward's pi_prox log-probs into the old ones. Where its teacher left groups out (`result` None:
    no weight changed), the counts are taken again and the step runs again with the right normalizer; None as the
    result when no sequence is left. Returns (plan, counts, correction sums, result, report)."""
    first, sums = inputs.first, inputs.correction_sums
    plan = [first.marked if result is None else first.resolved(plan[0]), *plan[1:]]
    if old is not None:
        old[0] = [first.logps.get(index, logps) for index, logps in enumerate(old[0])]
    if result is not None:
        return plan, counts, sums, result, report
    counts, sums = _Counts.of(plan, attempts, learner.accelerator, inputs.loss.aggregation), \
        None if sums is None else CorrectionSums()
    if counts.sequences() == 0:
        return plan, counts, sums, None, {}
    again = replace(inputs, chunks=plan[0], old=old[0] if old is not None else None, first=None,
                    normalizer=counts.normalizer(0, learner.settings), sequences=counts.sequences(0),
                    correction_sums=sums)
    result, report = _optimizer_step(learner, attempts, again)
    return plan, counts, sums, result, report


def _taught(shaping: Shaping | None, plan: list[list[MicroBatch]], attempts: list[Attempt],
            learner: Learner) -> dict[str, float]:
    """The teacher's metrics of the update (collective), nothing without a teacher."""
    if learner.teacher is None:
        return {}
    return taught_metrics(taught(shaping, plan, attempts, learner.accelerator), learner.settings)


def _every_group(attempts: list[Attempt], accelerator: Accelerator, widen) -> tuple[list[Attempt], int]:
    """The attempts with every group marked for the update, the invalid ones with zero advantages, and the number
    of those (over all processes): every attempt (`widen` True: a KL acts on every sequence), or those of a task with
    a teacher (`widen` the Teachers). Collective: update() calls it on every process or on none."""
    widened, invalid = [], 0
    for attempt in attempts:
        if attempt.rollout is None or (widen is not True and widen.of(attempt.task) is None):  # no prompts here, or
            # a task without a teacher
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


def _combine_results(results: list[dict]) -> dict[str, float]:
    """The update's metrics from its optimizer steps' (means of loss and gradient norm over several)."""
    metrics = dict(results[0]) if len(results) == 1 else {
        "loss": sum(r["loss"] for r in results) / len(results),
        "grad_norm": sum(r["grad_norm"] for r in results) / len(results),
        "skipped": float(all(r["skipped"] for r in results)),
        **({"nonfinite": 1.0} if results[-1].get("nonfinite") else {}),
        **{k: results[0][k] for k in ("logp_mean", "entropy_mean", "teacher_jsd", "clip_cov_fraction")
           if k in results[0]},
        **{k: results[0][k] for k in ("logp_mismatch_mean", "logp_mismatch_max")
           if k in results[0]}}
    metrics["optimizer_steps"] = float(sum(not r["skipped"] for r in results))
    return metrics


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
    jsd: float = 0.0  # a teacher loss that reads logits (jsd): its term of the loss, summed over micro-batches
    clip_cov: int = 0  # trainer.clip_cov_ratio: the tokens Clip-Cov took the gradient from
    report: dict = field(default_factory=dict)


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
    process) adds the on-policy check, `logp_mismatch_mean` / `_max` over all processes' tokens. The loss gets the
    off-policy correction's weights (`step.correction`; with the engine's `tis_cap` > 0, token_tis) as `weights`:
    each micro-batch's resolved before the update, or here at its first step from the forward's own log-probs
    (pi_prox then: nothing has stepped yet). `step.first`: the update's first step, whose forward gives its
    micro-batches' pi_prox log-probs (before.py); where its teacher then leaves groups out, the gradient is dropped
    before any collective of the step and (None, {}) returned: the caller runs the step again.
    Returns (metrics, this process's token-weighted sums of the loss's own metrics).
    """
    model, accelerator, optimizer = learner.model, learner.accelerator, learner.optimizer
    device = accelerator.device
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    sums = _backward_micro_batches(learner, attempts, step, ddp)
    if step.first is not None and step.first.redo(accelerator, step.chunks):  # collective with a teacher
        optimizer.zero_grad(set_to_none=True)
        return None, {}
    if ddp:
        _average_gradients(model, accelerator)  # collective: every process calls it once per update
    # Collective under FSDP (the norm of sharded gradients); the gradients are already reduced, so the
    # norm, and the decision below, are the same on every process. Under DeepSpeed the engine clipped
    # (its own gradient_clipping) and stepped in the last backward, and this only reads the norm back.
    norm = accelerator.clip_grad_norm_(model.parameters(), learner.settings.max_grad_norm)
    grad_norm = 0.0 if norm is None else float(norm)
    # Collective, before any branch: every process reaches it exactly once per update.
    totals = accelerator.reduce(torch.tensor([sums.loss, sums.logp, sums.tokens, sums.entropy, sums.jsd,
                                              sums.clip_cov], device=device, dtype=torch.float64), "sum")
    if not (math.isfinite(grad_norm) and math.isfinite(float(totals[0]))):  # global: every process agrees
        optimizer.zero_grad(set_to_none=True)
        return {"loss": float(totals[0]), "grad_norm": grad_norm, "skipped": 1.0, "nonfinite": 1.0}, sums.report
    optimizer.step()
    learner.scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    result = {"loss": float(totals[0]), "grad_norm": grad_norm, "skipped": 0.0,
              "logp_mean": float(totals[1] / max(float(totals[2]), 1.0)),
              "entropy_mean": float(totals[3] / max(float(totals[2]), 1.0))}
    if learner.teacher is not None and learner.teacher.any_needs("logits"):
        result["teacher_jsd"] = float(totals[4])
    if learner.settings.clip_cov_ratio > 0:
        result["clip_cov_fraction"] = float(totals[5] / max(float(totals[2]), 1.0))
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
    device, bare = accelerator.device, unwrap(model)
    correction, corrections = step.correction, step.correction_sums
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
                # Collective under FSDP / ZeRO-3 (weights gathered per module): every process runs this
                # forward steps_needed times, each with images (require_images), so the calls match.
                teacher = learner.teacher.of(chunk.task) if learner.teacher is not None else None
                logps, entropy, distill = _scored(learner, chunk, teacher, device)  # [n, C], [n, C], [n, C] / None
                if step.first is not None and index < real:  # pi_prox's log-probs: this forward's (a teacher's
                    chunk = step.first.take(index, chunk, logps)  # advantages read them)
                mask, adv, sampler = chunk.counted.to(device), chunk.advantages, chunk.sampler_logps
                prox_old = step.first.old(index) if step.first is not None else None
                if index < real:
                    sums.entropy += float(torch.where(mask, entropy, torch.zeros_like(entropy)).double().sum())
                if learner.settings.top_entropy_quantile < 1.0:  # only the top-rho entropy tokens give gradient,
                    # the threshold over this micro-batch index of every process (TRL gathers them); collective
                    pool = entropy_pool(accelerator, entropy, mask if index < real else None)
                    keep = high_entropy_mask(entropy, mask, learner.settings.top_entropy_quantile, pool)  # [n, C]
                    logps = torch.where(keep, logps, logps.detach())
                if learner.settings.clip_cov_ratio > 0 and index < real:  # verl's Clip-Cov: a few tokens of
                    # high covariance between advantage and log-prob give no gradient
                    low, high = learner.settings.clip_cov_bounds
                    cut = covariance_cut(logps, adv.to(device), mask, ratio=learner.settings.clip_cov_ratio,
                                         low=low, high=high)  # [n, C]
                    logps = torch.where(cut, logps.detach(), logps)
                    sums.clip_cov += int(cut.sum())
                weights = None if chunk.weights is None else chunk.weights.to(device)  # resolved up front
                if sampler is not None and index < real:  # the engine's own log-probs (vLLM)
                    sampler = sampler.to(device)
                    total, worst, count = logp_mismatch(logps, sampler, mask)
                    sums.gap, sums.gap_max, sums.gap_count = sums.gap + total, max(sums.gap_max, worst), \
                        sums.gap_count + count
                    if corrections is not None and correction.reports:  # the first step: its forward is pi_prox
                        weights = chunk_weights(correction, chunk, logps.detach(), sampler, corrections)[0]
                router_loss = router.router_aux_loss(bare)  # MoE load balancing (None unless turned on)
                if index >= real:  # placeholder: every parameter takes part, with a zero gradient
                    loss = torch.where(mask, logps, torch.zeros_like(logps)).sum() * 0.0
                else:
                    loss, info = checked_loss(step.loss.name, step.loss.fn, logps, mask, adv.to(device),
                                              old_logps=prox_old if prox_old is not None else
                                              old[index] if old is not None else None,
                                              ref_logps=ref[index] if ref is not None else None,
                                              aggregation=step.loss.aggregation, normalizer=step.normalizer,
                                              **({"weights": weights} if correction.weighs else {}),
                                              **step.loss.options)
                    if router_loss is not None:  # averaged over the micro-batches, weighted by their sequences
                        loss = loss + router_loss * (len(adv) / step.sequences)
                    if distill is not None:  # a teacher loss that reads logits (jsd): coef x it, aggregated as
                        # the policy loss
                        jsd = AGGREGATIONS[step.loss.aggregation](distill, mask, step.normalizer,
                                                                  learner.max_new_tokens)
                        loss = loss + teacher.settings.coef * jsd
                        sums.jsd += float(jsd.detach())
                    sums.loss += float(loss.detach())
                    sums.logp += info["logp_mean"] * info["num_tokens"]
                    sums.tokens += int(info["num_tokens"])
                    _add_report(sums.report, info, later=step.later and old is not None)
                # Collective on the last micro-batch (ZeRO all-reduce) or on each (FSDP reduce-scatter):
                # a backward after a forward, the same count on every process. Local under DDP (no_sync).
                accelerator.backward(loss * accelerator.num_processes)
        if learner.settings.top_entropy_quantile < 1.0:  # DDP: the micro-batch indices other processes still have
            for _ in range(len(chunks), step.steps_needed):
                entropy_pool(accelerator, None, None)
    finally:
        accelerator.sync_gradients = True
    return sums


def _scored(learner: Learner, chunk: MicroBatch, teacher, device) -> tuple[torch.Tensor, torch.Tensor,
                                                                         torch.Tensor | None]:
    """A micro-batch in the update: (log-probs [n, C] with gradient, entropies [n, C] without, from the same
    logits: no extra forward; with a teacher whose loss reads logits, its per-token loss [n, C] on the counted
    tokens (train/teacher/signal.py), else None)."""
    if teacher is not None and learner.teacher.needs(chunk.task) == "logits":
        return distilled_scores(learner, teacher, chunk, device)
    logps, entropy = chunk.logps(learner.policy, learner.model, device, temperature=learner.temperature,
                                 path=learner.path, logits_chunk_tokens=learner.settings.logits_chunk_tokens,
                                 entropy=True)
    return logps, entropy, None


def entropy_pool(accelerator: Accelerator, entropy: torch.Tensor | None, mask: torch.Tensor | None):
    """Every process's counted entropies [sum of T] of one micro-batch index (this process's: entropy [n, C] on mask
    [n, C], or none), as TRL's get_high_entropy_mask pads and gathers them; None with one process. Collective."""
    if accelerator.num_processes == 1:
        return None
    local = entropy[mask].float() if mask is not None else torch.zeros(0, device=accelerator.device)  # [T]
    gathered = accelerator.gather(accelerator.pad_across_processes(local, dim=0, pad_index=-1.0))  # [P * max T]
    return gathered[gathered >= 0]  # the padding (an entropy is never negative) dropped


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
