"""The training loop, on accelerate. Read `train` top to bottom: setup -> (sample -> score -> advantage ->
loss -> optimizer steps -> log -> save) per step -> finish. GPG by default; the GRPO family by trainer.loss.

Nothing here assumes one process: prompts of a step are split across processes, every count that
drives a decision (valid groups, resampling, the loss normaliser) is all-reduced, and checkpoints are
written by the main process only.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import os
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, gather_object
from tqdm.auto import tqdm
from transformers import get_scheduler

from gpg_vl.config.schema import EvalSettings, RolloutSettings, TrainerSettings  # noqa: F401  (declared once there)
from gpg_vl.data.stream import PromptStream, Subset, scan_rows
from gpg_vl.distributed import forward_is_collective, require_images
from gpg_vl.errors import UserError
from gpg_vl.models.family import PromptBatch, ScoringPath, choose_scoring_path
from gpg_vl.models.load import Policy
from gpg_vl.objective import (
    LOSS_NORMALIZERS,
    TOKEN_NORMALISED,
    get_advantage,
    get_policy_loss,
    loss_aggregation,
    loss_alpha,
    loss_needs,
    overlong_penalty,
)
from gpg_vl.observe.report import write_curves
from gpg_vl.observe.rollout_log import log_rollouts
from gpg_vl.reward.pool import RewardBudget, score_completions
from gpg_vl.rollout.correction import logp_mismatch, truncated_is_weights
from gpg_vl.rollout.engine import EnginePrompts, Sampling, build_engine, encode_prompts
from gpg_vl.rollout.hf import HFEngine
from gpg_vl.rollout.types import Rollout, in_task_frame  # noqa: F401
from gpg_vl.train.checkpoint import (
    later_checkpoints,
    latest_checkpoint,
    load_trainer_state,
    remove_checkpoint,
    remove_partials,
    save_checkpoint,
    truncate_metrics,
    write_atomic,
    writing,
)
from gpg_vl.train.evaluate import evaluate
from gpg_vl.train.outdir import claim_output_dir
from gpg_vl.train.placeholder import placeholder_chunk, placeholder_prompts
from gpg_vl.train.sample import collect_valid_groups


@dataclass
class Attempt:
    """One rollout of this process's share of B prompts, scored."""

    rows: list[dict]
    prompts: PromptBatch | None
    rollout: Rollout | None
    rewards: torch.Tensor  # [b, G]
    components: dict[str, torch.Tensor]  # name -> [b, G]
    advantages: torch.Tensor  # [b, G]
    valid: torch.Tensor  # [b] bool
    reward_timeouts: int = 0  # completions not scored within the step's reward budget (scored 0)


