"""Building a run once, the two ways in: `setup(cfg)` from a composed config (the task, the accelerator, the output
folder's claim, the policy, the reference), and `setup_policy(policy, task, settings)` around a policy the caller
built; both end in `_build_run` (seeds, data, the prepared model and optimizer, the engine, the resumed state)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from tqdm.auto import tqdm
from transformers import get_scheduler

from gpg_vl.config.schema import EvalSettings, RolloutSettings, TeacherSettings, TrainerSettings
from gpg_vl.data.mixture import Mixture, MixtureStream, require_shared_run
from gpg_vl.data.samplers import build_sampler
from gpg_vl.data.stream import PromptStream
from gpg_vl.data.task import load_split
from gpg_vl.distributed import check_deepspeed_config, forward_is_collective
from gpg_vl.errors import UserError
from gpg_vl.files import write_atomic
from gpg_vl.models.load import Policy
from gpg_vl.models.scoring import choose_scoring_path
from gpg_vl.rollout.engine import build_engine, prepare_tools, require_reachable
from gpg_vl.train import build
from gpg_vl.train.checkpoint.folder import (
    later_checkpoints,
    remove_checkpoint,
    remove_partials,
    resolve_resume,
    writing,
)
from gpg_vl.train.checkpoint.outdir import claim_output_dir, set_aside_previous_run
from gpg_vl.train.checkpoint.resume import compare_settings, load_trainer_state, truncate_metrics
from gpg_vl.train.eval.held_out import prepare_held_out
from gpg_vl.train.mixed import mixture_engines
from gpg_vl.train.run import Run, RunData, RunSettings, RunState
from gpg_vl.train.step.loss_call import trainer_loss_options
from gpg_vl.train.step.pipeline import SyncPipeline, require_pipeline, staleness_note, whole_copy
from gpg_vl.train.step.reference import build_reference, needs_reference, place_reference
from gpg_vl.train.step.sample import reward_names
from gpg_vl.train.step.update import Learner, build_optimizer
from gpg_vl.train.teacher.build import Student, Teachers, build_teachers, require_teachers, task_teachers


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
    task = build.build_task(cfg.task, cfg.data)
    build.require_inputs(task, cfg.model)  # video on a model that cannot read it: one sentence, before it loads
    teachers = _task_teachers(teacher, task)
    require_teachers(teachers, trainer, task)  # contradictions with the trainer, one sentence each
    prepare_tools(OmegaConf.to_object(cfg.rollout), task.tools)  # a tool's sandbox that cannot start, likewise
    if isinstance(task, Mixture):  # settings the tasks of a mixture cannot share: one sentence, before it loads
        require_shared_run(task, OmegaConf.to_object(cfg.rollout), trainer)
    require_reachable(OmegaConf.to_object(cfg.rollout))  # a server that does not answer: one sentence, before it loads
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
        # each task's teacher: its tokenizer checked (one sentence, before any model loads), loaded or connected
        frozen = build_teachers(teachers, Student(cfg.model.name_or_path, load=_teacher_loader(cfg.model,
                                                                                              accelerator.device)),
                                trainer=trainer, rollout=cfg.rollout, device=accelerator.device,
                                rank=accelerator.process_index)
        policy = build.build_policy(model_cfg, accelerator.device, seed=int(cfg.seed))
        # A loss with a KL term scores the initial weights: with LoRA the base model (adapters disabled); else a
        # copy rebuilt from the model source, so that a resumed run gets the same reference as an uninterrupted one.
        reference = None
        if needs_reference(trainer) and not int((cfg.model.get("lora") or {}).get("r") or 0):
            reference = build.build_policy(cfg.model, accelerator.device).model
        settings = RunSettings(trainer, OmegaConf.to_object(cfg.rollout), EvalSettings(**container["eval"]),
                               output_dir=cfg.output_dir, seed=cfg.seed, resume_from=resume, config=container,
                               max_bad_fraction=cfg.data.max_bad_fraction, sampler=cfg.data.sampler,
                               difficulty_keep=cfg.data.difficulty_keep, difficulty_window=cfg.data.difficulty_window,
                               teacher=teacher)
        return _build_run(policy, task, settings, accelerator, reference, held, teacher=frozen)
    except BaseException:
        held.close()
        raise


def setup_policy(policy: Policy, task, settings: RunSettings, *, accelerator: Accelerator | None = None,
                 reference: torch.nn.Module | None = None, teacher: torch.nn.Module | dict | None = None) -> Run:
    """Build a run around a policy the caller built (programmatic use: `train(setup_policy(policy, task,
    RunSettings(trainer=..., rollout=..., output_dir=...)))`). The main process claims settings.output_dir for the run
    (gpg_vl/train/checkpoint/outdir.py: one run per folder); `accelerator`: one the caller made (else one is made here);
    `reference`: the initial weights, for a loss with a KL term (else a copy of the policy's is taken); `teacher`: the
    teacher model of settings.teacher (on-policy distillation; frozen here), or in a mixture {task name: model} for
    the tasks whose teacher is a model (the task's settings: settings.teacher and the mixture's own, task.teacher).

    settings.resume_from is a complete checkpoint (see gpg_vl/train/checkpoint/): training continues from its
    step with its optimizer, scheduler, RNG states and data position, and metrics.jsonl loses any lines past
    that step. Bad rows are skipped and counted; more than settings.max_bad_fraction of the rows seen stops
    the run."""
    trainer_loss_options(settings.trainer, settings.rollout.max_new_tokens)
    teachers = _task_teachers(settings.teacher, task)
    require_teachers(teachers, settings.trainer, task)
    models = teacher if isinstance(teacher, dict) else {name: teacher for name, one in teachers.items()
                                                        if teacher is not None and one.model is not None}
    if teacher is not None and not models:
        raise UserError("a teacher= model was given without settings.teacher.model; pass both (the teacher model and "
                        "its teacher.* settings) or neither.")
    accelerator = accelerator or Accelerator(
        log_with=None if settings.trainer.report_to == "none" else settings.trainer.report_to,
        project_dir=str(settings.output_dir))
    require_pipeline(settings.trainer, settings.rollout, accelerator)
    held = contextlib.ExitStack()
    try:
        if accelerator.is_main_process:
            held.enter_context(claim_output_dir(settings.output_dir, resume=settings.resume_from))
        text = getattr(policy.model.config, "text_config", None) or policy.model.config
        frozen = build_teachers(teachers, Student(tokenizer=policy.family.tokenizer,
                                                  vocab_size=getattr(text, "vocab_size", None)),
                                trainer=settings.trainer, rollout=settings.rollout, device=accelerator.device,
                                rank=accelerator.process_index, models=models, family=policy.family)
        return _build_run(policy, task, settings, accelerator, reference, held, teacher=frozen)
    except BaseException:
        held.close()
        raise


def _build_run(policy: Policy, task, settings: RunSettings, accelerator: Accelerator,
               reference: torch.nn.Module | None, held: contextlib.ExitStack, *,
               teacher: Teachers | None = None) -> Run:
    """Build a run once: seeds, data, optimizer and schedule (counting optimizer steps), the prepared model,
    the reference model when the loss needs one, the scoring path, the resumed state, the held-out rows.

    The reference (loss grpo with trainer.kl_coef > 0) is the initial weights, frozen: with LoRA the policy
    with its adapters disabled; otherwise `reference` when given (the command line rebuilds it from the model
    source, so a resumed run gets the same one), else a copy of `policy`'s weights taken here, before any
    step. Checkpoints never hold it."""
    _start_process(accelerator, settings)
    trainer = settings.trainer
    mixed = isinstance(task, Mixture)
    for one in task.tasks.values() if mixed else [task]:  # a grounding task on a family without a box frame
        policy.family.require_box_frame(one)
    train_rows = {name: load_split(one, one.train_split) for name, one in task.tasks.items()} if mixed else \
        load_split(task, task.train_split)
    note = task.data_note(train_rows)  # e.g. how many rows need a judge: said once, at the start
    if note:
        accelerator.print(note)
    if trainer.epochs:  # epochs over the train split decide the length of the run
        size = sum(map(len, train_rows.values())) if mixed else len(train_rows)
        trainer = replace(trainer, max_steps=max(1, math.ceil(trainer.epochs * size / trainer.batch_size)))
        settings = replace(settings, trainer=trainer)
    stale = staleness_note(trainer.max_staleness, trainer.max_steps)  # k as long as the run: the sampler never moves
    if stale:
        accelerator.print(stale)
    learner = _build_learner(policy, trainer, settings.rollout, accelerator, reference,
                             resuming=settings.resume_from is not None)
    # samples, and evaluates; with rollout.max_turns > 1 trajectories that may call the task's tools
    rollouts, engines = mixture_engines(task, settings.rollout, learner.policy, accelerator) if mixed else ({}, {})
    engine = next(iter(engines.values())) if mixed else \
        build_engine(settings.rollout, learner.policy, accelerator=accelerator, tools=task.tools)
    teacher = None if teacher is None else teacher.bind(learner.policy)  # a server teacher reads the family's media
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
    run.pipeline = SyncPipeline(run)  # until train() starts the run's own (a sampler beside it at max_staleness >= 1)
    accelerator.print(f"model: {policy.family.describe(learner.model)}; the update scores "
                      f"{run.learner.path.describe()}")
    def make_stream(name: str | None, rows) -> PromptStream:  # a task's stream: alone, or in a mixture
        sampler = build_sampler(settings.sampler, len(rows), seed=settings.seed, keep=settings.difficulty_keep,
                                window=settings.difficulty_window)  # uniform: the plain walk
        return PromptStream(rows, seed=settings.seed,  # a task walks its split as it would alone
                            rank=accelerator.process_index, world_size=accelerator.num_processes,
                            max_bad_fraction=settings.max_bad_fraction, warn=run.warn, stop=run.stop,
                            max_aspect_ratio=policy.family.max_aspect_ratio, sampler=sampler)

    stream = MixtureStream(task, train_rows, seed=settings.seed, rank=accelerator.process_index,
                           world_size=accelerator.num_processes, make_stream=make_stream) if mixed else \
        make_stream(None, train_rows)
    run.data = RunData(task, stream, eval_rows=None, eval_kwargs={},
                       reward_names=reward_names(task, trainer), engines=engines, rollouts=rollouts)
    _resume(run)
    prepare_held_out(run)
    run.bar = tqdm(total=trainer.max_steps, initial=state.start_step, disable=not run.main,
                   desc=bar_label(trainer.loss), dynamic_ncols=True)
    return run


def _task_teachers(teacher: TeacherSettings, task) -> dict:
    """Each task's teacher settings: the run's teacher.*, and in a mixture each task's task.teacher.<entry>.* over
    them (gpg_vl/train/teacher/build.py's `task_teachers`)."""
    mixed = isinstance(task, Mixture)
    return task_teachers(teacher, list(task.tasks) if mixed else None, task.teachers if mixed else None)


def _teacher_loader(model_cfg, device):
    """Load a teacher model (a folder or hub id, in its dtype) as the student's `model.*` load it (its processor
    settings), without LoRA (`frozen_teacher` then freezes every parameter)."""
    from omegaconf import OmegaConf

    def load(name_or_path: str, dtype: str) -> Policy:
        settings = OmegaConf.merge(model_cfg, {"name_or_path": name_or_path, "freeze_vision": False, "lora": {"r": 0},
                                              **({} if dtype == "auto" else {"dtype": dtype})})
        return build.build_policy(settings, device)

    return load


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


def _flat_scalars(config: dict, prefix: str = "") -> dict:
    """Trackers take flat scalar hyper-parameters: {"trainer": {"lr": 1}} -> {"trainer.lr": 1}."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flat_scalars(value, f"{prefix}{key}."))
        elif value is None or isinstance(value, (int, float, str, bool)):
            flat[f"{prefix}{key}"] = value
    return flat


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
