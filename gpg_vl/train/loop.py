"""The training loop, on accelerate. Read `train` top to bottom: setup -> (sample -> score -> advantage ->
loss -> optimizer steps -> log -> save) per step -> finish. GPG by default; the GRPO family by trainer.loss.
Sampling and threshold resampling are in sample.py, the update (micro-batches, optimizer steps, the
reference) in update.py.

Nothing here assumes one process: prompts of a step are split across processes, every count that
drives a decision (valid groups, resampling, the loss normaliser) is all-reduced, and checkpoints are
written by the main process only.
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, gather_object
from tqdm.auto import tqdm
from transformers import get_scheduler

from gpg_vl.config.schema import EvalSettings, RolloutSettings, TrainerSettings
from gpg_vl.data.stream import PromptStream, Subset, scan_rows
from gpg_vl.errors import UserError
from gpg_vl.models.family import ScoringPath, choose_scoring_path
from gpg_vl.models.load import Policy
from gpg_vl.objective import loss_alpha
from gpg_vl.observe.report import write_curves
from gpg_vl.observe.rollout_log import log_rollouts
from gpg_vl.reward.pool import RewardBudget
from gpg_vl.rollout.engine import build_engine
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
from gpg_vl.train.sample import Attempt, attempts_allowed, collect_valid_groups, global_counts, sample_attempt
from gpg_vl.train.update import Reference, build_optimizer, build_reference, place_reference, update


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
        lambda attempt: global_counts(attempt, accelerator),
        beta_th=trainer.beta_th, batch_size=trainer.batch_size,
        max_attempts=attempts_allowed(trainer, run.counters["completions_sampled"]))
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


def _format(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k}={v:.3f}" for k, v in metrics.items() if isinstance(v, float))

