"""A training run's parts: what it is asked (`RunSettings`), its data (`RunData`), its record (`RunState`), and the
`Run` that `setup` builds once and `train` advances (gpg_vl/train/loop.py)."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from accelerate import Accelerator

from gpg_vl.config.schema import EvalSettings, RolloutSettings, TeacherSettings, TrainerSettings
from gpg_vl.data.stream import PromptStream
from gpg_vl.errors import UserError
from gpg_vl.files import write_atomic
from gpg_vl.train.checkpoint.folder import writing
from gpg_vl.train.step.update import Learner


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
    sampler: str = "uniform"  # data.sampler (gpg_vl/data/samplers.py)
    difficulty_keep: float = 0.25  # data.difficulty_keep
    difficulty_window: int = 2  # data.difficulty_window
    teacher: TeacherSettings = field(default_factory=TeacherSettings)  # teacher.*: on-policy distillation


@dataclass
class RunData:
    """The data side: the task, the training prompt stream, the held-out rows and how they are evaluated."""

    task: object
    stream: PromptStream
    eval_rows: object
    eval_kwargs: dict
    reward_names: list[str]  # the task's reward components, "temporal" (T-GRPO), "overlong" (DAPO's shaping)
    engines: dict = field(default_factory=dict)  # task=mix: each task's engine (its tools, its rollout settings)
    rollouts: dict = field(default_factory=dict)  # task=mix: each task's rollout settings (the run's + its own)
    eval_sets: dict = field(default_factory=dict)  # task=mix: name -> (task, held-out rows, evaluate's keywords)


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
    held: contextlib.ExitStack  # the output folder's claim (train/checkpoint/outdir.py), released when the run ends
    warned: set[str] = field(default_factory=set)
    pipeline: object = None  # samples each step (train/step/pipeline.py): in this thread, or beside the learner

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