# ---------------------------------------------------------------------------------------------
# sample + score + advantage
# ---------------------------------------------------------------------------------------------
def sample_attempt(policy: Policy, task, stream: PromptStream, *, batch_size: int, group_size: int,
                   rollout: RolloutSettings, warn, advantage: str = "group_mean", overlong_cache: int = 0,
                   overlong_penalty_at_limit: float = 1.0, reward_workers: int = 1,
                   reward_budget: RewardBudget | None = None, engine=None) -> Attempt:
    """Draw this process's share of `batch_size` prompts, roll out G completions each through `engine`
    (rollout.engine's; the HF engine when None), score them (on `reward_workers` threads, within what is left
    of the step's `reward_budget`).

    `advantage` names the estimator (trainer.advantage); with `overlong_cache` > 0 the reward gets DAPO's
    overlong component "overlong" (0 down to -overlong_penalty_at_limit over the last overlong_cache tokens)."""
    engine = engine or HFEngine(policy, rollout)
    drawn = stream.next_prompts(batch_size, task)  # good rows only: a bad one is skipped, counted and replaced
    rows = [p.row for p in drawn]
    prompts = encode_prompts(policy, [p.messages for p in drawn], ids=[str(p.row.get("id", p.index)) for p in drawn])
    lengths = prompts.batch.inputs["attention_mask"].sum(dim=1).tolist()
    keep = [i for i, n in enumerate(lengths) if n <= rollout.max_prompt_tokens]
    for i in sorted(set(range(len(rows))) - set(keep)):
        warn(f"skipped prompt {prompts.batch.ids[i]!r}: it has {lengths[i]} tokens, over rollout.max_prompt_tokens="
             f"{rollout.max_prompt_tokens}; prompts with images are never truncated, so raise the limit or "
             "lower model.max_pixels.")
    if len(keep) < len(rows):
        rows, prompts = [rows[i] for i in keep], prompts.select(keep) if keep else None
    names = list(task.reward_functions)
    if not rows:
        # Under FSDP / ZeRO-3 generation is collective (weights gathered per module, synced_gpus): a process
        # whose prompts were all skipped still makes this attempt's one generate call, on a placeholder whose
        # completions it drops (the same call evaluation makes for a process out of rows, which is tested).
        if forward_is_collective(policy.model):
            engine.generate(EnginePrompts(placeholder_prompts(policy)), group_size, Sampling.from_settings(rollout))
        empty = torch.zeros(0, group_size)
        names += ["overlong"] if overlong_cache else []
        return Attempt([], None, None, empty, {n: empty for n in names}, empty, torch.zeros(0, dtype=torch.bool))
    # Raised by this process alone, before its next collective: the launcher (torchrun) then stops the others.
    require_images(prompts.batch.has_images, stream.world_size, "a batch of training prompts")
    result = engine.generate(prompts, group_size, Sampling.from_settings(rollout))
    prompts = prompts.batch
    texts = in_task_frame(policy, task, result.texts, prompts, group_size)
    scores, timeouts = score_completions(task, texts, [rows[i // group_size] for i in range(len(texts))],
                                         workers=reward_workers, budget=reward_budget)
    components = {n: torch.tensor([s[n] for s in scores]).view(len(rows), group_size) for n in names}  # [b, G]
    rewards = torch.tensor([task.total(s) for s in scores]).view(len(rows), group_size)  # [b, G]
    if overlong_cache:  # DAPO's overlong shaping: a reward component from the completion's length
        lengths = result.completion_mask.sum(dim=1)  # [b * G]
        penalty = overlong_penalty_at_limit * overlong_penalty(lengths, rollout.max_new_tokens, overlong_cache)
        components["overlong"] = penalty.view(len(rows), group_size).to(rewards.dtype)  # [b, G]
        rewards = rewards + components["overlong"]
    advantages, valid = get_advantage(advantage)(rewards)  # [b, G], [b]
    valid = valid & torch.isfinite(rewards).all(dim=1)  # a NaN or infinite reward makes its group invalid
    return Attempt(rows, prompts, result, rewards, components, advantages, valid, timeouts)


def update_chunks(attempts: list[Attempt], micro_batch_size: int, micro_batch_tokens: int = 0, *,
                  share_prompt: bool = False):
    """Sequences of valid groups only, as `MicroBatch`es (prompts, prompt index, ids [n, C], mask [n, C], adv [n],
    the sampler's log-probs [n, C] or None: engine-sampled log-probs for the on-policy check).

    With `micro_batch_tokens` > 0, a micro-batch holds as many sequences as fit in that many tokens of
    forward work, padding included (see `micro_batch_cost`); groups go longest first and each group's
    sequences longest first, so neighbours have similar lengths and little padding is computed. A
    sequence over the budget on its own gets a micro-batch of its own. Otherwise `micro_batch_size`
    sequences at a time, in order.
    """
    for attempt in attempts:
        group_size = attempt.rollout.group_size if attempt.rollout else 1
        groups = attempt.valid.nonzero().flatten().tolist()
        if not groups:  # nothing to train on (an attempt of a process without prompts has no rollout)
            continue
        if micro_batch_tokens > 0:
            batches = _token_budget_batches(attempt, groups, group_size, micro_batch_tokens, share_prompt)
        else:
            sequences = [b * group_size + g for b in groups for g in range(group_size)]
            batches = [sequences[i:i + micro_batch_size] for i in range(0, len(sequences), micro_batch_size)]
        for chosen in batches:
            mask = attempt.rollout.completion_mask[chosen]  # [n, C]
            width = max(int(mask.sum(dim=1).max()), 1)
            sampler = attempt.rollout.sampler_logps
            yield MicroBatch(attempt.prompts, [s // group_size for s in chosen],
                             attempt.rollout.completion_ids[chosen, :width], mask[:, :width],
                             attempt.advantages.flatten()[chosen], None if sampler is None else sampler[chosen, :width])


def _token_budget_batches(attempt: Attempt, groups: list[int], group_size: int, budget: int,
                          share_prompt: bool) -> list[list[int]]:
    """Sequence indices of `groups`, longest group first and longest sequence first, cut at `budget` tokens."""
    lengths = attempt.rollout.completion_mask.sum(dim=1).tolist()  # [b * G]
    prompt_lengths = attempt.prompts.inputs["attention_mask"].sum(dim=1).tolist()  # [b]
    members = {b: sorted(range(b * group_size, (b + 1) * group_size), key=lambda s: -lengths[s]) for b in groups}
    batches, current = [], []
    for sequence in (s for b in sorted(groups, key=lambda b: -lengths[members[b][0]]) for s in members[b]):
        candidate = current + [sequence]
        cost = micro_batch_cost([prompt_lengths[s // group_size] for s in candidate],
                                [s // group_size for s in candidate], [lengths[s] for s in candidate],
                                share_prompt=share_prompt)
        if current and cost > budget:
            batches.append(current)
            candidate = [sequence]
        current = candidate
    return batches + ([current] if current else [])


def micro_batch_cost(prompt_lengths: list[int], prompt_index: list[int], completion_lengths: list[int], *,
                     share_prompt: bool) -> int:
    """Tokens one forward computes for these sequences, padding included: prompts are left-padded to the
    longest, completions right-padded to the longest; with `share_prompt` each distinct prompt runs once."""
    prompt_width, completion_width = max(prompt_lengths), max(max(completion_lengths), 1)
    prompts = len(set(prompt_index)) if share_prompt else len(prompt_index)
    return prompts * prompt_width + len(prompt_index) * completion_width


# ---------------------------------------------------------------------------------------------
# loss + step
# ---------------------------------------------------------------------------------------------
class MicroBatch(NamedTuple):
    """The sequences of one forward/backward: sequence n continues prompt `prompt_index[n]` of `prompts`."""

    prompts: PromptBatch
    prompt_index: list[int]
    completion_ids: torch.Tensor  # [n, C]
    completion_mask: torch.Tensor  # [n, C]
    advantages: torch.Tensor  # [n]
    sampler_logps: torch.Tensor | None = None  # [n, C]: the engine's own log-probs (vLLM), for the on-policy check


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


def update(policy: Policy, model, optimizer, scheduler, accelerator: Accelerator, attempts: list[Attempt], *,
           settings: TrainerSettings, temperature: float, path: ScoringPath | None = None,
           reference: Reference | None = None, max_new_tokens: int | None = None, sampler_check: bool = False,
           tis_cap: float = 0.0) -> dict[str, float]:
    """The optimizer steps of one rollout: `settings.ppo_epochs` passes over its valid groups, each pass in
    mini-batches of `settings.ppo_mini_batch` sequences (0: the whole rollout, one step per pass).

    GPG (the default) takes one step and needs nothing but the current log-probs. A loss that declares
    "old" gets the rollout policy's log-probs, computed once here, without gradient, before the first step,
    when there is more than one step (with one, old = current detached: ratio 1); one that declares "ref"
    (with settings.kl_coef > 0) gets the frozen reference's, through the same scoring path.
    `sampler_check` and `tis_cap`: the on-policy check of an engine that samples with its own weights (see
    `_optimizer_step`).
    """
    device = accelerator.device
    if path is None:
        path = choose_scoring_path(policy.adapter, model, share_prompt=settings.share_prompt,
                                   share_vision=settings.share_vision)
    loss_fn = get_policy_loss(settings.loss)
    aggregation = loss_aggregation(loss_fn, settings.aggregation)
    parts = 1
    if settings.ppo_mini_batch:  # collective: every process takes the same number of optimizer steps
        valid = accelerator.reduce(torch.tensor(sum(int(a.valid.sum()) for a in attempts), device=device), "sum")
        parts = max(1, math.ceil(int(valid) * settings.group_size / settings.ppo_mini_batch))
    plan = [list(update_chunks(part, settings.micro_batch_size, settings.micro_batch_tokens,
                               share_prompt=path.prompt_once)) for part in mini_batches(attempts, parts)]
    sampled = [a.rollout.completion_mask for a in attempts if a.rollout is not None]  # [b * G, C] each
    local = torch.tensor([[*(value for chunks in plan for value in (
        sum(len(c.advantages) for c in chunks), sum(int(c.completion_mask.sum()) for c in chunks), len(chunks),
        sum(not c.prompts.has_images for c in chunks))),
        sum(len(m) for m in sampled), sum(int(m.sum()) for m in sampled)]], device=device)
    # Collective: train() calls update() on every process or on none (its test uses global counts), and
    # this gather runs first and unconditionally; every branch below depends only on its result.
    counts = accelerator.gather(local)  # [processes, 4 * parts + 2]
    per_part = counts[:, :4 * parts].reshape(counts.shape[0], parts, 4)  # [processes, parts, 4]
    require_images(int(per_part[..., 3].sum()) == 0, accelerator.num_processes, "a training micro-batch")
    if int(per_part[..., 0].sum()) == 0:
        return {"loss": 0.0, "grad_norm": 0.0, "skipped": 1.0}
    column = 1 if aggregation in TOKEN_NORMALISED else 0  # the normaliser counts tokens, or sequences
    counted, sampled_count = int(per_part[..., column].sum()), int(counts[:, -2 + column].sum())
    needs = loss_needs(loss_fn)
    steps = settings.ppo_epochs * parts
    # Collective under FSDP / ZeRO-3 like the update's forwards: every process scores max-over-processes
    # micro-batches per mini-batch, padding with placeholders whose log-probs are dropped.
    calls = [int(per_part[:, part, 2].max()) for part in range(parts)]
    old = _score_plan(policy, model, plan, temperature, path, settings, attempts, calls) \
        if "old" in needs and steps > 1 else None
    ref = None
    if "ref" in needs and settings.kl_coef > 0:
        if reference is None:
            raise ValueError(f"trainer.loss={settings.loss} with kl_coef > 0 needs a reference model")
        ref_model, scope = reference.scoring(model)
        with scope:
            ref = _score_plan(policy, ref_model, plan, temperature, path, settings, attempts, calls)
    options = {"clip_low": settings.clip_low, "clip_high": settings.clip_high, "kl_coef": settings.kl_coef,
               "max_tokens": max_new_tokens}
    results, reports = [], []
    for _epoch in range(settings.ppo_epochs):
        for part, chunks in enumerate(plan):
            valid_count = int(per_part[:, part, column].sum())
            share = sampled_count if parts == 1 else sampled_count * valid_count / counted  # AGE off: pro rata
            result, report = _optimizer_step(
                policy, model, optimizer, scheduler, accelerator, attempts, chunks, loss_fn,
                old=old[part] if old is not None else None, ref=ref[part] if ref is not None else None,
                normalizer=LOSS_NORMALIZERS[settings.age](valid_count, share),
                steps_needed=int(per_part[:, part, 2].max()), settings=settings, temperature=temperature,
                path=path, aggregation=aggregation, options=options, later=bool(results),
                sequences=int(per_part[:, part, 0].sum()), sampler_check=sampler_check, tis_cap=tis_cap)
            results.append(result)
            reports.append(report)
            if result.get("nonfinite"):  # no weight changed in that step; the rollout's later steps are dropped
                break
        if results[-1].get("nonfinite"):
            break
    metrics = dict(results[0]) if len(results) == 1 else {
        "loss": sum(r["loss"] for r in results) / len(results),
        "grad_norm": sum(r["grad_norm"] for r in results) / len(results),
        "skipped": float(all(r["skipped"] for r in results)),
        **({"nonfinite": 1.0} if results[-1].get("nonfinite") else {}),
        **({"logp_mean": results[0]["logp_mean"]} if "logp_mean" in results[0] else {}),
        **{k: results[0][k] for k in ("logp_mismatch_mean", "logp_mismatch_max") if k in results[0]}}
    metrics["optimizer_steps"] = float(sum(not r["skipped"] for r in results))
    if needs:  # the same on every process (it depends on the loss only): the collective below matches
        metrics.update(_loss_reports(reports, accelerator))
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
def _score_plan(policy: Policy, model, plan: list[list[MicroBatch]], temperature: float, path: ScoringPath,
                settings: TrainerSettings, attempts: list[Attempt], calls: list[int]) -> list[list[torch.Tensor]]:
    """Log-probs [n, C] of every micro-batch of every mini-batch, without gradient (old or reference).
    Where `model`'s forward is collective (FSDP / ZeRO-3), mini-batch p runs `calls[p]` forwards on every
    process (the most micro-batches any process has), the missing ones on placeholders, dropped here."""
    device = next(model.parameters()).device

    def score(c: MicroBatch) -> torch.Tensor:
        return policy.adapter.token_logps(model, c.prompts.to(device), c.prompt_index, c.completion_ids.to(device),
                                          c.completion_mask.to(device), temperature=temperature, path=path,
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


def _optimizer_step(policy: Policy, model, optimizer, scheduler, accelerator: Accelerator, attempts: list[Attempt],
                    chunks: list[MicroBatch], loss_fn, *, old, ref, normalizer: float, steps_needed: int,
                    settings: TrainerSettings, temperature: float, path: ScoringPath, aggregation: str, options: dict,
                    later: bool, sequences: int, sampler_check: bool = False,
                    tis_cap: float = 0.0) -> tuple[dict[str, float], dict[str, float]]:
    """One optimizer step on `chunks`, the loss their sum over the global `normalizer` (AGE: the valid
    groups' count; without AGE every sampled sequence's, alpha = 1).

    The normaliser is the count over ALL processes (sequences, or tokens for `token_mean`), and each
    process's loss is multiplied by the number of processes because gradients are then averaged over
    processes: the update's gradient is the mean over every valid sequence of every process.
    Under DDP the fast paths of `token_logps` run the bare model, outside DDP's hooks, so every
    micro-batch runs under no_sync and the gradients are averaged once, explicitly, at the end. Under
    FSDP and DeepSpeed every process runs the same number of forward/backward calls, each through the
    vision tower (gpg_vl/distributed.py says why); a process short of micro-batches runs zero-weighted
    placeholders. A NaN or infinite loss or gradient (on any process) skips the step: no weight changes.
    `sequences`: the step's valid sequences over all processes (the MoE router loss is averaged over them).
    `path` is the run's scoring path (`choose_scoring_path`, chosen once in `setup`): the forward and the
    micro-batch cost both follow it, so a micro-batch never holds more tokens than trainer.micro_batch_tokens.
    `sampler_check` (an engine that returns its own log-probs: vLLM; the same on every process) adds the
    on-policy check, `logp_mismatch_mean` / `_max` over all processes' tokens; with `tis_cap` > 0 each token's
    loss is multiplied by its truncated importance weight min(p / q, tis_cap) (gpg_vl/rollout/correction.py).
    Returns (metrics, this process's token-weighted sums of the loss's own metrics).
    """
    device = accelerator.device
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    real = len(chunks)
    if steps_needed > real and not ddp:  # DDP needs no matching calls: its reduction is the explicit one below
        chunks = chunks + [MicroBatch(*placeholder_chunk(policy, attempts, device))] * (steps_needed - real)
    total_loss, logp_sum, token_count = 0.0, 0.0, 0
    gap_sum, gap_max, gap_count = 0.0, 0.0, 0  # the on-policy check (sampler_check)
    report: dict[str, float] = {}
    try:
        for index, (prompts, prompt_index, ids, mask, adv, sampler) in enumerate(chunks):
            # The same index on every process outside DDP (len(chunks) == steps_needed there); DeepSpeed
            # takes its optimizer step inside the backward that has sync_gradients set.
            sync = index == len(chunks) - 1 and not ddp
            accelerator.sync_gradients = sync
            with contextlib.nullcontext() if sync else accelerator.no_sync(model):
                mask = mask.to(device)
                # Collective under FSDP / ZeRO-3 (weights gathered per module): every process runs this
                # forward steps_needed times, each with images (require_images), so the calls match.
                logps = policy.adapter.token_logps(model, prompts.to(device), prompt_index, ids.to(device), mask,
                                                   temperature=temperature, path=path,
                                                   logits_chunk_tokens=settings.logits_chunk_tokens)  # [n, C]
                if sampler is not None and index < real:  # the engine's own log-probs (vLLM)
                    sampler = sampler.to(device)
                    total, worst, count = logp_mismatch(logps, sampler, mask)
                    gap_sum, gap_max, gap_count = gap_sum + total, max(gap_max, worst), gap_count + count
                    if tis_cap > 0:
                        logps = logps * truncated_is_weights(logps, sampler, mask, tis_cap)  # [n, C]
                router = policy.adapter.router_aux_loss(model)  # MoE load balancing (None unless turned on)
                if index >= real:  # placeholder: every parameter takes part, with a zero gradient
                    loss = torch.where(mask, logps, torch.zeros_like(logps)).sum() * 0.0
                else:
                    loss, info = loss_fn(logps, mask, adv.to(device),
                                         old_logps=old[index] if old is not None else None,
                                         ref_logps=ref[index] if ref is not None else None,
                                         aggregation=aggregation, normalizer=normalizer, **options)
                    if router is not None:  # averaged over the micro-batches, weighted by their sequences
                        loss = loss + router * (len(adv) / sequences)
                    total_loss += float(loss.detach())
                    logp_sum += info["logp_mean"] * info["num_tokens"]
                    token_count += int(info["num_tokens"])
                    _add_report(report, info, later=later and old is not None)
                # Collective on the last micro-batch (ZeRO all-reduce) or on each (FSDP reduce-scatter):
                # a backward after a forward, the same count on every process. Local under DDP (no_sync).
                accelerator.backward(loss * accelerator.num_processes)
    finally:
        accelerator.sync_gradients = True
    if ddp:
        _average_gradients(model, accelerator)  # collective: every process calls it once per update
    # Collective under FSDP (the norm of sharded gradients); the gradients are already reduced, so the
    # norm, and the decision below, are the same on every process. Under DeepSpeed the engine clipped
    # (its own gradient_clipping) and stepped in the last backward, and this only reads the norm back.
    norm = accelerator.clip_grad_norm_(model.parameters(), settings.max_grad_norm)
    grad_norm = 0.0 if norm is None else float(norm)
    # Collective, before any branch: every process reaches it exactly once per update.
    totals = accelerator.reduce(torch.tensor([total_loss, logp_sum, token_count], device=device,
                                             dtype=torch.float64), "sum")
    if not (math.isfinite(grad_norm) and math.isfinite(float(totals[0]))):  # global: every process agrees
        optimizer.zero_grad(set_to_none=True)
        return {"loss": float(totals[0]), "grad_norm": grad_norm, "skipped": 1.0, "nonfinite": 1.0}, report
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    result = {"loss": float(totals[0]), "grad_norm": grad_norm, "skipped": 0.0,
              "logp_mean": float(totals[1] / max(float(totals[2]), 1.0))}
    if sampler_check:  # collective, on every process alike (the engine is the same everywhere)
        gaps = accelerator.gather(torch.tensor([[gap_sum, gap_max, gap_count]], device=device,
                                               dtype=torch.float64))  # [processes, 3]
        result["logp_mismatch_mean"] = float(gaps[:, 0].sum() / max(float(gaps[:, 2].sum()), 1.0))
        result["logp_mismatch_max"] = float(gaps[:, 1].max())
    return result, report


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


# ---------------------------------------------------------------------------------------------
# log + save
# ---------------------------------------------------------------------------------------------
def step_metrics(collected, accelerator: Accelerator, reward_names: list[str],
                 reward_errors: int = 0) -> dict[str, float]:
    """Global reward statistics over every completion sampled in this step (collective: one all-reduce, called
    once per step by every process; a process without prompts adds zeros). Completions with a NaN or
    infinite reward are counted (`rewards_nonfinite`), not averaged; `reward_errors` (this process's count of
    reward function calls that raised) and the completions not scored within the reward budget
    (`reward_timeouts`) are summed over processes."""
    # one row per attempt: completions, finite rewards, their sum and sum of squares, completion tokens,
    # reward errors, reward timeouts, each component's sum over the finite rewards; plus a row for this
    # process's errors
    rows = [torch.zeros(7 + len(reward_names), dtype=torch.float64)]
    rows[0][5] = reward_errors
    for attempt in collected.attempts:
        lengths = attempt.rollout.completion_mask.sum(dim=1).float() if attempt.rollout else torch.zeros(0)
        r = attempt.rewards.flatten()
        finite = torch.isfinite(r)
        rows.append(torch.stack([
            torch.tensor(float(r.numel())), finite.sum().float(), r[finite].sum(), (r[finite] ** 2).sum(),
            lengths.sum(), torch.tensor(0.0), torch.tensor(float(attempt.reward_timeouts)),
            *[attempt.components[n].flatten()[finite].sum() for n in reward_names]]).double())
    totals = accelerator.reduce(torch.stack(rows).sum(0).to(accelerator.device), "sum").cpu().tolist()
    completions, scored, total, squares, tokens, errors, timeouts = totals[:7]
    mean = total / max(scored, 1.0)
    metrics = {"reward_mean": mean, "reward_std": math.sqrt(max(squares / max(scored, 1.0) - mean * mean, 0.0))}
    metrics.update({f"reward/{n}": totals[7 + i] / max(scored, 1.0) for i, n in enumerate(reward_names)})
    metrics["completion_tokens_mean"] = tokens / max(completions, 1.0)
    metrics["rewards_nonfinite"] = int(completions - scored)
    metrics["reward_errors"] = int(errors)
    metrics["reward_timeouts"] = int(timeouts)
    return metrics


# ---------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------
@dataclass
class Run:
    """One training run, built once by `setup`; `step(run)` advances it by one rollout."""

    accelerator: Accelerator
    policy: Policy
    model: torch.nn.Module  # the prepared (possibly wrapped) model; policy.model is the bare one
    optimizer: torch.optim.Optimizer
    scheduler: object
    task: object
    stream: PromptStream
    trainer: TrainerSettings
    rollout: RolloutSettings
    path: ScoringPath
    reference: Reference | None
    engine: object  # rollout.engine's (gpg_vl/rollout/): samples, evaluates, takes the weights after each step
    output_dir: Path
    main: bool
    counters: dict
    summary: dict
    record: dict  # the summary's part that spans continuations (saved in checkpoints)
    config: dict | None  # the run's resolved config (recorded in checkpoints, compared on resume)
    eval_rows: object
    eval_kwargs: dict
    reward_names: list[str]
    bar: object
    warn: object  # warn(message): print a warning once per run
    stop: object  # stop(message): end the run with one sentence, written to summary.json
    start_step: int = 0
    step: int = 0
    history: list[dict] = field(default_factory=list)
    attempts: list = field(default_factory=list)  # the last step's attempts (its rollouts, for the rollout log)

    @property
    def metrics_file(self) -> Path:
        return self.output_dir / "metrics.jsonl"


def _holding_output_dir(train_fn):
    """`train` holds its output_dir for the whole run (gpg_vl/train/outdir.py: one run per folder); the main
    process takes the lock. A no-op where the caller (the CLI's train_main) already holds it."""
    @functools.wraps(train_fn)
    def holding(policy, task, **kwargs):
        from accelerate import PartialState

        accelerator = kwargs.get("accelerator")
        if not (accelerator.is_main_process if accelerator is not None else PartialState().is_main_process):
            return train_fn(policy, task, **kwargs)
        with claim_output_dir(kwargs["output_dir"], resume=kwargs.get("resume_from")):
            return train_fn(policy, task, **kwargs)
    return holding


FUSED_ADAMW_DEVICES = ("cpu", "cuda")  # devices torch has the fused AdamW kernel for


def build_optimizer(model: torch.nn.Module, trainer: TrainerSettings) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters: fused (one kernel per parameter group instead of a dozen
    elementwise passes, as transformers' Trainer defaults to) where torch has the fused kernel for the
    parameters' device, else the multi-tensor one."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = bool(params) and all(p.device.type in FUSED_ADAMW_DEVICES and p.is_floating_point() for p in params)
    return torch.optim.AdamW(params, lr=trainer.lr, weight_decay=trainer.weight_decay, fused=fused or None)


@_holding_output_dir
def train(policy: Policy, task, *, trainer: TrainerSettings, rollout: RolloutSettings, evaluation: EvalSettings,
          output_dir: str | Path, seed: int = 0, resume_from: str | Path | None = None,
          accelerator: Accelerator | None = None, config: dict | None = None, max_bad_fraction: float = 0.05,
          reference: torch.nn.Module | None = None) -> dict:
    """Train `policy` on `task` with trainer.loss (GPG by default); returns the run summary (also written to
    summary.json). Reads top to bottom: setup -> evaluate -> steps (sample, score, advantage, update, log,
    save) -> final save and evaluation.

    `resume_from` is a complete checkpoint (see gpg_vl/train/checkpoint.py): training continues from its step with
    its optimizer, scheduler, RNG states and data position, and metrics.jsonl loses any lines past that step.
    Bad rows are skipped and counted; more than `max_bad_fraction` of the rows seen stops the run.
    `reference`: the initial weights, for a loss with a KL term (see `setup`).
    """
    run = setup(policy, task, trainer=trainer, rollout=rollout, evaluation=evaluation, output_dir=output_dir,
                seed=seed, resume_from=resume_from, accelerator=accelerator, config=config,
                max_bad_fraction=max_bad_fraction, reference=reference)
    if run.trainer.eval_before and run.start_step == 0:
        evaluate_held_out(run, "before")
    for _ in range(run.start_step + 1, run.trainer.max_steps + 1):
        metrics = step(run)
        log_step(run, metrics, run.attempts)
        stop_on_bad_steps(run)
        save_step(run)
        if run.trainer.max_completions and run.counters["completions_sampled"] >= run.trainer.max_completions:
            break  # a budget of sampled completions: equal-cost comparisons of G and variants
    return finish(run)


def setup(policy: Policy, task, *, trainer: TrainerSettings, rollout: RolloutSettings, evaluation: EvalSettings,
          output_dir: str | Path, seed: int = 0, resume_from: str | Path | None = None,
          accelerator: Accelerator | None = None, config: dict | None = None, max_bad_fraction: float = 0.05,
          reference: torch.nn.Module | None = None) -> Run:
    """Build a run once: seeds, data, optimizer and schedule (counting optimizer steps), the prepared model,
    the reference model when the loss needs one, the scoring path, the resumed state, the held-out rows.

    The reference (loss grpo with trainer.kl_coef > 0) is the initial weights, frozen: with LoRA the policy
    with its adapters disabled; otherwise `reference` when given (the CLI rebuilds it from the model source,
    so a resumed run gets the same one), else a copy of `policy`'s weights taken here, before any step.
    Checkpoints never hold it.
    """
    accelerator = accelerator or Accelerator(
        log_with=None if trainer.report_to == "none" else trainer.report_to, project_dir=str(output_dir))
    output_dir = Path(output_dir)
    main = accelerator.is_main_process
    if main:
        output_dir.mkdir(parents=True, exist_ok=True)
        with writing("write config.json", output_dir):
            write_atomic(output_dir / "config.json", json.dumps(config or {}, indent=2, default=str))
    # Each process samples its own completions: with one seed everywhere they would draw the same numbers.
    torch.manual_seed(seed + accelerator.process_index)
    random.seed(seed + accelerator.process_index)
    np.random.seed(seed + accelerator.process_index)
    if trainer.batch_size < accelerator.num_processes:
        raise UserError(f"trainer.batch_size={trainer.batch_size} is smaller than the {accelerator.num_processes} "
                        "processes, so some would get no prompt; set trainer.batch_size to at least "
                        f"{accelerator.num_processes} (prompts per step, over all processes).")

    policy.adapter.require_box_frame(task)  # a grounding task on a family without a box frame: one sentence
    train_rows = task.load(task.train_split)
    if trainer.epochs:  # epochs over the train split decide the length of the run
        trainer = replace(trainer, max_steps=max(1, math.ceil(trainer.epochs * len(train_rows) / trainer.batch_size)))
    model = policy.model
    frozen = build_reference(model, trainer, reference, resuming=resume_from is not None)
    if trainer.gradient_checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.x name
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = build_optimizer(model, trainer)
    # The schedule counts optimizer steps: mu x mini-batches per rollout (one per step for GPG).
    scheduler = get_scheduler(trainer.lr_schedule, optimizer, num_warmup_steps=trainer.warmup_steps,
                              num_training_steps=trainer.max_steps * trainer.optimizer_steps_per_rollout)
    _check_engine(accelerator)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    policy = replace(policy, model=accelerator.unwrap_model(model))
    frozen = place_reference(frozen, accelerator)
    engine = build_engine(rollout, policy, accelerator=accelerator)  # rollout.engine: samples, and evaluates
    if trainer.report_to != "none":
        accelerator.init_trackers("gpg-vl", config=_flat_scalars(config or {}))

    warned: set[str] = set()

    def warn(message: str) -> None:
        if message not in warned:
            warned.add(message)
            accelerator.print(f"warning: {message}")

    def stop(message: str) -> None:
        """End the run with one sentence (too many bad rows or bad steps); summary.json says why."""
        bar.close()
        if main:
            summary.update({"stopped": message, "data": stream.bad.summary(), **counters, **record})
            with writing("write summary.json", output_dir):
                write_atomic(output_dir / "summary.json", json.dumps(summary, indent=2))
        raise UserError(message)

    # The scoring path, once for the run: the update's forward and its micro-batch cost both read it.
    path = choose_scoring_path(policy.adapter, model, share_prompt=trainer.share_prompt,
                               share_vision=trainer.share_vision, warn=warn)
    accelerator.print(f"model: {policy.adapter.describe(model)}; the update scores {path.describe()}")
    stream = PromptStream(train_rows, seed=seed, rank=accelerator.process_index, world_size=accelerator.num_processes,
                          max_bad_fraction=max_bad_fraction, warn=warn, stop=stop,
                          max_aspect_ratio=policy.adapter.max_aspect_ratio)
    start_step = 0
    counters = {"reward_errors": 0, "rewards_nonfinite": 0, "nonfinite_steps": 0, "bad_steps_in_a_row": 0,
                "completions_sampled": 0, "reward_timeouts": 0}  # saved in checkpoints: a resumed run continues them
    record: dict = {"train_seconds": 0.0}  # the summary's part that spans continuations, saved in checkpoints too
    if resume_from is not None:
        start_step = load_trainer_state(Path(resume_from), optimizer, scheduler, stream, accelerator=accelerator,
                                        model=model, counters=counters, record=record)
        accelerator.print(f"resumed from {resume_from} at step {start_step}")
    metrics_file = output_dir / "metrics.jsonl"
    if main:  # what an interrupted save or an earlier continuation of this run left behind
        for leftover in remove_partials(output_dir):
            accelerator.print(f"removed {leftover.name}, left by an interrupted save")
        truncate_metrics(metrics_file, start_step)
        if start_step:
            for later in later_checkpoints(output_dir, start_step):
                remove_checkpoint(later)
                accelerator.print(f"removed {later.name}: it is past step {start_step}, which this run continues")

    eval_rows = task.load(evaluation.split or task.eval_split)
    eval_rows = eval_rows[:evaluation.limit] if evaluation.limit else eval_rows
    eval_data = None
    if (trainer.eval_before and start_step == 0) or trainer.eval_after:  # held-out rows are checked once, here
        good, eval_data = scan_rows(task, eval_rows, max_bad_fraction=max_bad_fraction,
                                    max_aspect_ratio=policy.adapter.max_aspect_ratio)
        if eval_data.bad:
            warn(f"{eval_data.bad} held-out rows are bad and left out of evaluation:\n{eval_data.report()}")
        if eval_data.over_limit():
            raise UserError(f"held-out split: {eval_data.stop_message()}")
        eval_rows = Subset(eval_rows, good)
    eval_kwargs = {"batch_size": evaluation.batch_size,
                   "max_new_tokens": evaluation.max_new_tokens or rollout.max_new_tokens,
                   "rank": accelerator.process_index, "world_size": accelerator.num_processes,
                   "gather": gather_object, "engine": engine, "reward_workers": evaluation.reward_workers,
                   "reward_budget_s": evaluation.reward_budget_s}
    summary: dict = {"task": task.name, "model": policy.name_or_path, "output_dir": str(output_dir), **record}
    if eval_data is not None:
        summary["eval_data"] = eval_data.summary()
    bar = tqdm(total=trainer.max_steps, initial=start_step, disable=not main, desc=trainer.loss.upper(),
               dynamic_ncols=True)
    reward_names = list(task.reward_functions) + (["overlong"] if trainer.overlong_cache else [])
    return Run(accelerator=accelerator, policy=policy, model=model, optimizer=optimizer, scheduler=scheduler,
               task=task, stream=stream, trainer=trainer, rollout=rollout, path=path, reference=frozen,
               output_dir=output_dir, main=main, counters=counters, summary=summary, record=record, config=config,
               eval_rows=eval_rows,
               eval_kwargs=eval_kwargs, reward_names=reward_names, bar=bar, warn=warn, stop=stop,
               engine=engine, start_step=start_step, step=start_step)


def needs_reference(trainer: TrainerSettings) -> bool:
    """Whether trainer.loss scores a frozen reference model (it declares "ref" and trainer.kl_coef > 0)."""
    return "ref" in loss_needs(get_policy_loss(trainer.loss)) and trainer.kl_coef > 0


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
    frozen.model.to(accelerator.device)
    return frozen


def step(run: Run) -> dict:
    """One rollout and its update: sample + score + advantage (resampling until enough groups carry signal),
    then the optimizer steps on the valid groups; returns the step's metrics."""
    trainer, accelerator, task = run.trainer, run.accelerator, run.task
    run.step += 1
    started = time.perf_counter()
    errors_before = sum(getattr(task, "reward_errors", {}).values())
    budget = RewardBudget(trainer.reward_budget_s)  # reward time of this step, over all its attempts
    collected = collect_valid_groups(
        lambda: sample_attempt(run.policy, task, run.stream, batch_size=trainer.batch_size,
                               group_size=trainer.group_size, rollout=run.rollout, warn=run.warn,
                               advantage=trainer.advantage, overlong_cache=trainer.overlong_cache,
                               overlong_penalty_at_limit=trainer.overlong_penalty,
                               reward_workers=trainer.reward_workers, reward_budget=budget, engine=run.engine),
        lambda attempt: _global_counts(attempt, accelerator),
        beta_th=trainer.beta_th, batch_size=trainer.batch_size,
        max_attempts=_attempts_allowed(trainer, run.counters["completions_sampled"]))
    rolled = time.perf_counter()
    run.attempts = collected.attempts
    run.counters["completions_sampled"] += collected.groups_sampled * trainer.group_size  # resampling included
    # loss + step, on valid groups only
    if collected.groups_valid > 0:
        result = update(run.policy, run.model, run.optimizer, run.scheduler, accelerator, collected.attempts,
                        settings=trainer, temperature=run.rollout.temperature, path=run.path,
                        reference=run.reference, max_new_tokens=run.rollout.max_new_tokens,
                        sampler_check=run.engine.returns_logps, tis_cap=run.rollout.vllm.tis_cap)
        if not result.get("skipped"):
            run.engine.sync(run.model)  # an engine with its own weights takes the stepped ones (HF: nothing to do)
        limit = run.rollout.vllm.max_logp_mismatch
        if result.get("logp_mismatch_mean", 0.0) > limit:
            run.warn(f"the sampler's log-probs differ from the trainer's by {result['logp_mismatch_mean']:.4f} per "
                     f"token on average, over rollout.vllm.max_logp_mismatch={limit}: the rollout is off-policy; "
                     "check the weight sync and dtype, or set rollout.vllm.tis_cap=2.")
    else:
        result = {"loss": 0.0, "grad_norm": 0.0, "skipped": 1.0}
        run.warn("a step had no group with differing rewards after trainer.max_attempts rollouts; "
                 "it was skipped (check the task's rewards, or raise rollout.temperature).")
    updated = time.perf_counter()
    # a NaN or infinite loss or gradient: update() took no optimizer step; too many in a row stop the run
    bad_step = bool(result.get("nonfinite"))
    run.counters["nonfinite_steps"] += bad_step
    run.counters["bad_steps_in_a_row"] = run.counters["bad_steps_in_a_row"] + 1 if bad_step else 0
    if bad_step:
        accelerator.print(f"warning: step {run.step}: the loss or gradient is NaN or infinite (loss={result['loss']}, "
                          f"grad_norm={result['grad_norm']}); the step was skipped, no weight changed "
                          f"({run.counters['bad_steps_in_a_row']} in a row, trainer.max_bad_steps="
                          f"{trainer.max_bad_steps}).")
    errors = sum(getattr(task, "reward_errors", {}).values()) - errors_before
    return {"step": run.step, **step_metrics(collected, accelerator, run.reward_names, reward_errors=errors),
            "valid_fraction": collected.valid_fractions[0], "valid_fractions": collected.valid_fractions,
            "attempts": len(collected.attempts), "groups_sampled": collected.groups_sampled,
            "groups_used": collected.groups_valid,
            "alpha": loss_alpha(trainer.age, collected.groups_sampled, collected.groups_valid),
            "completions_sampled": run.counters["completions_sampled"],
            **result, "lr": run.scheduler.get_last_lr()[0], "nonfinite_steps": run.counters["nonfinite_steps"],
            **run.stream.bad.metrics(), "data_epoch": run.stream.epoch, "data_position": run.stream.position,
            "rollout_s": rolled - started, "update_s": updated - rolled,
            "step_s": time.perf_counter() - started}


def log_step(run: Run, metrics: dict, attempts: list[Attempt]) -> None:
    """Count the step's reward problems, append its metrics to metrics.jsonl, the progress bar and trackers;
    record its rollouts (`attempts`) for viewing every trainer.log_rollouts_every steps."""
    run.counters["reward_errors"] += metrics["reward_errors"]
    run.counters["rewards_nonfinite"] += metrics["rewards_nonfinite"]
    run.counters["reward_timeouts"] += metrics["reward_timeouts"]
    run.record["train_seconds"] += metrics["step_s"]
    if metrics["reward_timeouts"]:
        run.warn(f"some completions were not scored within trainer.reward_budget_s={run.trainer.reward_budget_s} s "
                 "of reward time per step; they scored 0 and are counted per step as reward_timeouts in "
                 "metrics.jsonl (raise the budget or trainer.reward_workers, or make the task's rewards faster).")
    if metrics["rewards_nonfinite"]:
        names = sorted(getattr(run.task, "reward_nonfinite", {})) or ["on another process"]
        run.warn(f"some completions got a NaN or infinite reward (reward {', '.join(names)}); their groups are left "
                 "out of the update and counted per step as rewards_nonfinite in metrics.jsonl.")
    run.history.append(metrics)
    if run.main:  # a line cut short by a full disk is dropped by the resume (truncate_metrics)
        with writing(f"append step {run.step} to metrics.jsonl", run.output_dir), \
                run.metrics_file.open("a") as handle:
            handle.write(json.dumps(metrics) + "\n")
        run.bar.set_postfix(reward=f"{metrics['reward_mean']:.2f}", valid=f"{metrics['valid_fraction']:.2f}",
                            alpha=f"{metrics['alpha']:.2f}")
        run.bar.update(1)
    if run.trainer.report_to != "none":
        run.accelerator.log({k: v for k, v in metrics.items() if not isinstance(v, list)}, step=run.step)
    with writing(f"write step {run.step}'s rollouts", run.output_dir):
        log_rollouts(run.step, attempts, policy=run.policy, task=run.task, output_dir=run.output_dir,
                     every=run.trainer.log_rollouts_every, groups=run.trainer.log_rollouts_groups,
                     accelerator=run.accelerator)


def stop_on_bad_steps(run: Run) -> None:
    """Too many steps in a row with a NaN or infinite loss or gradient end the run in one sentence."""
    trainer, bad = run.trainer, run.counters["bad_steps_in_a_row"]
    if trainer.max_bad_steps and bad >= trainer.max_bad_steps:
        last = latest_checkpoint(run.output_dir) if run.main else None
        run.stop(f"stopped at step {run.step}: the last {bad} steps had a NaN or infinite loss "
                 f"or gradient (trainer.max_bad_steps={trainer.max_bad_steps}) and changed no weight; the last good "
                 f"checkpoint, {last or 'none (none was written)'}, is intact: lower trainer.lr, check the task's "
                 "rewards and data, then continue with resume=auto.")


def save_step(run: Run) -> None:
    """checkpoint-<step>/ every trainer.save_every steps (never while steps are failing, so the last good
    checkpoint is not rotated away)."""
    if run.trainer.save_every and run.step % run.trainer.save_every == 0:
        if run.counters["bad_steps_in_a_row"] or not _finite_weights(run.model, run.accelerator):
            run.warn(f"step {run.step}: no checkpoint written: the weights or the last step are not finite.")
        else:
            save_checkpoint(run.output_dir / f"checkpoint-{run.step}", run.policy, run.model, run.optimizer,
                            run.scheduler, run.stream, run.step, run.accelerator, keep=run.trainer.keep_checkpoints,
                            counters=run.counters, config=run.config, record=run.record)


def evaluate_held_out(run: Run, when: str) -> None:
    """Greedy evaluation of the held-out rows, into the summary as accuracy_<when> and eval_<when>."""
    metrics, _ = evaluate(run.policy, run.task, run.eval_rows, **run.eval_kwargs)
    run.summary[f"accuracy_{when}"] = metrics.get("accuracy")
    run.summary[f"eval_{when}"] = metrics
    if when == "before":  # kept in the record: a resumed run's summary still holds the first evaluation
        run.record.update({"accuracy_before": metrics.get("accuracy"), "eval_before": metrics})
    run.accelerator.print(f"held-out {when} training:{' ' if when == 'after' else ''} {_format(metrics)}")


def finish(run: Run) -> dict:
    """The final save and evaluation; summary.json and curves.png; returns the summary."""
    run.bar.close()
    save_checkpoint(run.output_dir / "final", run.policy, run.model, run.optimizer, run.scheduler, run.stream,
                    run.step, run.accelerator, counters=run.counters, config=run.config, record=run.record)
    if run.stream.bad.bad:
        run.accelerator.print(run.stream.bad.report("training rows"))
    if run.trainer.eval_after:
        evaluate_held_out(run, "after")
    summary = run.summary
    summary["steps"] = run.step
    summary["train_seconds"] = run.record["train_seconds"]  # every continuation's steps, up to this one
    summary["data"] = run.stream.bad.summary()
    summary.update({key: value for key, value in run.counters.items() if key != "bad_steps_in_a_row"})
    if run.main:
        with writing("write summary.json", run.output_dir):
            write_atomic(run.output_dir / "summary.json", json.dumps(summary, indent=2))
        if run.metrics_file.is_file() and run.metrics_file.stat().st_size:  # a resumed run's too, with no step left
            with writing("write curves.png", run.output_dir):
                write_curves(run.metrics_file, run.output_dir / "curves.png")
    if run.trainer.report_to != "none":
        run.accelerator.end_training()
    return summary


def _flat_scalars(config: dict, prefix: str = "") -> dict:
    """Trackers take flat scalar hyper-parameters: {"trainer": {"lr": 1}} -> {"trainer.lr": 1}."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flat_scalars(value, f"{prefix}{key}."))
        elif value is None or isinstance(value, (int, float, str, bool)):
            flat[f"{prefix}{key}"] = value
    return flat


def _finite_weights(model, accelerator: Accelerator) -> bool:
    """Whether every trainable weight is finite, on every process (one parameter at a time: little memory)."""
    bad = sum(int(not torch.isfinite(p).all()) for p in model.parameters() if p.requires_grad)
    return int(accelerator.reduce(torch.tensor(bad, device=accelerator.device), "sum")) == 0


def _check_engine(accelerator: Accelerator) -> None:
    """Say when accelerate ignored the engine the launch asked for; size DeepSpeed's batch bookkeeping."""
    for engine, wanted in (("FSDP", DistributedType.FSDP), ("DEEPSPEED", DistributedType.DEEPSPEED)):
        if os.environ.get(f"ACCELERATE_USE_{engine}", "").lower() == "true" and accelerator.distributed_type != wanted:
            accelerator.print(f"warning: the launch asked for {engine}, but accelerate runs "
                              f"{accelerator.distributed_type.value} (it enables {engine} on GPUs and other "
                              "accelerators only, not with --cpu or on a machine without one).")
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        # accelerate sizes DeepSpeed's batch from a dataloader, and the trainer has none (it draws prompts
        # itself). The value is bookkeeping only: the update's micro-batches are the trainer's own.
        accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 1


def _attempts_allowed(trainer: TrainerSettings, completions_sampled: int) -> int:
    """trainer.max_attempts, fewer when resampling would sample past trainer.max_completions (never < 1)."""
    if not trainer.max_completions:
        return trainer.max_attempts
    left = math.ceil((trainer.max_completions - completions_sampled) / (trainer.batch_size * trainer.group_size))
    return max(1, min(trainer.max_attempts, left))


def _global_counts(attempt: Attempt, accelerator: Accelerator) -> tuple[int, int]:
    """(groups, valid groups) of an attempt over all processes. Collective: collect_valid_groups calls it
    once per attempt on every process, and stops on its result, the same everywhere."""
    counts = accelerator.reduce(torch.tensor([attempt.valid.numel(), int(attempt.valid.sum())],
                                             device=accelerator.device), "sum")
    return int(counts[0]), int(counts[1])


def _format(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k}={v:.3f}" for k, v in metrics.items() if isinstance(v, float))
