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
import random
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from tqdm.auto import tqdm
from transformers import get_scheduler

from gpg_vl.data import PromptStream
from gpg_vl.evaluate import evaluate
from gpg_vl.models.base import Policy, PromptBatch
from gpg_vl.models.lora import save_model
from gpg_vl.objective import ADVANTAGE_ESTIMATORS, LOSS_NORMALIZERS, estimator_name, loss_alpha, policy_loss
from gpg_vl.report import write_curves
from gpg_vl.rollout import Rollout, generate, in_task_frame
from gpg_vl.sampler import collect_valid_groups


@dataclass
class TrainerSettings:
    """`trainer.*` config keys (see configs/train.yaml for each one's meaning)."""

    max_steps: int = 100
    epochs: float | None = None
    group_size: int = 8
    batch_size: int = 8
    micro_batch_size: int = 16
    lr: float = 1e-6
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    beta_th: float = 0.4
    max_attempts: int = 8
    std_normalize: bool = False
    baseline: str = "group_mean"
    age: bool = True
    max_completions: int | None = None
    aggregation: str = "seq_mean_token_mean"
    gradient_checkpointing: bool = False
    share_vision: bool = True
    save_every: int = 0
    keep_checkpoints: int = 2
    report_to: str = "none"
    eval_before: bool = True
    eval_after: bool = True

    def __post_init__(self) -> None:
        estimator_name(self.baseline, self.std_normalize)  # an unknown variant fails before any work


