"""The training loop, on accelerate. Read `train` top to bottom: (sample -> score -> advantage -> loss ->
optimizer steps -> log -> save) per step -> finish, on a `Run` that `setup` built once. GPG by default; the
GRPO family by trainer.loss. Sampling and threshold resampling are in sample.py, the update (micro-batches,
optimizer steps, the reference) in update.py.

Two ways in: `setup(cfg)` builds a run from a composed config (the command line: task, accelerator, the
output folder's claim, the policy with LoRA and a frozen vision tower, the reference, then all of
`setup_policy`); `setup_policy(policy, task, settings)` builds one around a policy the caller built. Then
`train(run)`.

Nothing here assumes one process: prompts of a step are split across processes, every count that
drives a decision (valid groups, resampling, the loss normalizer) is all-reduced, and checkpoints are
written by the main process only.
"""

from __future__ import annotations

import contextlib
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
from accelerate.utils import DistributedType
from tqdm.auto import tqdm
from transformers import get_scheduler

from gpg_vl.config.schema import EvalSettings, RolloutSettings, TeacherSettings, TrainerSettings
from gpg_vl.data.stream import PromptStream
from gpg_vl.distributed import check_deepspeed_config, forward_is_collective
from gpg_vl.errors import UserError
from gpg_vl.files import write_atomic
from gpg_vl.models.load import Policy
from gpg_vl.models.scoring import choose_scoring_path
from gpg_vl.objective import loss_alpha
from gpg_vl.observe.report import write_curves
from gpg_vl.observe.rollout_log import log_rollouts
from gpg_vl.rollout.engine import EngineUnreachable, build_engine
from gpg_vl.rollout.trajectory import trajectory_metrics
from gpg_vl.train import build
from gpg_vl.train.checkpoint import (
    compare_settings,
    later_checkpoints,
    latest_checkpoint,
    load_in_flight,
    load_trainer_state,
    remove_checkpoint,
    remove_partials,
    resolve_resume,
    save_checkpoint,
    truncate_metrics,
    writing,
)
from gpg_vl.train.held_out import evaluate_during, evaluate_held_out, prepare_held_out
from gpg_vl.train.outdir import claim_output_dir, set_aside_previous_run
from gpg_vl.train.pipeline import (
    SyncPipeline,
    count_sampled,
    require_pipeline,
    start_pipeline,
    whole_copy,
)
from gpg_vl.train.sample import Attempt, budget_spent, reward_names
from gpg_vl.train.teacher import Teacher, check_teacher, frozen_teacher, load_teacher, require_teacher_settings
from gpg_vl.train.update import (
    Learner,
    build_optimizer,
    build_reference,
    kl_on_every_group,
    needs_reference,
    place_reference,
    trainer_loss_options,
    update,
)


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
@dataclass
class RunSettings:
    """What a run is asked to do, beside its policy and task: the `trainer.*`, `rollout.*` and `eval.*`
    settings, where it writes, its seed, the checkpoint it continues (`resume_from`), its resolved config
    (recorded in checkpoints, compared on resume), and the share of bad rows that stops it."""

    trainer: TrainerSettings
    rollout: RolloutSettings
    evaluation: EvalSettings = field(default_factory=EvalSettings)
    output_dir: str | Path = "outputs"
    seed: int = 0
    resume_from: str | Path | None = None
    config: dict | None = None
    max_bad_fraction: float = 0.05
    teacher: TeacherSettings = field(default_factory=TeacherSettings)  # teacher.*: on-policy distillation


@dataclass
class RunData:
    """The data side: the task, the training prompt stream, the held-out rows and how they are evaluated."""

    task: object
    stream: PromptStream
    eval_rows: object
    eval_kwargs: dict
    reward_names: list[str]  # the task's reward components, "temporal" (T-GRPO), "overlong" (DAPO's shaping)


@dataclass
class RunState:
    """The record: where the run is, its counters (saved in checkpoints: a resumed run continues them), its
    summary and the part of it that spans continuations (`record`), each step's metrics."""

    counters: dict
    summary: dict
    record: dict
    start_step: int = 0
    step: int = 0
    history: list[dict] = field(default_factory=list)
    attempts: list = field(default_factory=list)  # the last step's attempts (its rollouts, for the rollout log)
    updated: bool = False  # whether the current step's update has changed the weights


