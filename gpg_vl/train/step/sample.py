"""Sampling: one attempt (draw B prompts, roll out G completions each, score, advantage), and threshold
resampling (AGE's companion): collect enough groups that carry a learning signal.

A step wants B groups (B = prompts per step, over all processes). Roll out B prompts and score them.
If the valid fraction (groups whose rewards are not all equal) is at least `beta_th`, update on the
valid groups. Otherwise keep the valid groups, roll out B fresh prompts from the same stream, and
accumulate until at least `beta_th * B` valid groups are collected or `max_attempts` rollouts were
made; then update on every accumulated valid group. All of them were sampled from the current
weights, so the update stays on-policy.

This deliberately differs from the paper's released code, which pads the update batch with invalid
groups and drops surplus valid groups that it had already counted in alpha. Here every collected
valid group is used, none is dropped, and the loss is the mean over the sequences of valid groups,
which is exactly alpha = B / (B - M) applied to the mean over all sampled groups.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Generic, TypeVar

import torch
from accelerate import Accelerator

from gpg_vl.config.schema import RolloutSettings, TrainerSettings
from gpg_vl.data.stream import PromptStream
from gpg_vl.distributed import collective_group, forward_is_collective, require_images
from gpg_vl.errors import UserError
from gpg_vl.models.batch import PromptBatch
from gpg_vl.models.load import Policy
from gpg_vl.objective import get_advantage, overlong_penalty
from gpg_vl.reward.pool import RewardBudget, score_completions
from gpg_vl.rollout.engine import EnginePrompts, EngineUnreachable, Sampling, encode_prompts, sampling_generator
from gpg_vl.rollout.types import Rollout, in_task_frame
from gpg_vl.train.step.placeholder import placeholder_prompts

A = TypeVar("A")


@dataclass
class Collected(Generic[A]):
    """The attempts of one step and their global counts."""

    attempts: list[A] = field(default_factory=list)
    groups_sampled: int = 0  # global, over all attempts
    groups_valid: int = 0  # global, over all attempts
    valid_fractions: list[float] = field(default_factory=list)  # one per attempt, global
    tokens_sampled: int = 0  # global, over all attempts: the tokens the policy sampled (Rollout.sampled_tokens)


def collect_valid_groups(
    sample_attempt: Callable[[], A],
    count_valid: Callable[[A], tuple[int, int, int]],
    *,
    beta_th: float,
    batch_size: int,
    max_attempts: int,
    tokens_left: int | None = None,
) -> Collected[A]:
    """Run attempts until `groups_valid >= beta_th * batch_size` or `max_attempts` is reached, or (`tokens_left`:
    what is left of trainer.max_sampled_tokens) once the attempts made have sampled that many tokens: the next
    rollout's size is unknown, so no attempt starts after the budget is spent (the first always runs).

    `sample_attempt()` draws, rolls out and scores this process's share of B fresh prompts.
    `count_valid(attempt)` returns the GLOBAL (groups, valid groups, sampled tokens) of that attempt (one
    all-reduce), so every process takes the same decision and the loop never desynchronises collectives.
    """
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
    collected: Collected[A] = Collected()
    for _ in range(max_attempts):
        attempt = sample_attempt()  # one attempt, or a mixture's: one per task (sample_mixed_attempt)
        groups, valid, tokens = count_valid(attempt)
        collected.attempts.extend(attempt if isinstance(attempt, list) else [attempt])
        collected.groups_sampled += groups
        collected.groups_valid += valid
        collected.tokens_sampled += tokens
        collected.valid_fractions.append(valid / groups if groups else 0.0)
        if collected.groups_valid >= beta_th * batch_size:
            break
        if tokens_left is not None and collected.tokens_sampled >= tokens_left:
            break  # the token budget is spent: no further resampling
    return collected


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
    tokens_sampled: int = 0  # this process's sampled tokens: its rollout's and T-GRPO's shuffled rollouts'
    reward_errors: int = 0  # reward function calls that raised on its completions (T-GRPO's shuffled ones too)
    judged: int = 0  # completions whose scoring asked the run's judge (gpg_vl/reward/judge.py)
    judge_missing: int = 0  # of those, the ones the judge gave no score (NaN: their groups are invalid)
    lost: str | None = None  # the engine could not be reached (its sentence): every process stops at the count
    indices: list[int] = field(default_factory=list)  # each group's row in its task's train split
    task: str | None = None  # its task in a mixture (gpg_vl/data/mixture.py), else None
    messages: list[list[dict]] | None = None  # each prompt's messages (its images and videos), as the engine got them


def empty_attempt(names: list[str], group_size: int, lost: str | None = None) -> Attempt:
    """An attempt without prompts (all skipped here, or the engine lost: `lost`)."""
    empty = torch.zeros(0, group_size)
    return Attempt([], None, None, empty, {n: empty for n in names}, empty, torch.zeros(0, dtype=torch.bool),
                   lost=lost)


def sample_attempt(policy: Policy, task, stream: PromptStream, *, engine, trainer: TrainerSettings,
                   rollout: RolloutSettings, warn, reward_budget: RewardBudget | None = None) -> Attempt:
    """Draw this process's share of trainer.batch_size prompts, roll out trainer.group_size completions each
    through `engine` (`build_engine`'s, rollout.engine's), score them (on trainer.reward_workers threads, within
    what is left of the step's `reward_budget`).

    trainer.advantage names the estimator; with trainer.overlong_cache > 0 the reward gets DAPO's overlong
    component "overlong" (0 down to -trainer.overlong_penalty over the last overlong_cache tokens)."""
    drawn = stream.next_prompts(trainer.batch_size, task)  # good rows only: a bad one is skipped, counted, replaced
    return rollout_prompts(policy, task, drawn, engine=engine, trainer=trainer, rollout=rollout, warn=warn,
                           world_size=stream.world_size, reward_budget=reward_budget)


def sample_mixed_attempt(policy: Policy, mixture, stream, *, engines: dict, rollouts: dict, trainer: TrainerSettings,
                         warn, reward_budget: RewardBudget | None = None) -> list[Attempt]:
    """A mixture's attempt: this process's share of trainer.batch_size prompts drawn by task weight
    (gpg_vl/data/mixture.py's MixtureStream), each task's prompts rolled out and scored as that task's own attempt,
    with its engine and rollout settings (`engines`, `rollouts`: name -> ...), in the mixture's order (every
    process makes the same calls, a task without prompts here an empty one)."""
    drawn = stream.next_prompts(trainer.batch_size, mixture)
    attempts = []
    for name, task in mixture.tasks.items():
        mine = [p for p in drawn if p.task == name]
        attempt = rollout_prompts(policy, task, mine, engine=engines[name], trainer=trainer, rollout=rollouts[name],
                                  warn=warn, world_size=stream.world_size, reward_budget=reward_budget)
        zero = torch.zeros_like(attempt.rewards)  # [b, G]: a component another task has counts 0 in the totals
        components = {n: attempt.components.get(n, zero) for n in reward_names(mixture, trainer)}
        attempts.append(replace(attempt, task=name, components={**components, **attempt.components}))
    return attempts


def rollout_prompts(policy: Policy, task, drawn: list, *, engine, trainer: TrainerSettings, rollout: RolloutSettings,
                    warn, world_size: int = 1, reward_budget: RewardBudget | None = None) -> Attempt:
    """`sample_attempt` on prompts already drawn (`drawn`: data/stream.py's Prompt)."""
    group_size, overlong_cache = trainer.group_size, trainer.overlong_cache
    names = reward_names(task, trainer)
    if not drawn:  # a mixture's task with no prompt on this process in this attempt
        if forward_is_collective(policy.model):
            engine.generate(EnginePrompts(placeholder_prompts(policy)), group_size, Sampling.from_settings(rollout))
        return empty_attempt(names, group_size)
    rows = [p.row for p in drawn]
    prompts = encode_prompts(policy, [p.messages for p in drawn], ids=[str(p.row.get("id", p.index)) for p in drawn],
                             tools=engine.prompt_tools(task))
    lengths = prompts.batch.inputs["attention_mask"].sum(dim=1).tolist()
    keep = [i for i, n in enumerate(lengths) if n <= rollout.max_prompt_tokens]
    for i in sorted(set(range(len(rows))) - set(keep)):
        warn(f"skipped prompt {prompts.batch.ids[i]!r}: it has {lengths[i]} tokens, over rollout.max_prompt_tokens="
             f"{rollout.max_prompt_tokens}; prompts with images are never truncated, so raise the limit or "
             "lower model.max_pixels.")
    if len(keep) < len(rows):
        rows, prompts = [rows[i] for i in keep], prompts.select(keep) if keep else None
    if not rows:
        # Under FSDP / ZeRO-3 generation is collective (weights gathered per module, synced_gpus): a process
        # whose prompts were all skipped still makes this attempt's one generate call, on a placeholder whose
        # completions it drops (the same call evaluation makes for a process out of rows, which is tested).
        if forward_is_collective(policy.model):
            engine.generate(EnginePrompts(placeholder_prompts(policy)), group_size, Sampling.from_settings(rollout))
        return empty_attempt(names, group_size)
    # Raised by this process alone, before its next collective: the launcher (torchrun) then stops the others.
    require_images(prompts.batch.has_images, world_size, "a batch of training prompts")
    try:
        result = engine.generate(prompts, group_size, Sampling.from_settings(rollout))
    except EngineUnreachable as error:  # every process learns it at this attempt's count (global_counts)
        return empty_attempt(names, group_size, lost=str(error))
    if result.rejected:  # prompts the engine refused as too long for it: skipped, as over-long prompts are
        rows, prompts, keep, result = skip_rejected(result, rows, prompts, keep, warn)
        if not rows:
            return empty_attempt(names, group_size)
    messages, prompts = prompts.messages, prompts.batch
    texts = in_task_frame(policy, task, result.texts, prompts, group_size)
    try:
        scores, timeouts, errors, judged, judge_missing = score_completions(
            task, texts, [rows[i // group_size] for i in range(len(texts))], workers=trainer.reward_workers,
            budget=reward_budget, trajectories=result.trajectories)
    except EngineUnreachable as error:  # the judge is down: every process learns it at this attempt's count
        return empty_attempt(names, group_size, lost=str(error))
    components = {n: torch.tensor([s[n] for s in scores]).view(len(rows), group_size)
                  for n in task.reward_functions}  # [b, G]
    rewards = torch.tensor([task.total(s) for s in scores]).view(len(rows), group_size)  # [b, G]
    tokens = result.sampled_tokens()
    if getattr(task, "temporal", False):  # T-GRPO: a bonus from rollouts of the same videos with shuffled frames
        components["temporal"], shuffled_tokens, shuffled_errors = temporal_component(
            policy, task, engine, [drawn[i].messages for i in keep], rows, components["accuracy"], rollout,
            workers=trainer.reward_workers, budget=reward_budget)  # [b, G]
        errors += shuffled_errors
        rewards = rewards + components["temporal"]
        tokens += shuffled_tokens
    if overlong_cache:  # DAPO's overlong shaping: a reward component from the completion's length
        lengths, limit = overlong_lengths(result, rollout)  # [b * G]
        penalty = trainer.overlong_penalty * overlong_penalty(lengths, limit, overlong_cache)
        components["overlong"] = penalty.view(len(rows), group_size).to(rewards.dtype)  # [b, G]
        rewards = rewards + components["overlong"]
    advantages, valid = checked_advantages(trainer.advantage, rewards)  # [b, G], [b]
    valid = valid & torch.isfinite(rewards).all(dim=1)  # a NaN or infinite reward makes its group invalid
    return Attempt(rows, prompts, result, rewards, components, advantages, valid, reward_timeouts=timeouts,
                   tokens_sampled=tokens, reward_errors=errors, judged=judged, judge_missing=judge_missing,
                   indices=[drawn[i].index for i in keep], messages=messages)


def skip_rejected(result: Rollout, rows: list[dict], prompts: EnginePrompts, keep: list[int], warn):
    """Drop the prompts an engine refused (`Rollout.rejected`: too long for a vLLM server), each with a warning
    naming it, as an over-long prompt is skipped; returns (rows, prompts, keep, rollout) of the others."""
    for b in result.rejected:
        warn(f"skipped prompt {prompts.batch.ids[b] if prompts.batch.ids else b!r}: the rollout engine refused it "
             f"({result.rejected_reasons.get(b, 'too long')}); lower rollout.max_prompt_tokens to the server's "
             "--max-model-len minus rollout.max_new_tokens, or start the server with a longer one.")
    kept = [b for b in range(len(rows)) if b not in set(result.rejected)]
    if not kept:
        return [], None, [], None
    return [rows[b] for b in kept], prompts.select(kept), [keep[b] for b in kept], result.keep_prompts(kept)


def temporal_component(policy: Policy, task, engine, messages: list[list[dict]], rows: list[dict],
                       accuracy: torch.Tensor, rollout: RolloutSettings, *, workers: int,
                       budget: RewardBudget | None) -> tuple[torch.Tensor, int, int]:
    """T-GRPO's temporal reward (Video-R1) [b, G], the tokens its shuffled rollouts sampled (they count
    towards trainer.max_sampled_tokens) and the reward errors of scoring them: each video prompt
    (`task.shuffled_messages` gives its frames shuffled; None for a prompt without video) is also rolled out
    G / 2 times with its frames shuffled, those completions scored for accuracy only (never trained on), and
    `task.temporal_bonus(ordered, shuffled)` gives each of the G ordered completions its bonus from the two groups'
    accuracies `accuracy` [b, G]. Shuffles are drawn from torch's generator, which checkpoints hold: a resumed run
    draws the same."""
    group_size = accuracy.shape[1]
    generator = sampling_generator()  # the sampler's own (trainer.max_staleness >= 1), else torch's global one
    shuffled = [task.shuffled_messages(m, int(torch.randint(2**31 - 1, (), generator=generator))) for m in messages]
    videos = [b for b, m in enumerate(shuffled) if m is not None]
    bonus = torch.zeros_like(accuracy)  # [b, G]
    if not videos:
        return bonus, 0, 0
    half = max(1, group_size // 2)
    prompts = encode_prompts(policy, [shuffled[b] for b in videos], tools=engine.prompt_tools(task))
    result = engine.generate(prompts, half, Sampling.from_settings(rollout))
    texts = in_task_frame(policy, task, result.texts, prompts.batch, half)
    scores, _, errors, *_ = score_completions(task, texts, [rows[videos[i // half]] for i in range(len(texts))],
                                              workers=workers, budget=budget)
    shuffled_accuracy = torch.tensor([s["accuracy"] for s in scores]).view(len(videos), half)  # [v, G / 2]
    for i, b in enumerate(videos):
        bonus[b] = task.temporal_bonus(accuracy[b], shuffled_accuracy[i]).to(bonus.dtype)
    return bonus, result.sampled_tokens(), errors


def reward_names(task, trainer: TrainerSettings) -> list[str]:
    """The reward components of a step: the task's, T-GRPO's "temporal" (a task with `temporal` on) and DAPO's
    "overlong" (trainer.overlong_cache > 0)."""
    return list(task.reward_functions) + (["temporal"] if getattr(task, "temporal", False) else []) + \
        (["overlong"] if trainer.overlong_cache else [])


ADVANTAGE_CONTRACT = "it must map rewards [b, G] to (advantages [b, G], valid [b] bool)"


def checked_advantages(name: str, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """trainer.advantage=`name` on `rewards` [b, G], its contract checked here: (advantages [b, G] float, valid [b]
    bool). A raise, or anything else returned, fails in one sentence naming the setting and what came back."""
    estimator = get_advantage(name)
    try:
        result = estimator(rewards)
    except UserError:
        raise
    except Exception as error:  # a plugin's own failure, told in one sentence
        raise UserError(f"trainer.advantage={name} raised {type(error).__name__}: {error}; "
                        f"{ADVANTAGE_CONTRACT}.") from error
    if not (isinstance(result, tuple | list) and len(result) == 2):
        what = f"one tensor {_described(result)}" if isinstance(result, torch.Tensor) else \
            f"a {type(result).__name__}" + (f" of {len(result)}" if isinstance(result, tuple | list) else "")
        raise UserError(f"trainer.advantage={name} returned {what}; {ADVANTAGE_CONTRACT}.")
    advantages, valid = result
    problem = None
    if not isinstance(advantages, torch.Tensor) or tuple(advantages.shape) != tuple(rewards.shape) or \
            not advantages.is_floating_point():
        problem = f"advantages {_described(advantages)} for rewards of shape {list(rewards.shape)}"
    elif not isinstance(valid, torch.Tensor) or tuple(valid.shape) != (rewards.shape[0],) or \
            valid.dtype != torch.bool:
        problem = f"valid {_described(valid)} for {rewards.shape[0]} groups"
    if problem:
        raise UserError(f"trainer.advantage={name} returned {problem}; {ADVANTAGE_CONTRACT}.")
    return advantages, valid


def _described(value) -> str:
    """A tensor's shape and dtype ("of shape [4] (float32)"), else the value's type ("of type list")."""
    if isinstance(value, torch.Tensor):
        return f"of shape {list(value.shape)} ({str(value.dtype).removeprefix('torch.')})"
    return f"of type {type(value).__name__}"


def overlong_lengths(result, rollout: RolloutSettings) -> tuple[torch.Tensor, int]:
    """The lengths DAPO's overlong shaping reads [B * G] and the limit they are held to: a single turn's
    completion tokens against rollout.max_new_tokens; a trajectory's generated tokens only (its observations
    are the tools', not the model's) against its own limit, rollout.max_total_tokens (as verl's multi-turn DAPO
    holds the response's generated tokens to the whole response budget; max_new_tokens limits each segment)."""
    if result.trajectories is not None:
        generated = [sum(trajectory.loss_mask) for trajectory in result.trajectories]
        return torch.tensor(generated, dtype=torch.long), rollout.max_total_tokens
    return result.completion_mask.sum(dim=1), rollout.max_new_tokens


def budget_spent(trainer: TrainerSettings, counters: dict) -> str:
    """Which budget of the run is spent ('' when none): trainer.max_completions sampled completions or
    trainer.max_sampled_tokens sampled tokens (the run's counters; both may be set, the first reached stops)."""
    if trainer.max_completions and counters["completions_sampled"] >= trainer.max_completions:
        return (f"its budget of sampled completions is spent ({counters['completions_sampled']} sampled, "
                f"trainer.max_completions={trainer.max_completions})")
    if trainer.max_sampled_tokens and counters["tokens_sampled"] >= trainer.max_sampled_tokens:
        return (f"its budget of sampled tokens is spent ({counters['tokens_sampled']} sampled, "
                f"trainer.max_sampled_tokens={trainer.max_sampled_tokens})")
    return ""


def tokens_left(trainer: TrainerSettings, tokens_sampled: int) -> int | None:
    """What is left of trainer.max_sampled_tokens (None: no token budget)."""
    return None if not trainer.max_sampled_tokens else trainer.max_sampled_tokens - tokens_sampled


def attempts_allowed(trainer: TrainerSettings, completions_sampled: int) -> int:
    """trainer.max_attempts, fewer when resampling would sample past trainer.max_completions (never < 1)."""
    if not trainer.max_completions:
        return trainer.max_attempts
    left = math.ceil((trainer.max_completions - completions_sampled) / (trainer.batch_size * trainer.group_size))
    return max(1, min(trainer.max_attempts, left))


def local_counts(attempt: Attempt) -> tuple[int, int, int]:
    """(groups, valid groups, sampled tokens) of an attempt in this process: collect_valid_groups' `count_valid`
    for one process (scripts/bench.py, scripts/gpu_check.py); raises the engine's sentence when it was lost."""
    if attempt.lost is not None:
        raise EngineUnreachable(attempt.lost)
    return attempt.valid.numel(), int(attempt.valid.sum()), attempt.tokens_sampled


def global_counts(attempt: Attempt | list[Attempt], accelerator: Accelerator) -> tuple[int, int, int]:
    """local_counts summed over all processes (and over a mixture's attempts, one per task). Collective:
    collect_valid_groups calls it once per attempt on every process, and stops on its result, the same everywhere:
    an engine lost on any process stops every one."""
    parts = attempt if isinstance(attempt, list) else [attempt]
    attempt = next((a for a in parts if a.lost is not None), parts[0])
    lost = attempt.lost is not None
    local = (0, 0, 0) if lost else tuple(sum(c) for c in zip(*(local_counts(a) for a in parts), strict=True))
    group = collective_group()  # the sampler thread's own (trainer.max_staleness >= 1: gpg_vl/distributed.py)
    if group is None:
        counts = accelerator.reduce(torch.tensor([*local, int(lost)], device=accelerator.device), "sum")
    else:
        counts = torch.tensor([*local, int(lost)])  # gloo: on the CPU
        torch.distributed.all_reduce(counts, group=group)
    if int(counts[3]):
        raise EngineUnreachable(attempt.lost or "another training process could not reach its rollout engine (its "
                                "log names the server); check the servers, then continue with resume=auto.")
    return int(counts[0]), int(counts[1]), int(counts[2])