@dataclass
class RolloutSettings:
    """`rollout.*` config keys."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    ignore_eos: bool = False
    max_prompt_tokens: int = 4096


@dataclass
class EvalSettings:
    """`eval.*` config keys used during training."""

    split: str | None = None
    limit: int | None = None
    batch_size: int = 32
    max_new_tokens: int | None = None


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
                   rollout: RolloutSettings, std_normalize: bool, warn, baseline: str = "group_mean") -> Attempt:
    """Draw this process's share of `batch_size` prompts, roll out G completions each, score them."""
    drawn = stream.next_local(batch_size)
    rows = [row for _, row in drawn]
    prompts = policy.adapter.encode([task.messages(r) for r in rows], ids=[str(r.get("id", i)) for i, r in drawn])
    lengths = prompts.inputs["attention_mask"].sum(dim=1).tolist()
    keep = [i for i, n in enumerate(lengths) if n <= rollout.max_prompt_tokens]
    for i in sorted(set(range(len(rows))) - set(keep)):
        warn(f"skipped prompt {prompts.ids[i]!r}: it has {lengths[i]} tokens, over rollout.max_prompt_tokens="
             f"{rollout.max_prompt_tokens}; prompts with images are never truncated, so raise the limit or "
             "lower model.max_pixels.")
    if len(keep) < len(rows):
        rows, prompts = [rows[i] for i in keep], prompts.select(keep) if keep else None
    names = list(task.reward_functions)
    if not rows:
        empty = torch.zeros(0, group_size)
        return Attempt([], None, None, empty, {n: empty for n in names}, empty, torch.zeros(0, dtype=torch.bool))
    result = generate(policy, prompts, group_size=group_size, max_new_tokens=rollout.max_new_tokens,
                      temperature=rollout.temperature, top_p=rollout.top_p, ignore_eos=rollout.ignore_eos)
    texts = in_task_frame(policy, task, result.texts, prompts, group_size)
    scores = [task.reward_components(text, rows[i // group_size]) for i, text in enumerate(texts)]
    components = {n: torch.tensor([s[n] for s in scores]).view(len(rows), group_size) for n in names}  # [b, G]
    rewards = torch.tensor([task.total(s) for s in scores]).view(len(rows), group_size)  # [b, G]
    advantages, valid = ADVANTAGE_ESTIMATORS[estimator_name(baseline, std_normalize)](rewards)  # [b, G], [b]
    return Attempt(rows, prompts, result, rewards, components, advantages, valid)


def update_chunks(attempts: list[Attempt], micro_batch_size: int):
    """Sequences of valid groups only, as micro-batches (prompts, ids [n, C], mask [n, C], adv [n])."""
    for attempt in attempts:
        group_size = attempt.rollout.group_size if attempt.rollout else 1
        sequences = [b * group_size + g for b in attempt.valid.nonzero().flatten().tolist()
                     for g in range(group_size)]
        for start in range(0, len(sequences), micro_batch_size):
            chosen = sequences[start:start + micro_batch_size]
            mask = attempt.rollout.completion_mask[chosen]  # [n, C]
            width = max(int(mask.sum(dim=1).max()), 1)
            yield (attempt.prompts, [s // group_size for s in chosen],
                   attempt.rollout.completion_ids[chosen, :width], mask[:, :width],
                   attempt.advantages.flatten()[chosen])


# ---------------------------------------------------------------------------------------------
# loss + step
# ---------------------------------------------------------------------------------------------
def update(policy: Policy, model, optimizer, scheduler, accelerator: Accelerator, attempts: list[Attempt], *,
           settings: TrainerSettings, temperature: float) -> dict[str, float]:
    """One optimizer step on the valid groups' sequences; the loss is their global mean (AGE), or with
    `settings.age=False` their sum over the count of every sampled sequence of the attempts (alpha = 1).

    The normaliser is the count over ALL processes (sequences, or tokens for `token_mean`), and each
    process's loss is multiplied by the number of processes because DDP averages gradients: the
    update's gradient is then the mean over every valid sequence of every process.
    """
    device = accelerator.device
    chunks = list(update_chunks(attempts, settings.micro_batch_size))
    sampled = [a.rollout.completion_mask for a in attempts if a.rollout is not None]  # [b * G, C] each
    local = torch.tensor([sum(len(c[4]) for c in chunks), sum(int(c[3].sum()) for c in chunks),
                          sum(len(m) for m in sampled), sum(int(m.sum()) for m in sampled)], device=device)
    global_sequences, global_tokens, sampled_sequences, sampled_tokens = (
        int(x) for x in accelerator.reduce(local, "sum"))
    steps_needed = int(accelerator.reduce(torch.tensor(len(chunks), device=device), "max"))
    if global_sequences == 0:
        return {"loss": 0.0, "grad_norm": 0.0, "skipped": 1.0}
    counts = ((global_sequences, sampled_sequences) if settings.aggregation == "seq_mean_token_mean"
              else (global_tokens, sampled_tokens))
    normalizer = LOSS_NORMALIZERS[settings.age](*counts)
    chunks += [None] * (steps_needed - len(chunks))  # every process runs as many backward() calls
    total_loss, logp_sum, token_count = 0.0, 0.0, 0
    for index, chunk in enumerate(chunks):
        sync = index == len(chunks) - 1
        with contextlib.nullcontext() if sync else accelerator.no_sync(model):
            if chunk is None:  # a process without valid sequences still joins the gradient all-reduce
                loss = sum(p.sum() for p in model.parameters() if p.requires_grad) * 0.0
            else:
                prompts, prompt_index, ids, mask, adv = chunk
                mask = mask.to(device)
                logps = policy.adapter.token_logps(model, prompts.to(device), prompt_index, ids.to(device), mask,
                                                   temperature=temperature,
                                                   share_vision=settings.share_vision)  # [n, C]
                loss, info = policy_loss(logps, mask, adv.to(device), aggregation=settings.aggregation,
                                         normalizer=normalizer)
                total_loss += float(loss.detach())
                logp_sum += info["logp_mean"] * info["num_tokens"]
                token_count += int(info["num_tokens"])
            accelerator.backward(loss * accelerator.num_processes)
    grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), settings.max_grad_norm))
    if not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        return {"loss": total_loss, "grad_norm": grad_norm, "skipped": 1.0}
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    totals = accelerator.reduce(torch.tensor([total_loss, logp_sum, token_count], device=device,
                                             dtype=torch.float64), "sum")
    return {"loss": float(totals[0]), "grad_norm": grad_norm, "skipped": 0.0,
            "logp_mean": float(totals[1] / max(float(totals[2]), 1.0))}


# ---------------------------------------------------------------------------------------------
# log + save
# ---------------------------------------------------------------------------------------------
def step_metrics(collected, accelerator: Accelerator, reward_names: list[str]) -> dict[str, float]:
    """Global reward statistics over every completion sampled in this step."""
    stats = []
    for attempt in collected.attempts:
        lengths = attempt.rollout.completion_mask.sum(dim=1).float() if attempt.rollout else torch.zeros(0)
        r = attempt.rewards.flatten()
        stats.append(torch.stack([
            torch.tensor(float(r.numel())), r.sum(), (r * r).sum(), lengths.sum(),
            *[attempt.components[n].sum() for n in reward_names]]).double())
    totals = accelerator.reduce(torch.stack(stats).sum(0).to(accelerator.device), "sum").cpu()
    count = max(float(totals[0]), 1.0)
    mean = float(totals[1]) / count
    metrics = {"reward_mean": mean, "reward_std": math.sqrt(max(float(totals[2]) / count - mean * mean, 0.0))}
    metrics.update({f"reward/{n}": float(totals[4 + i]) / count for i, n in enumerate(reward_names)})
    metrics["completion_tokens_mean"] = float(totals[3]) / count
    return metrics


def save_checkpoint(path: Path, policy: Policy, model, optimizer, scheduler, stream: PromptStream, step: int,
                    accelerator: Accelerator, *, keep: int = 0) -> None:
    """Hugging Face model + processor, and the trainer state; written to a temp folder, then renamed."""
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        partial = path.with_name(path.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        save_model(accelerator.unwrap_model(model), partial, policy.save_format)
        policy.processor.save_pretrained(partial)
        torch.save({
            "step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "data": stream.state_dict(), "rng": {
                "python": random.getstate(), "numpy": np.random.get_state(),
                "torch": torch.get_rng_state()}}, partial / "trainer_state.pt")
        if path.exists():
            shutil.rmtree(path)
        partial.rename(path)
        if keep > 0:
            old = sorted(path.parent.glob("checkpoint-*[0-9]"), key=lambda p: int(p.name.split("-")[1]))
            for stale in old[:-keep]:
                shutil.rmtree(stale, ignore_errors=True)
    accelerator.wait_for_everyone()


def load_trainer_state(path: Path, optimizer, scheduler, stream: PromptStream) -> int:
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    stream.load_state_dict(state["data"])
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    torch.set_rng_state(state["rng"]["torch"])
    return int(state["step"])


# ---------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------
def train(policy: Policy, task, *, trainer: TrainerSettings, rollout: RolloutSettings, evaluation: EvalSettings,
          output_dir: str | Path, seed: int = 0, resume_from: str | Path | None = None,
          accelerator: Accelerator | None = None, config: dict | None = None) -> dict:
    """Train `policy` on `task` with GPG; returns the run summary (also written to summary.json)."""
    accelerator = accelerator or Accelerator(
        log_with=None if trainer.report_to == "none" else trainer.report_to, project_dir=str(output_dir))
    output_dir = Path(output_dir)
    main = accelerator.is_main_process
    if main:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.json").write_text(json.dumps(config or {}, indent=2, default=str))
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)

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
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    policy = replace(policy, model=accelerator.unwrap_model(model))
    if trainer.report_to != "none":
        accelerator.init_trackers("gpg-vl", config=_flat_scalars(config or {}))

    stream = PromptStream(train_rows, seed=seed, rank=accelerator.process_index,
                          world_size=accelerator.num_processes)
    start_step = 0
    if resume_from is not None:
        start_step = load_trainer_state(Path(resume_from), optimizer, scheduler, stream)

    eval_rows = task.load(evaluation.split or task.eval_split)
    eval_rows = eval_rows[:evaluation.limit] if evaluation.limit else eval_rows
    eval_kwargs = {"batch_size": evaluation.batch_size,
                   "max_new_tokens": evaluation.max_new_tokens or rollout.max_new_tokens,
                   "rank": accelerator.process_index, "world_size": accelerator.num_processes,
                   "gather": _gather_object}
    summary: dict = {"task": task.name, "model": policy.name_or_path, "output_dir": str(output_dir)}
    if trainer.eval_before and start_step == 0:
        before, _ = evaluate(policy, task, eval_rows, **eval_kwargs)
        summary["accuracy_before"] = before.get("accuracy")
        summary["eval_before"] = before
        accelerator.print(f"held-out before training: {_format(before)}")

    warned: set[str] = set()

    def warn(message: str) -> None:
        if message not in warned:
            warned.add(message)
            accelerator.print(f"warning: {message}")

    history: list[dict] = []
    metrics_file = output_dir / "metrics.jsonl"
    bar = tqdm(total=trainer.max_steps, initial=start_step, disable=not main, desc="GPG", dynamic_ncols=True)
    reward_names = list(task.reward_functions)
    step, completions_sampled = start_step, 0  # completions sampled by this run, resampling included
    for step in range(start_step + 1, trainer.max_steps + 1):
        started = time.perf_counter()
        # sample + score + advantage, resampling until enough groups carry signal
        collected = collect_valid_groups(
            lambda: sample_attempt(policy, task, stream, batch_size=trainer.batch_size,
                                   group_size=trainer.group_size, rollout=rollout,
                                   std_normalize=trainer.std_normalize, warn=warn, baseline=trainer.baseline),
            lambda attempt: _global_counts(attempt, accelerator),
            beta_th=trainer.beta_th, batch_size=trainer.batch_size,
            max_attempts=_attempts_allowed(trainer, completions_sampled))
        rolled = time.perf_counter()
        completions_sampled += collected.groups_sampled * trainer.group_size
        # loss + step, on valid groups only
        if collected.groups_valid > 0:
            result = update(policy, model, optimizer, scheduler, accelerator, collected.attempts,
                            settings=trainer, temperature=rollout.temperature)
        else:
            result = {"loss": 0.0, "grad_norm": 0.0, "skipped": 1.0}
            warn("a step had no group with differing rewards after trainer.max_attempts rollouts; "
                 "it was skipped (check the task's rewards, or raise rollout.temperature).")
        updated = time.perf_counter()
        # log
        metrics = {"step": step, **step_metrics(collected, accelerator, reward_names),
                   "valid_fraction": collected.valid_fractions[0], "valid_fractions": collected.valid_fractions,
                   "attempts": len(collected.attempts), "groups_sampled": collected.groups_sampled,
                   "groups_used": collected.groups_valid,
                   "alpha": loss_alpha(trainer.age, collected.groups_sampled, collected.groups_valid),
                   "completions_sampled": completions_sampled,
                   **result, "lr": scheduler.get_last_lr()[0],
                   "rollout_s": rolled - started, "update_s": updated - rolled,
                   "step_s": time.perf_counter() - started}
        history.append(metrics)
        if main:
            with metrics_file.open("a") as handle:
                handle.write(json.dumps(metrics) + "\n")
            bar.set_postfix(reward=f"{metrics['reward_mean']:.2f}", valid=f"{metrics['valid_fraction']:.2f}",
                            alpha=f"{metrics['alpha']:.2f}")
            bar.update(1)
        if trainer.report_to != "none":
            accelerator.log({k: v for k, v in metrics.items() if not isinstance(v, list)}, step=step)
        # save
        if trainer.save_every and step % trainer.save_every == 0:
            save_checkpoint(output_dir / f"checkpoint-{step}", policy, model, optimizer, scheduler, stream, step,
                            accelerator, keep=trainer.keep_checkpoints)
        if trainer.max_completions and completions_sampled >= trainer.max_completions:
            break  # a budget of sampled completions: equal-cost comparisons of G and variants
    bar.close()

    save_checkpoint(output_dir / "final", policy, model, optimizer, scheduler, stream, step, accelerator)
    if trainer.eval_after:
        after, _ = evaluate(policy, task, eval_rows, **eval_kwargs)
        summary["accuracy_after"] = after.get("accuracy")
        summary["eval_after"] = after
        accelerator.print(f"held-out after training:  {_format(after)}")
    summary["steps"] = step
    summary["completions_sampled"] = completions_sampled
    summary["train_seconds"] = sum(m["step_s"] for m in history)
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


def _attempts_allowed(trainer: TrainerSettings, completions_sampled: int) -> int:
    """trainer.max_attempts, fewer when resampling would sample past trainer.max_completions (never < 1)."""
    if not trainer.max_completions:
        return trainer.max_attempts
    left = math.ceil((trainer.max_completions - completions_sampled) / (trainer.batch_size * trainer.group_size))
    return max(1, min(trainer.max_attempts, left))


def _global_counts(attempt: Attempt, accelerator: Accelerator) -> tuple[int, int]:
    counts = accelerator.reduce(torch.tensor([attempt.valid.numel(), int(attempt.valid.sum())],
                                             device=accelerator.device), "sum")
    return int(counts[0]), int(counts[1])


def _gather_object(items: list) -> list:
    from accelerate.utils import gather_object

    return gather_object(items)


def _format(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k}={v:.3f}" for k, v in metrics.items() if isinstance(v, float))