@dataclass
class Run:
    """One training run, built once by `setup` / `setup_policy`; `step(run)` advances it by one rollout.
    The model side is `learner` (policy, prepared model, optimizer, schedule, reference, scoring path), the
    data side `data`, the record `state`; `engine` samples and evaluates; `held` holds the output folder."""

    settings: RunSettings  # trainer.max_steps resolved from trainer.epochs
    learner: Learner
    engine: object  # rollout.engine's (gpg_vl/rollout/): samples, evaluates, takes the weights after each step
    data: RunData
    state: RunState
    bar: object
    held: contextlib.ExitStack  # the output folder's claim (gpg_vl/train/outdir.py), released when the run ends
    warned: set[str] = field(default_factory=set)
    pipeline: object = None  # samples each step (gpg_vl/train/pipeline.py): in this thread, or beside the learner

    @property
    def trainer(self) -> TrainerSettings:
        return self.settings.trainer

    @property
    def accelerator(self) -> Accelerator:
        return self.learner.accelerator

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def output_dir(self) -> Path:
        return Path(self.settings.output_dir)

    @property
    def metrics_file(self) -> Path:
        return self.output_dir / "metrics.jsonl"

    def warn(self, message: str) -> None:
        """Print a warning, once per run."""
        if message not in self.warned:
            self.warned.add(message)
            self.accelerator.print(f"warning: {message}")

    def stop(self, message: str) -> None:
        """End the run with one sentence (too many bad rows or bad steps); summary.json says why."""
        self.bar.close()
        if self.main:
            state = self.state
            state.summary.update({"stopped": message, "data": self.data.stream.bad.summary(), **state.counters,
                                  **state.record})
            with writing("write summary.json", self.output_dir):
                write_atomic(self.output_dir / "summary.json", json.dumps(state.summary, indent=2))
        raise UserError(message)


def train(run: Run) -> dict:
    """Train the run's policy on its task with trainer.loss (GPG by default); returns the run summary (also
    written to summary.json). Reads top to bottom: evaluate -> steps (sample, score, advantage, update, log,
    save) -> final save and evaluation. The output folder is released when it returns or raises."""
    with run.held:
        if run.trainer.eval_before and run.state.start_step == 0:
            evaluate_held_out(run, "before")
        run.pipeline = start_pipeline(run, _in_flight(run))  # trainer.max_staleness >= 1: a sampler thread
        try:
            for _ in range(run.state.start_step + 1, run.trainer.max_steps + 1):
                spent = budget_spent(run.trainer, run.state.counters)  # checked first: a resume past it stops too
                if spent:  # a budget of sampled completions or tokens: equal-cost comparisons of G, variants, tools
                    run.bar.close()
                    run.state.summary["ended_by"] = spent
                    run.accelerator.print(f"The run ended after step {run.state.step} of trainer.max_steps="
                                          f"{run.trainer.max_steps}: {spent}.")
                    break
                before = run.data.stream.state_dict()  # a step the engine fails in draws its prompts again
                try:
                    metrics = step(run)
                except EngineUnreachable as error:
                    stop_on_lost_engine(run, error, before)
                metrics.update(evaluate_during(run))  # trainer.eval_every: the held-out split, at this step
                log_step(run, metrics, run.state.attempts)
                stop_on_bad_steps(run)
                save_step(run)
                run.pipeline.released(run.state.step)  # the sampler may now sample with the weights after it
        finally:
            run.pipeline.close()
        return finish(run)


# ---------------------------------------------------------------------------------------------
# setup
# ---------------------------------------------------------------------------------------------
def setup(cfg) -> Run:
    """Build a run from a composed train config (gpg_vl/config/compose.py), every object once: the task,
    the Accelerator, the judge the task may ask (`reward.judge.*`, set as `task.judge`), the output folder's
    claim (and the checkpoint to resume from), the policy with LoRA and a frozen vision tower, the reference a
    KL loss scores, then what `setup_policy` builds."""
    from omegaconf import OmegaConf

    from gpg_vl.config.validate import check_model_folder

    trainer = TrainerSettings(**OmegaConf.to_container(cfg.trainer, resolve=True))
    trainer_loss_options(trainer, cfg.rollout.max_new_tokens)  # an unknown loss option fails before anything loads
    teacher = TeacherSettings(**OmegaConf.to_container(cfg.teacher, resolve=True)) if cfg.get("teacher") else \
        TeacherSettings()
    require_teacher_settings(teacher, trainer)
    task = build.build_task(cfg.task, cfg.data)
    accelerator = _command_line_accelerator(cfg)
    require_pipeline(trainer, cfg.rollout, accelerator)  # trainer.max_staleness >= 1 with this launch and engine
    build.build_judge(cfg.get("reward"), task, accelerator.device)  # a judge that cannot be built fails first
    container = OmegaConf.to_container(cfg, resolve=True)  # after the output_dir is the same on every process
    held = contextlib.ExitStack()
    try:
        resume = _on_main(accelerator, lambda: _claim(held, cfg, container))
        model_cfg = cfg.model
        if resume is not None:  # the weights come from the checkpoint; the optimizer, data position and RNG follow
            model_cfg = OmegaConf.merge(cfg.model, {"name_or_path": str(resume)})
        check_model_folder(model_cfg)  # before the weights load
        check_teacher(teacher, cfg.model.name_or_path)  # another tokenizer: one sentence, before any model loads
        policy = build.build_policy(model_cfg, accelerator.device)
        frozen = load_teacher(teacher, cfg.model, accelerator.device, trainer=trainer)
        # A loss with a KL term scores the initial weights: with LoRA the base model (adapters disabled); else a
        # copy rebuilt from the model source, so that a resumed run gets the same reference as an uninterrupted one.
        reference = None
        if needs_reference(trainer) and not int((cfg.model.get("lora") or {}).get("r") or 0):
            reference = build.build_policy(cfg.model, accelerator.device).model
        settings = RunSettings(trainer, OmegaConf.to_object(cfg.rollout), EvalSettings(**container["eval"]),
                               output_dir=cfg.output_dir, seed=cfg.seed, resume_from=resume, config=container,
                               max_bad_fraction=cfg.data.max_bad_fraction, teacher=teacher)
        return _build_run(policy, task, settings, accelerator, reference, held, teacher=frozen)
    except BaseException:
        held.close()
        raise


