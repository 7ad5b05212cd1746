"""The GPG training loop, on accelerate. Read `train` top to bottom:
sample -> score -> advantage -> loss -> step -> log -> save.

Nothing here assumes one process: prompts of a step are split across processes, every count that
drives a decision (valid groups, resampling, the loss normaliser) is all-reduced, and checkpoints are
written by the main process only.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, gather_object
from tqdm.auto import tqdm
from transformers import get_scheduler

from gpg_vl.checkpoint import (
    later_checkpoints,
    latest_checkpoint,
    load_trainer_state,
    remove_checkpoint,
    remove_partials,
    save_checkpoint,
    truncate_metrics,
)
from gpg_vl.data import PromptStream, Subset, scan_rows
from gpg_vl.distributed import forward_is_collective, placeholder_chunk, placeholder_prompts, require_images
from gpg_vl.engines import EnginePrompts, Sampling, build_engine, encode_prompts
from gpg_vl.engines.correction import logp_mismatch, truncated_is_weights
from gpg_vl.engines.hf import HFEngine
from gpg_vl.errors import UserError
from gpg_vl.evaluate import evaluate
from gpg_vl.models.base import Policy
from gpg_vl.models.family import PromptBatch, ScoringPath, choose_scoring_path
from gpg_vl.objective import ADVANTAGE_ESTIMATORS, LOSS_NORMALIZERS, estimator_name, loss_alpha, policy_loss
from gpg_vl.report import write_curves
from gpg_vl.rollout import Rollout, in_task_frame  # noqa: F401
from gpg_vl.sampler import collect_valid_groups
from gpg_vl.settings import EvalSettings, RolloutSettings, TrainerSettings  # noqa: F401  (declared once there)


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


# ---------------------------------------------------------------------------------------------
# sample + score + advantage
# ---------------------------------------------------------------------------------------------
def sample_attempt(policy: Policy, task, stream: PromptStream, *, batch_size: int, group_size: int,
                   rollout: RolloutSettings, std_normalize: bool, warn, baseline: str = "group_mean",
                   engine=None) -> Attempt:
    """Draw this process's share of `batch_size` prompts, roll out G completions each through `engine`
    (rollout.engine's; the HF engine when None), score them."""
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
        return Attempt([], None, None, empty, {n: empty for n in names}, empty, torch.zeros(0, dtype=torch.bool))
    # Raised by this process alone, before its next collective: the launcher (torchrun) then stops the others.
    require_images(prompts.batch.has_images, stream.world_size, "a batch of training prompts")
    result = engine.generate(prompts, group_size, Sampling.from_settings(rollout))
    prompts = prompts.batch
    texts = in_task_frame(policy, task, result.texts, prompts, group_size)
    scores = [task.reward_components(text, rows[i // group_size]) for i, text in enumerate(texts)]
    components = {n: torch.tensor([s[n] for s in scores]).view(len(rows), group_size) for n in names}  # [b, G]
    rewards = torch.tensor([task.total(s) for s in scores]).view(len(rows), group_size)  # [b, G]
    advantages, valid = ADVANTAGE_ESTIMATORS[estimator_name(baseline, std_normalize)](rewards)  # [b, G], [b]
    valid = valid & torch.isfinite(rewards).all(dim=1)  # a NaN or infinite reward makes its group invalid
    return Attempt(rows, prompts, result, rewards, components, advantages, valid)


def update_chunks(attempts: list[Attempt], micro_batch_size: int, micro_batch_tokens: int = 0, *,
                  share_prompt: bool = False):
    """Sequences of valid groups only, as micro-batches (prompts, prompt index, ids [n, C], mask [n, C], adv [n],
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
            yield (attempt.prompts, [s // group_size for s in chosen],
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
def update(policy: Policy, model, optimizer, scheduler, accelerator: Accelerator, attempts: list[Attempt], *,
           settings: TrainerSettings, temperature: float, path: ScoringPath | None = None,
           sampler_check: bool = False, tis_cap: float = 0.0) -> dict[str, float]:
    """One optimizer step on the valid groups' sequences; the loss is their global mean (AGE), or with
    `settings.age=False` their sum over the count of every sampled sequence of the attempts (alpha = 1).

    The normaliser is the count over ALL processes (sequences, or tokens for `token_mean`), and each
    process's loss is multiplied by the number of processes because gradients are then averaged over
    processes: the update's gradient is the mean over every valid sequence of every process.
    Under DDP the fast paths of `token_logps` run the bare model, outside DDP's hooks, so every
    micro-batch runs under no_sync and the gradients are averaged once, explicitly, at the end. Under
    FSDP and DeepSpeed every process runs the same number of forward/backward calls, each through the
    vision tower (gpg_vl/distributed.py says why); a process short of micro-batches runs zero-weighted
    placeholders. A NaN or infinite loss or gradient (on any process) skips the step: no weight changes.
    `path` is the run's scoring path (`choose_scoring_path`, chosen once in `train`): the forward and the
    micro-batch cost both follow it, so a micro-batch never holds more tokens than trainer.micro_batch_tokens.
    `sampler_check` (an engine that returns its own log-probs: vLLM; the same on every process) adds the
    on-policy check, `logp_mismatch_mean` / `_max` over all processes' tokens; with `tis_cap` > 0 each token's
    loss is multiplied by its truncated importance weight min(p / q, tis_cap) (gpg_vl/engines/correction.py).
    """
    device = accelerator.device
    if path is None:
        path = choose_scoring_path(policy.adapter, model, share_prompt=settings.share_prompt,
                                   share_vision=settings.share_vision)
    chunks = list(update_chunks(attempts, settings.micro_batch_size, settings.micro_batch_tokens,
                                share_prompt=path.prompt_once))
    sampled = [a.rollout.completion_mask for a in attempts if a.rollout is not None]  # [b * G, C] each
    local = torch.tensor([[sum(len(c[4]) for c in chunks), sum(int(c[3].sum()) for c in chunks), len(chunks),
                           sum(not c[0].has_images for c in chunks),
                           sum(len(m) for m in sampled), sum(int(m.sum()) for m in sampled)]], device=device)
    # Collective: train() calls update() on every process or on none (its test uses global counts), and
    # this gather runs first and unconditionally; every branch below depends only on its result.
    counts = accelerator.gather(local)  # [processes, 6]
    global_sequences, global_tokens = int(counts[:, 0].sum()), int(counts[:, 1].sum())
    sampled_sequences, sampled_tokens = int(counts[:, 4].sum()), int(counts[:, 5].sum())
    steps_needed = int(counts[:, 2].max())
    require_images(int(counts[:, 3].sum()) == 0, accelerator.num_processes, "a training micro-batch")
    if global_sequences == 0:
        return {"loss": 0.0, "grad_norm": 0.0, "skipped": 1.0}
    normalizer = LOSS_NORMALIZERS[settings.age](*(
        (global_sequences, sampled_sequences) if settings.aggregation == "seq_mean_token_mean"
        else (global_tokens, sampled_tokens)))
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    real = len(chunks)
    if steps_needed > real and not ddp:  # DDP needs no matching calls: its reduction is the explicit one below
        chunks += [(*placeholder_chunk(policy, attempts, device), None)] * (steps_needed - real)
    total_loss, logp_sum, token_count = 0.0, 0.0, 0
    gap_sum, gap_max, gap_count = 0.0, 0.0, 0  # the on-policy check (sampler_check)
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
                if index >= real:  # placeholder: every parameter takes part, with a zero gradient
                    loss = torch.where(mask, logps, torch.zeros_like(logps)).sum() * 0.0
                else:
                    loss, info = policy_loss(logps, mask, adv.to(device), aggregation=settings.aggregation,
                                             normalizer=normalizer)
                    total_loss += float(loss.detach())
                    logp_sum += info["logp_mean"] * info["num_tokens"]
                    token_count += int(info["num_tokens"])
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
        return {"loss": float(totals[0]), "grad_norm": grad_norm, "skipped": 1.0, "nonfinite": 1.0}
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
    return result


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
    reward function calls that raised) is summed over processes."""
    # one row per attempt: completions, finite rewards, their sum and sum of squares, completion tokens,
    # reward errors, each component's sum over the finite rewards; plus a row for this process's errors
    rows = [torch.zeros(6 + len(reward_names), dtype=torch.float64)]
    rows[0][5] = reward_errors
    for attempt in collected.attempts:
        lengths = attempt.rollout.completion_mask.sum(dim=1).float() if attempt.rollout else torch.zeros(0)
        r = attempt.rewards.flatten()
        finite = torch.isfinite(r)
        rows.append(torch.stack([
            torch.tensor(float(r.numel())), finite.sum().float(), r[finite].sum(), (r[finite] ** 2).sum(),
            lengths.sum(), torch.tensor(0.0),
            *[attempt.components[n].flatten()[finite].sum() for n in reward_names]]).double())
    totals = accelerator.reduce(torch.stack(rows).sum(0).to(accelerator.device), "sum").cpu().tolist()
    completions, scored, total, squares, tokens, errors = totals[:6]
    mean = total / max(scored, 1.0)
    metrics = {"reward_mean": mean, "reward_std": math.sqrt(max(squares / max(scored, 1.0) - mean * mean, 0.0))}
    metrics.update({f"reward/{n}": totals[6 + i] / max(scored, 1.0) for i, n in enumerate(reward_names)})
    metrics["completion_tokens_mean"] = tokens / max(completions, 1.0)
    metrics["rewards_nonfinite"] = int(completions - scored)
    metrics["reward_errors"] = int(errors)
    return metrics


# ---------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------
def train(policy: Policy, task, *, trainer: TrainerSettings, rollout: RolloutSettings, evaluation: EvalSettings,
          output_dir: str | Path, seed: int = 0, resume_from: str | Path | None = None,
          accelerator: Accelerator | None = None, config: dict | None = None, max_bad_fraction: float = 0.05) -> dict:
    """Train `policy` on `task` with GPG; returns the run summary (also written to summary.json).

    `resume_from` is a complete checkpoint (see gpg_vl/checkpoint.py): training continues from its step with
    its optimizer, scheduler, RNG states and data position, and metrics.jsonl loses any lines past that step.
    Bad rows are skipped and counted; more than `max_bad_fraction` of the rows seen stops the run.
    """
    accelerator = accelerator or Accelerator(
        log_with=None if trainer.report_to == "none" else trainer.report_to, project_dir=str(output_dir))
    output_dir = Path(output_dir)
    main = accelerator.is_main_process
    if main:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.json").write_text(json.dumps(config or {}, indent=2, default=str))
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
    if trainer.gradient_checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.x name
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=trainer.lr,
                                  weight_decay=trainer.weight_decay)
    scheduler = get_scheduler(trainer.lr_schedule, optimizer, num_warmup_steps=trainer.warmup_steps,
                              num_training_steps=trainer.max_steps)
    _check_engine(accelerator)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    policy = replace(policy, model=accelerator.unwrap_model(model))
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
            summary.update({"stopped": message, "data": stream.bad.summary(), **counters})
            (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
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
                "completions_sampled": 0}  # saved in checkpoints: a resumed run continues them
    if resume_from is not None:
        start_step = load_trainer_state(Path(resume_from), optimizer, scheduler, stream,
                                        accelerator=accelerator, model=model, counters=counters)
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
                   "gather": gather_object, "engine": engine}
    summary: dict = {"task": task.name, "model": policy.name_or_path, "output_dir": str(output_dir)}
    if eval_data is not None:
        summary["eval_data"] = eval_data.summary()
    if trainer.eval_before and start_step == 0:
        before, _ = evaluate(policy, task, eval_rows, **eval_kwargs)
        summary["accuracy_before"] = before.get("accuracy")
        summary["eval_before"] = before
        accelerator.print(f"held-out before training: {_format(before)}")

    history: list[dict] = []
    bar = tqdm(total=trainer.max_steps, initial=start_step, disable=not main, desc="GPG", dynamic_ncols=True)
    reward_names = list(task.reward_functions)
    step = start_step
    for step in range(start_step + 1, trainer.max_steps + 1):
        started = time.perf_counter()
        errors_before = sum(getattr(task, "reward_errors", {}).values())
        # sample + score + advantage, resampling until enough groups carry signal
        collected = collect_valid_groups(
            lambda: sample_attempt(policy, task, stream, batch_size=trainer.batch_size,
                                   group_size=trainer.group_size, rollout=rollout,
                                   std_normalize=trainer.std_normalize, warn=warn, baseline=trainer.baseline,
                                   engine=engine),
            lambda attempt: _global_counts(attempt, accelerator),
            beta_th=trainer.beta_th, batch_size=trainer.batch_size,
            max_attempts=_attempts_allowed(trainer, counters["completions_sampled"]))
        rolled = time.perf_counter()
        counters["completions_sampled"] += collected.groups_sampled * trainer.group_size  # resampling included
        # loss + step, on valid groups only
        if collected.groups_valid > 0:
            result = update(policy, model, optimizer, scheduler, accelerator, collected.attempts,
                            settings=trainer, temperature=rollout.temperature, path=path,
                            sampler_check=engine.returns_logps, tis_cap=rollout.vllm.tis_cap)
            if not result.get("skipped"):
                engine.sync(model)  # an engine with its own weights takes the stepped ones (HF: nothing to do)
            if result.get("logp_mismatch_mean", 0.0) > rollout.vllm.max_logp_mismatch:
                warn(f"the sampler's log-probs differ from the trainer's by {result['logp_mismatch_mean']:.4f} "
                     f"per token on average, over rollout.vllm.max_logp_mismatch={rollout.vllm.max_logp_mismatch}: "
                     "the rollout is off-policy; check the weight sync and dtype, or set rollout.vllm.tis_cap=2.")
        else:
            result = {"loss": 0.0, "grad_norm": 0.0, "skipped": 1.0}
            warn("a step had no group with differing rewards after trainer.max_attempts rollouts; "
                 "it was skipped (check the task's rewards, or raise rollout.temperature).")
        updated = time.perf_counter()
        # a NaN or infinite loss or gradient: update() took no optimizer step; too many in a row stop the run
        bad_step = bool(result.get("nonfinite"))
        counters["nonfinite_steps"] += bad_step
        counters["bad_steps_in_a_row"] = counters["bad_steps_in_a_row"] + 1 if bad_step else 0
        if bad_step:
            accelerator.print(f"warning: step {step}: the loss or gradient is NaN or infinite (loss={result['loss']}, "
                              f"grad_norm={result['grad_norm']}); the step was skipped, no weight changed "
                              f"({counters['bad_steps_in_a_row']} in a row, trainer.max_bad_steps="
                              f"{trainer.max_bad_steps}).")
        # log
        errors = sum(getattr(task, "reward_errors", {}).values()) - errors_before
        metrics = {"step": step, **step_metrics(collected, accelerator, reward_names, reward_errors=errors),
                   "valid_fraction": collected.valid_fractions[0], "valid_fractions": collected.valid_fractions,
                   "attempts": len(collected.attempts), "groups_sampled": collected.groups_sampled,
                   "groups_used": collected.groups_valid,
                   "alpha": loss_alpha(trainer.age, collected.groups_sampled, collected.groups_valid),
                   "completions_sampled": counters["completions_sampled"],
                   **result, "lr": scheduler.get_last_lr()[0], "nonfinite_steps": counters["nonfinite_steps"],
                   **stream.bad.metrics(), "data_epoch": stream.epoch, "data_position": stream.position,
                   "rollout_s": rolled - started, "update_s": updated - rolled,
                   "step_s": time.perf_counter() - started}
        counters["reward_errors"] += metrics["reward_errors"]
        counters["rewards_nonfinite"] += metrics["rewards_nonfinite"]
        if metrics["rewards_nonfinite"]:
            names = sorted(getattr(task, "reward_nonfinite", {})) or ["on another process"]
            warn(f"some completions got a NaN or infinite reward (reward {', '.join(names)}); their groups are left "
                 "out of the update and counted per step as rewards_nonfinite in metrics.jsonl.")
        history.append(metrics)
        if main:
            with metrics_file.open("a") as handle:
                handle.write(json.dumps(metrics) + "\n")
            bar.set_postfix(reward=f"{metrics['reward_mean']:.2f}", valid=f"{metrics['valid_fraction']:.2f}",
                            alpha=f"{metrics['alpha']:.2f}")
            bar.update(1)
        if trainer.report_to != "none":
            accelerator.log({k: v for k, v in metrics.items() if not isinstance(v, list)}, step=step)
        if trainer.max_bad_steps and counters["bad_steps_in_a_row"] >= trainer.max_bad_steps:
            last = latest_checkpoint(output_dir) if main else None
            stop(f"stopped at step {step}: the last {counters['bad_steps_in_a_row']} steps had a NaN or infinite loss "
                 f"or gradient (trainer.max_bad_steps={trainer.max_bad_steps}) and changed no weight; the last good "
                 f"checkpoint, {last or 'none (none was written)'}, is intact: lower trainer.lr, check the task's "
                 "rewards and data, then continue with resume=auto.")
        # save (never while steps are failing, so the last good checkpoint is not rotated away)
        if trainer.save_every and step % trainer.save_every == 0:
            if counters["bad_steps_in_a_row"] or not _finite_weights(model, accelerator):
                warn(f"step {step}: no checkpoint written: the weights or the last step are not finite.")
            else:
                save_checkpoint(output_dir / f"checkpoint-{step}", policy, model, optimizer, scheduler, stream, step,
                                accelerator, keep=trainer.keep_checkpoints, counters=counters)
        if trainer.max_completions and counters["completions_sampled"] >= trainer.max_completions:
            break  # a budget of sampled completions: equal-cost comparisons of G and variants
    bar.close()

    save_checkpoint(output_dir / "final", policy, model, optimizer, scheduler, stream, step, accelerator,
                    counters=counters)
    if stream.bad.bad:
        accelerator.print(stream.bad.report("training rows"))
    if trainer.eval_after:
        after, _ = evaluate(policy, task, eval_rows, **eval_kwargs)
        summary["accuracy_after"] = after.get("accuracy")
        summary["eval_after"] = after
        accelerator.print(f"held-out after training:  {_format(after)}")
    summary["steps"] = step
    summary["train_seconds"] = sum(m["step_s"] for m in history)
    summary["data"] = stream.bad.summary()
    summary.update({key: value for key, value in counters.items() if key != "bad_steps_in_a_row"})
    if main:
        (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        if history:
            write_curves(output_dir / "metrics.jsonl", output_dir / "curves.png")
    if trainer.report_to != "none":
        accelerator.end_training()
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