def setup_policy(policy: Policy, task, settings: RunSettings, *, accelerator: Accelerator | None = None,
                 reference: torch.nn.Module | None = None, teacher: torch.nn.Module | None = None) -> Run:
    """Build a run around a policy the caller built (programmatic use: `train(setup_policy(policy, task,
    RunSettings(trainer=..., rollout=..., output_dir=...)))`). The main process claims settings.output_dir for
    the run (gpg_vl/train/outdir.py: one run per folder); `accelerator`: one the caller made (else one is made
    here); `reference`: the initial weights, for a loss with a KL term (else a copy of the policy's is taken);
    `teacher`: the teacher model of settings.teacher (on-policy distillation; frozen here).

    settings.resume_from is a complete checkpoint (see gpg_vl/train/checkpoint.py): training continues from its
    step with its optimizer, scheduler, RNG states and data position, and metrics.jsonl loses any lines past
    that step. Bad rows are skipped and counted; more than settings.max_bad_fraction of the rows seen stops
    the run."""
    trainer_loss_options(settings.trainer, settings.rollout.max_new_tokens)
    require_teacher_settings(settings.teacher, settings.trainer)
    if (teacher is None) != (settings.teacher.model is None):
        raise UserError("settings.teacher.model and the teacher= model go together: pass both (the teacher model "
                        "and its teacher.* settings) or neither.")
    accelerator = accelerator or Accelerator(
        log_with=None if settings.trainer.report_to == "none" else settings.trainer.report_to,
        project_dir=str(settings.output_dir))
    require_pipeline(settings.trainer, settings.rollout, accelerator)
    held = contextlib.ExitStack()
    try:
        if accelerator.is_main_process:
            held.enter_context(claim_output_dir(settings.output_dir, resume=settings.resume_from))
        frozen = None if teacher is None else frozen_teacher(teacher.to(accelerator.device), policy.family,
                                                             settings.teacher, settings.trainer)
        return _build_run(policy, task, settings, accelerator, reference, held, teacher=frozen)
    except BaseException:
        held.close()
        raise


def _build_run(policy: Policy, task, settings: RunSettings, accelerator: Accelerator,
               reference: torch.nn.Module | None, held: contextlib.ExitStack, *, teacher: Teacher | None = None) -> Run:
    """Build a run once: seeds, data, optimizer and schedule (counting optimizer steps), the prepared model,
    the reference model when the loss needs one, the scoring path, the resumed state, the held-out rows.

    The reference (loss grpo with trainer.kl_coef > 0) is the initial weights, frozen: with LoRA the policy
    with its adapters disabled; otherwise `reference` when given (the command line rebuilds it from the model
    source, so a resumed run gets the same one), else a copy of `policy`'s weights taken here, before any
    step. Checkpoints never hold it."""
    _start_process(accelerator, settings)
    trainer = settings.trainer
    policy.family.require_box_frame(task)  # a grounding task on a family without a box frame: one sentence
    train_rows = task.load(task.train_split)
    note = task.data_note(train_rows)  # e.g. how many rows need a judge: said once, at the start
    if note:
        accelerator.print(note)
    if trainer.epochs:  # epochs over the train split decide the length of the run
        trainer = replace(trainer, max_steps=max(1, math.ceil(trainer.epochs * len(train_rows) / trainer.batch_size)))
        settings = replace(settings, trainer=trainer)
    learner = _build_learner(policy, trainer, settings.rollout, accelerator, reference,
                             resuming=settings.resume_from is not None)
    # samples, and evaluates; with rollout.max_turns > 1 trajectories that may call the task's tools
    engine = build_engine(settings.rollout, learner.policy, accelerator=accelerator, tools=task.tools)
    learner = replace(learner, correction=engine.correction, teacher=teacher)
    if getattr(task, "temporal", False) and forward_is_collective(learner.model):
        raise UserError("T-GRPO's shuffled-frame rollouts (task.options.temporal=true) run only on the prompts with "
                        "video of each process, which FSDP / ZeRO-3's collective generation cannot follow; turn "
                        "temporal off or train with DDP.")
    if trainer.report_to != "none":
        accelerator.init_trackers("gpg-vl", config=_flat_scalars(settings.config or {}))
    state = RunState(counters={"reward_errors": 0, "rewards_nonfinite": 0, "nonfinite_steps": 0,
                               "bad_steps_in_a_row": 0, "completions_sampled": 0, "tokens_sampled": 0,
                               "reward_timeouts": 0},
                     summary={}, record={"train_seconds": 0.0})
    run = Run(settings, learner, engine, data=None, state=state, bar=None, held=held)
    accelerator.print(f"model: {policy.family.describe(learner.model)}; the update scores "
                      f"{run.learner.path.describe()}")
    stream = PromptStream(train_rows, seed=settings.seed, rank=accelerator.process_index,
                          world_size=accelerator.num_processes, max_bad_fraction=settings.max_bad_fraction,
                          warn=run.warn, stop=run.stop, max_aspect_ratio=policy.family.max_aspect_ratio)
    run.data = RunData(task, stream, eval_rows=None, eval_kwargs={},
                       reward_names=reward_names(task, trainer))
    _resume(run)
    prepare_held_out(run)
    run.bar = tqdm(total=trainer.max_steps, initial=state.start_step, disable=not run.main,
                   desc=bar_label(trainer.loss), dynamic_ncols=True)
    return run


def bar_label(loss: str) -> str:
    """The progress bar's label: a built-in loss upper-cased (GPG, DAPO), a plugin's function name as it is
    (`path/to/file.py:my_loss` and `module:my_loss` show `my_loss`)."""
    return loss.rpartition(":")[2] if ":" in loss else loss.upper()


def _start_process(accelerator: Accelerator, settings: RunSettings) -> None:
    """config.json (main process), this process's seeds, and the check that every process gets prompts."""
    output_dir, trainer = Path(settings.output_dir), settings.trainer
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        with writing("write config.json", output_dir):
            write_atomic(output_dir / "config.json", json.dumps(settings.config or {}, indent=2, default=str))
    # Each process samples its own completions: with one seed everywhere they would draw the same numbers.
    torch.manual_seed(settings.seed + accelerator.process_index)
    random.seed(settings.seed + accelerator.process_index)
    np.random.seed(settings.seed + accelerator.process_index)
    if trainer.batch_size < accelerator.num_processes:
        raise UserError(f"trainer.batch_size={trainer.batch_size} is smaller than the {accelerator.num_processes} "
                        "processes, so some would get no prompt; set trainer.batch_size to at least "
                        f"{accelerator.num_processes} (prompts per step, over all processes).")


def _build_learner(policy: Policy, trainer: TrainerSettings, rollout: RolloutSettings, accelerator: Accelerator,
                   reference: torch.nn.Module | None, *, resuming: bool) -> Learner:
    """The model side, prepared by accelerate: the model (gradient checkpointing, train mode), AdamW, the
    schedule (it counts optimizer steps: mu x mini-batches per rollout, one per step for GPG), the reference,
    and the scoring path, chosen once for the run on the prepared model: the update's forward and its
    micro-batch cost both read it."""
    model = policy.model
    frozen = build_reference(model, trainer, reference, resuming=resuming)
    if trainer.gradient_checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.x name
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = build_optimizer(model, trainer)
    scheduler = get_scheduler(trainer.lr_schedule, optimizer, num_warmup_steps=trainer.warmup_steps,
                              num_training_steps=trainer.max_steps * trainer.optimizer_steps_per_rollout)
    _check_engine(accelerator)
    whole = whole_copy(model, trainer, accelerator)  # FSDP2 at trainer.max_staleness >= 1: the sampler's, unsharded
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    policy = replace(policy, model=accelerator.unwrap_model(model))
    path = choose_scoring_path(policy.family, model, share_prompt=trainer.share_prompt,
                               share_vision=trainer.share_vision, packing=trainer.packing,
                               warn=lambda m: accelerator.print(f"warning: {m}"))
    return Learner(policy, model, optimizer, scheduler, accelerator, trainer, temperature=rollout.temperature,
                   path=path, reference=place_reference(frozen, accelerator), max_new_tokens=rollout.max_new_tokens,
                   whole_copy=whole)


def _resume(run: Run) -> None:
    """Continue settings.resume_from (optimizer, schedule, data position, RNG, counters), and clear what an
    interrupted save or a later continuation of this run left in the output folder."""
    learner, state, accelerator = run.learner, run.state, run.accelerator
    resume_from = run.settings.resume_from
    if resume_from is not None:
        state.start_step = load_trainer_state(Path(resume_from), learner.optimizer, learner.scheduler,
                                              run.data.stream, accelerator=accelerator, model=learner.model,
                                              counters=state.counters, record=state.record)
        accelerator.print(f"resumed from {resume_from} at step {state.start_step}")
    state.step = state.start_step
    if run.main:  # what an interrupted save or an earlier continuation of this run left behind
        for leftover in remove_partials(run.output_dir):
            accelerator.print(f"removed {leftover.name}, left by an interrupted save")
        with writing("cut metrics.jsonl back to the resumed step", run.output_dir):  # a full disk: one sentence
            truncate_metrics(run.metrics_file, state.start_step)
        if state.start_step:
            for later in later_checkpoints(run.output_dir, state.start_step):
                remove_checkpoint(later)
                accelerator.print(f"removed {later.name}: it is past step {state.start_step}, which this run "
                                  "continues")


def _command_line_accelerator(cfg) -> Accelerator:
    """The one Accelerator of a command-line run: bf16 on CUDA for a bf16 model; several processes without a
    GPU joined with gloo; one output_dir for all processes (${now} differs by process)."""
    mixed = "bf16" if cfg.model.dtype in ("auto", "bfloat16") and torch.cuda.is_available() else "no"
    report_to = cfg.trainer.report_to
    # Several processes and no GPU (`accelerate launch --multi_gpu --num_processes 2` or torchrun on a CPU
    # machine): cpu=True makes accelerate join them with gloo; otherwise each would train alone.
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    # A DeepSpeed launch (configs/accelerate/zero*.yaml) without a GPU: cpu=True would turn DeepSpeed off, and
    # without it accelerate keeps DeepSpeed but finds no process-group backend for the CPU (each process then
    # counts 1 process while DeepSpeed counts all). Name gloo, as DeepSpeed's CPU accelerator does without oneCCL.
    from accelerate.utils import InitProcessGroupKwargs

    deepspeed_on_cpu = (launched > 1 and not torch.cuda.is_available()
                        and os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true")
    accelerator = Accelerator(mixed_precision=mixed, project_dir=str(cfg.output_dir),
                              cpu=launched > 1 and not torch.cuda.is_available() and not deepspeed_on_cpu,
                              kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if deepspeed_on_cpu else None,
                              log_with=None if report_to == "none" else report_to)
    if accelerator.num_processes != launched:
        raise UserError(f"{launched} processes were launched but accelerate joined {accelerator.num_processes}; "
                        "launch with `accelerate launch --multi_gpu --num_processes N` (or torchrun) on a machine "
                        "whose devices accelerate supports.")
    if accelerator.distributed_type == DistributedType.DEEPSPEED:  # a bad value: one sentence, before the model
        check_deepspeed_config(accelerator.state.deepspeed_plugin.deepspeed_config)
    if accelerator.num_processes > 1:  # collective, on every process: one output_dir (${now} differs by process)
        from accelerate.utils import broadcast_object_list

        cfg.output_dir = broadcast_object_list([str(cfg.output_dir)])[0]
    return accelerator


def _claim(held: contextlib.ExitStack, cfg, container: dict) -> Path | None:
    """Lock and check the output folder (held until `held` closes), then pick the checkpoint to resume from,
    intact and made with compatible settings (printing the legitimate changes); None: start afresh."""
    held.enter_context(claim_output_dir(cfg.output_dir, resume=cfg.resume, overwrite=bool(cfg.get("overwrite"))))
    resume = resolve_resume(cfg.resume, cfg.output_dir)  # resume=auto: the newest intact checkpoint, if any
    if str(cfg.resume) == "auto" and resume is None:
        print(f"resume=auto: no complete checkpoint in {cfg.output_dir}; starting at step 0")
        # what a previous run left (a final/ without its checkpoint.json, metrics) is kept aside, not replaced
        set_aside_previous_run(Path(cfg.output_dir), "resume=auto starts over")
    changes = compare_settings(resume, container) if resume is not None else []
    if changes:
        print(f"resuming {resume} with changed settings: {'; '.join(changes)}")
    return resume


def _on_main(accelerator: Accelerator, action):
    """`action()` on the main process alone, its result given to every process; a UserError it raises is
    raised on every process (collective when there are several: each reaches it once, at the same point)."""
    result, problem = None, None
    if accelerator.is_main_process:
        try:
            result = action()
        except UserError as error:
            problem = str(error)
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        result, problem = broadcast_object_list([result, problem])
    if problem is not None:
        raise UserError(problem)
    return result


# ---------------------------------------------------------------------------------------------
# one step
# ---------------------------------------------------------------------------------------------
def step(run: Run) -> dict:
    """One rollout and its update: the step's sampling stage (sample + score + advantage, resampling until enough
    groups carry signal; run.pipeline's: in this thread, or a sampler's beside it), then the optimizer steps on the
    valid groups; returns the step's metrics."""
    trainer, accelerator, state = run.trainer, run.accelerator, run.state
    state.step += 1
    state.updated = False
    started = time.perf_counter()
    sampled = (run.pipeline or SyncPipeline(run)).take(state.step)
    collected = sampled.collected
    rolled = time.perf_counter()
    state.attempts = collected.attempts
    count_sampled(state.counters, sampled, trainer.group_size)  # resampling included; generated tokens only
    # loss + step, on valid groups only; a loss whose KL is on takes every group, and reports groups_used and alpha
    if collected.groups_valid > 0 or kl_on_every_group(trainer) or run.learner.teacher is not None:
        result = update(run.learner, collected.attempts)
        state.updated = not result.get("skipped")
        aside = trainer.max_staleness > 0  # the sampler syncs an engine with its own weights by the schedule
        if not result.get("skipped") and not aside:
            run.engine.sync(run.learner.model)  # an engine with its own weights takes the stepped ones (HF: none)
        warning = None if aside else run.engine.mismatch_warning(result)  # its own weights off-policy?
        if warning:
            run.warn(warning)
    else:
        result = {"loss": 0.0, "grad_norm": 0.0, "skipped": 1.0}
        run.warn("a step had no group with differing rewards after trainer.max_attempts rollouts; "
                 "it was skipped (check the task's rewards, or raise rollout.temperature).")
    if run.pipeline is not None:
        run.pipeline.learned(state.step)  # the weights after this step, for the sampler (trainer.max_staleness)
    updated = time.perf_counter()
    _count_bad_step(run, result)
    turns = trajectory_step_metrics(collected, accelerator) if run.engine.multiturn.multi_turn else {}
    valid = collected.groups_valid - int(result.get("groups_rejected", 0))  # all-rejected groups count in M
    versions = [v for a in collected.attempts if a.rollout is not None for v in a.rollout.weight_versions or []]
    return {"step": state.step, **step_metrics(collected, accelerator, run.data.reward_names),
            **turns, **({"rollout_weight_version": min(versions)} if versions else {}),
            "valid_fraction": collected.valid_fractions[0], "valid_fractions": collected.valid_fractions,
            "attempts": len(collected.attempts), "groups_sampled": collected.groups_sampled,
            "groups_used": collected.groups_valid,
            "alpha": loss_alpha(trainer.age, collected.groups_sampled, valid),
            "completions_sampled": state.counters["completions_sampled"],
            "tokens_sampled": state.counters["tokens_sampled"],
            **result, "lr": run.learner.scheduler.get_last_lr()[0],
            "nonfinite_steps": state.counters["nonfinite_steps"],
            **sampled.stream, **pipeline_metrics(state.step, sampled),
            "rollout_s": sampled.rollout_s, "update_s": updated - rolled,
            "step_s": time.perf_counter() - started}


# The step metrics read off the wall clock (seconds, and tokens per second): two runs of one seed, a resumed one
# and the uninterrupted one, agree on every other metric exactly (scripts/check_resume.py, the resume tests).
WALL_CLOCK_METRICS = frozenset({"rollout_s", "update_s", "step_s", "sampler_idle_s", "learner_idle_s",
                                "generated_tokens_per_s"})


def pipeline_metrics(step: int, sampled) -> dict[str, float]:
    """The sampling stage's timing and staleness: the version lag of the step's rollouts (step - 1 - version), how
    long each side waited for the other, and the generated tokens per second of sampling."""
    lag = step - 1 - sampled.version
    return {"version_lag_mean": float(lag), "version_lag_max": lag, "sampler_idle_s": sampled.sampler_idle_s,
            "learner_idle_s": sampled.learner_idle_s, "generated_tokens_per_s": sampled.tokens_per_s}


def _count_bad_step(run: Run, result: dict) -> None:
    """A NaN or infinite loss or gradient: update() took no optimizer step; too many in a row stop the run."""
    counters = run.state.counters
    bad_step = bool(result.get("nonfinite"))
    counters["nonfinite_steps"] += bad_step
    counters["bad_steps_in_a_row"] = counters["bad_steps_in_a_row"] + 1 if bad_step else 0
    if bad_step:
        run.accelerator.print(f"warning: step {run.state.step}: the loss or gradient is NaN or infinite (loss="
                              f"{result['loss']}, grad_norm={result['grad_norm']}); the step was skipped, no weight "
                              f"changed ({counters['bad_steps_in_a_row']} in a row, trainer.max_bad_steps="
                              f"{run.trainer.max_bad_steps}).")


# ---------------------------------------------------------------------------------------------
# log + save
# ---------------------------------------------------------------------------------------------
def trajectory_step_metrics(collected, accelerator: Accelerator) -> dict[str, float]:
    """The step's multi-turn metrics (`trajectory_metrics`: turns, tool calls and errors, images, limit hits,
    generated and observation tokens) over every trajectory sampled on every process. Collective: one all-reduce,
    on every process when rollout.max_turns > 1 (a process without prompts adds zeros)."""
    trajectories = [t for a in collected.attempts if a.rollout is not None for t in a.rollout.trajectories or []]
    local = trajectory_metrics(trajectories)
    names = sorted(local)
    count = float(len(trajectories))
    sums = [local[n] * count if n.endswith("_mean") else local[n] for n in names] + [count]  # means back to sums
    totals = accelerator.reduce(torch.tensor(sums, dtype=torch.float64, device=accelerator.device), "sum").tolist()
    return {n: (v / max(totals[-1], 1.0) if n.endswith("_mean") else v) for n, v in zip(names, totals, strict=False)}


def step_metrics(collected, accelerator: Accelerator, reward_names: list[str]) -> dict[str, float]:
    """Global reward statistics over every completion sampled in this step (collective: one all-reduce, called
    once per step by every process; a process without prompts adds zeros). Completions with a NaN or
    infinite reward are counted (`rewards_nonfinite`), not averaged; the reward function calls that raised
    (`reward_errors`) and the completions not scored within the reward budget (`reward_timeouts`), each as its
    attempt's scoring returned them, are summed over processes."""
    # one row per attempt: completions, finite rewards, their sum and sum of squares, completion tokens,
    # reward errors, reward timeouts, each component's sum over the finite rewards; plus a row of zeros (a
    # process without prompts adds nothing)
    rows = [torch.zeros(7 + len(reward_names), dtype=torch.float64)]
    for attempt in collected.attempts:
        lengths = attempt.rollout.completion_mask.sum(dim=1).float() if attempt.rollout else torch.zeros(0)
        r = attempt.rewards.flatten()
        finite = torch.isfinite(r)
        rows.append(torch.stack([
            torch.tensor(float(r.numel())), finite.sum().float(), r[finite].sum(), (r[finite] ** 2).sum(),
            lengths.sum(), torch.tensor(float(attempt.reward_errors)), torch.tensor(float(attempt.reward_timeouts)),
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


def log_step(run: Run, metrics: dict, attempts: list[Attempt]) -> None:
    """Count the step's reward problems, append its metrics to metrics.jsonl, the progress bar and trackers;
    record its rollouts (`attempts`) for viewing every trainer.log_rollouts_every steps."""
    state, trainer = run.state, run.trainer
    state.counters["reward_errors"] += metrics["reward_errors"]
    state.counters["rewards_nonfinite"] += metrics["rewards_nonfinite"]
    state.counters["reward_timeouts"] += metrics["reward_timeouts"]
    state.record["train_seconds"] += metrics["step_s"]
    if metrics["reward_timeouts"]:
        run.warn(f"some completions were not scored within trainer.reward_budget_s={trainer.reward_budget_s} s "
                 "of reward time per step; they scored 0 and are counted per step as reward_timeouts in "
                 "metrics.jsonl (raise the budget or trainer.reward_workers, or make the task's rewards faster).")
    if metrics["rewards_nonfinite"]:
        run.warn(f"some completions got a NaN or infinite reward ({_nonfinite_rewards(run, attempts)}); their groups "
                 "are left out of the update and counted per step as rewards_nonfinite in metrics.jsonl.")
    state.history.append(metrics)
    if run.main:  # a line cut short by a full disk is dropped by the resume (truncate_metrics)
        with writing(f"append step {state.step} to metrics.jsonl", run.output_dir), \
                run.metrics_file.open("a") as handle:
            handle.write(json.dumps(metrics) + "\n")
        run.bar.set_postfix(reward=f"{metrics['reward_mean']:.2f}", valid=f"{metrics['valid_fraction']:.2f}",
                            alpha=f"{metrics['alpha']:.2f}")
        run.bar.update(1)
    if trainer.report_to != "none":
        run.accelerator.log({k: v for k, v in metrics.items() if not isinstance(v, list)}, step=state.step)
    with writing(f"write step {state.step}'s rollouts", run.output_dir):
        log_rollouts(state.step, attempts, policy=run.learner.policy, task=run.data.task, output_dir=run.output_dir,
                     every=trainer.log_rollouts_every, groups=trainer.log_rollouts_groups,
                     accelerator=run.accelerator)


def _nonfinite_rewards(run: Run, attempts: list[Attempt]) -> str:
    """Which rewards were NaN or infinite: the names this process saw (its completions' reward components, and the
    task's count); "on another process" only when this process saw none and there are others."""
    names = set(getattr(run.data.task, "reward_nonfinite", {}))
    for attempt in attempts:
        names.update(name for name, values in (getattr(attempt, "components", None) or {}).items()
                     if torch.is_tensor(values) and not torch.isfinite(values).all())
    if names:
        return f"reward {', '.join(sorted(names))}"
    if run.accelerator.num_processes > 1:
        return "on another process"
    return "the weighted sum of the task's rewards"


def stop_on_bad_steps(run: Run) -> None:
    """Too many steps in a row with a NaN or infinite loss or gradient end the run in one sentence."""
    trainer, bad = run.trainer, run.state.counters["bad_steps_in_a_row"]
    if trainer.max_bad_steps and bad >= trainer.max_bad_steps:
        last = latest_checkpoint(run.output_dir) if run.main else None
        run.stop(f"stopped at step {run.state.step}: the last {bad} steps had a NaN or infinite loss "
                 f"or gradient (trainer.max_bad_steps={trainer.max_bad_steps}) and changed no weight; the last good "
                 f"checkpoint, {last or 'none (none was written)'}, is intact: lower trainer.lr, check the task's "
                 "rewards and data, then continue with resume=auto.")


def stop_on_lost_engine(run: Run, error: EngineUnreachable, stream_state: dict) -> None:
    """The rollout engine was lost mid-step (a vLLM server unreachable for rollout.vllm_server.timeout_s): on every
    process, checkpoint what is done (this step's update if it ran, else the step before, its prompts to be drawn
    again) and stop in one sentence. With trainer.max_staleness >= 1 the sampler's steps in flight cannot be
    written: the last checkpoint of trainer.save_every is the one to continue from."""
    state = run.state
    if run.trainer.max_staleness:
        last = latest_checkpoint(run.output_dir) if run.main else None
        run.stop(f"{str(error).rstrip('.')}; the run stopped at step {state.step}: continue from its last "
                 f"checkpoint ({last.name if last else 'none was written'}) with resume=auto once the rollout engine "
                 "is back.")
    done = state.step if state.updated else state.step - 1
    if not state.updated:
        run.data.stream.load_state_dict(stream_state)
    state.step = done
    path = run.output_dir / f"checkpoint-{done}"
    save_checkpoint(path, run.learner, run.data.stream, done, keep=run.trainer.keep_checkpoints,
                    counters=state.counters, config=run.settings.config, record=state.record)
    run.stop(f"{str(error).rstrip('.')}; the run stopped after step {done} and wrote {path.name}: continue with "
             "resume=auto once the rollout engine is back.")


def save_step(run: Run) -> None:
    """checkpoint-<step>/ every trainer.save_every steps (never while steps are failing, so the last good
    checkpoint is not rotated away)."""
    state = run.state
    if run.trainer.save_every and state.step % run.trainer.save_every == 0:
        if state.counters["bad_steps_in_a_row"] or not _finite_weights(run.learner.model, run.accelerator):
            run.warn(f"step {state.step}: no checkpoint written: the weights or the last step are not finite.")
        else:
            in_flight = run.pipeline.state_dict() if run.pipeline is not None else None  # first: the stream waits
            save_checkpoint(run.output_dir / f"checkpoint-{state.step}", run.learner, run.data.stream, state.step,
                            keep=run.trainer.keep_checkpoints, counters=state.counters, config=run.settings.config,
                            record=state.record, in_flight=in_flight)


def _in_flight(run: Run) -> dict | None:
    """The steps a resumed checkpoint holds in flight (trainer.max_staleness >= 1), checked against this run's k."""
    if run.settings.resume_from is None or run.trainer.max_staleness == 0:
        return None
    state = load_in_flight(Path(run.settings.resume_from))
    if state is None:
        run.warn(f"{run.settings.resume_from} holds no steps in flight (saved with trainer.max_staleness=0): the "
                 "steps up to the next k sample with its weights, so the run differs from an uninterrupted one.")
    elif state["max_staleness"] != run.trainer.max_staleness:
        raise UserError(f"{run.settings.resume_from} was saved with trainer.max_staleness={state['max_staleness']}, "
                        f"and this run has {run.trainer.max_staleness}; resume with the same value.")
    return state


def finish(run: Run) -> dict:
    """The final save and evaluation; summary.json and curves.png; returns the summary."""
    state, stream = run.state, run.data.stream
    run.bar.close()
    save_checkpoint(run.output_dir / "final", run.learner, stream, state.step, counters=state.counters,
                    config=run.settings.config, record=state.record)
    if stream.bad.bad:
        run.accelerator.print(stream.bad.report("training rows"))
    if run.trainer.eval_after:
        evaluate_held_out(run, "after")
    summary = state.summary
    summary["steps"] = state.step
    summary["train_seconds"] = state.record["train_seconds"]  # every continuation's steps, up to this one
    summary["data"] = stream.bad.summary()
    summary.update({key: value for key, value in state.counters.items() if key != "bad_steps_in_a_row"})
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
