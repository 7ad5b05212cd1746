"""Several tasks in one run (`task=mix`): the mixture, its prompt stream, and the checks made before the model loads.

    python scripts/train.py task=mix 'task.mixture={shapes: 0.5, motion: 0.5}'

A mixture entry is a task (a registered name, `module:Class` or `file.py:Class`) with its weight. Each task keeps
what makes it a task: its options (its config's `task.options`, then `task.options.<entry>.*`), its prompt format,
its tools, its rewards and judge, its images or video, its held-out split, the rollout settings it owns
(`TASK_ROLLOUT_KEYS`: its config's, then `task.rollout.<entry>.*`) and its teacher (`task.teacher.<entry>.*` over the
run's `teacher.*`: gpg_vl/train/teacher/build.py). Trainer settings are the run's.

Each prompt of a step is drawn from one task, chosen by weight from the mixture's own generator (seeded by the run's
seed); each task has its own prompt stream over its own train split. A prompt is one group, so a group never mixes
tasks; the trainer rolls each task's prompts out with that task's engine and settings (gpg_vl/train/step/sample.py), and
AGE and threshold resampling count the valid groups of the whole mixed batch. The checkpoint holds every task's
stream position and the mixture's generator, so a resumed run draws what the uninterrupted one draws.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from gpg_vl.data.stream import PromptStream
from gpg_vl.data.task import TASKS, Task, get_task
from gpg_vl.errors import UserError

# the rollout settings a task owns in a mixture (the others are the run's)
TASK_ROLLOUT_KEYS = ("max_new_tokens", "max_turns", "max_total_tokens", "max_images", "max_prompt_tokens", "on_limit",
                     "tool_seconds", "zoom_min_side", "zoom_max_aspect_ratio")
TASK_EVAL_KEYS = ("max_new_tokens",)  # evaluation settings a task owns in a mixture (its config's eval.*)
MIXTURE_SEED_OFFSET = 524_287  # the mixture's generator: seed * 100_003 + this
TASK_CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "task"


def mixture_weights(mixture) -> dict[str, float]:
    """`task.mixture` as {entry: weight}; one sentence for an empty mixture, a weight that is not a positive number
    (or all zero)."""
    if not isinstance(mixture, dict) or not mixture:
        raise UserError("task=mix needs task.mixture={name: weight, ...} with at least one task, such as "
                        "'task.mixture={shapes: 0.5, motion: 0.5}'.")
    weights = {}
    for entry, weight in mixture.items():
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight) or weight < 0:
            raise UserError(f"task.mixture.{entry}={weight!r} is not a positive weight; give each task a number > 0 "
                            "(its share of the prompts is its weight over their sum).")
        weights[str(entry)] = float(weight)
    if not any(weights.values()):
        raise UserError("every weight in task.mixture is zero, so no task would be drawn; give at least one task a "
                        "weight > 0.")
    zero = [entry for entry, weight in weights.items() if weight == 0]
    if zero:
        raise UserError(f"task.mixture.{zero[0]}=0 is not a positive weight; remove the task from the mixture or give "
                        "it a weight > 0.")
    return weights


def _entry_name(entry: str) -> str:
    """The name a mixture entry's settings may go under: a registered task's own, or the `name` of the class a
    `module:Class` / `file.py:Class` entry loads (a key path cannot spell the entry's dots and colon)."""
    if ":" not in entry:
        return entry
    try:
        return getattr(TASKS.get(entry), "name", "") or entry
    except UserError as error:
        raise UserError(f"task.mixture.{entry}: {error}") from None


def _by_entry(given: dict, names: dict[str, str]) -> dict:
    """`given` (task.options, task.rollout or task.data of a mixture) keyed by entry: a key that is a plugin entry's
    task name moves to its entry (merged under what the entry itself sets)."""
    found = dict(given)
    for entry, name in names.items():
        if name != entry and name in found and name not in names:
            found[entry] = {**dict(found.pop(name) or {}), **dict(found.get(entry) or {})}
    return found


def config_defaults(entry: str) -> tuple[dict, dict, dict]:
    """(options, owned rollout settings, owned eval settings) of configs/task/<entry>.yaml, when the task has a
    config file there."""
    path = TASK_CONFIGS / f"{entry}.yaml"
    if ":" in entry or not path.is_file():
        return {}, {}, {}
    from omegaconf import OmegaConf

    loaded = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    options = dict((loaded.get("task") or {}).get("options") or {})
    rollout = {k: v for k, v in (loaded.get("rollout") or {}).items() if k in TASK_ROLLOUT_KEYS}
    evaluation = {k: v for k, v in (loaded.get("eval") or {}).items() if k in TASK_EVAL_KEYS}
    return options, rollout, evaluation


class Mixture(Task):
    """Several tasks as one: `tasks` (name -> Task, in the mixture's order), their `weights` and the rollout settings
    each owns (`rollouts`: name -> {key: value}). Rows are never scored through it: each prompt is rolled out and
    scored by its own task."""

    name = "mix"

    def __init__(self, tasks: dict[str, Task], weights: dict[str, float], rollouts: dict[str, dict],
                 evals: dict[str, dict] | None = None, teachers: dict[str, dict] | None = None) -> None:
        super().__init__()
        self.tasks, self.weights, self.rollouts = tasks, weights, rollouts
        self.evals = evals or {name: {} for name in tasks}  # name -> its own eval settings (TASK_EVAL_KEYS)
        self.teachers = teachers or {}  # name -> its own teacher settings over the run's teacher.* (task.teacher)
        self.tools = tuple(dict.fromkeys(tool for task in tasks.values() for tool in task.tools))
        self.uses_boxes = any(task.uses_boxes for task in tasks.values())
        self.uses_points = any(task.uses_points for task in tasks.values())
        self.uses_judge = any(task.uses_judge for task in tasks.values())
        self.temporal = any(getattr(task, "temporal", False) for task in tasks.values())
        self.reward_functions = {name: fn for task in tasks.values() for name, fn in task.reward_functions.items()}

    @property
    def judge(self):
        return next((task.judge for task in self.tasks.values() if task.judge is not None), None)

    @judge.setter
    def judge(self, value) -> None:
        for task in getattr(self, "tasks", {}).values():
            if task.uses_judge:
                task.judge = value

    def load(self, split: str):
        raise NotImplementedError("a mixture's rows are each task's own: load them from `tasks`")

    def data_note(self, rows) -> str | None:
        notes = [f"{name}: {note}" for name, task in self.tasks.items()
                 if (note := task.data_note(rows[name])) is not None]
        return "\n".join(notes) or None


def build_mixture(mixture, options: dict | None, rollouts: dict | None, *, data: dict | None = None,
                  task_data: dict | None = None, teachers: dict | None = None) -> Mixture:
    """The Mixture of `task.mixture` (entry -> weight), each task built with its config's options updated by
    `options[entry]`, its owned rollout settings from its config updated by `rollouts[entry]`, its data.path and
    data.image_root from `task_data[entry]`, its own teacher settings `teachers[entry]` (checked where the teachers
    are built); `data`: the run's data.* (path and image root are one task's: refused in a mixture). Unknown tasks,
    bad weights, settings of no task in the mixture: one sentence each."""
    weights = mixture_weights(mixture)
    names = {entry: _entry_name(entry) for entry in weights}  # a plugin entry's settings go under its task's name
    options, rollouts, task_data, teachers = (_by_entry(dict(given or {}), names)
                                              for given in (options, rollouts, task_data, teachers))
    data = dict(data or {})
    for key, given in (("task.options", options), ("task.rollout", rollouts), ("task.data", task_data),
                       ("task.teacher", teachers)):
        stray = sorted(set(given) - set(weights))
        if stray:
            raise UserError(f"{key}.{stray[0]} names no task of task.mixture ({', '.join(weights)}); put each task's "
                            f"settings under its mixture entry or its task's name, {key}.<entry>.<key>=....")
    for key in ("path", "image_root"):
        if data.get(key) is not None:
            raise UserError(f"data.{key} points one task at its data, and task=mix trains several; set it per task "
                            f"as task.data.<entry>.{key}=....")
    tasks, owned, evals, taught = {}, {}, {}, {}
    for entry in weights:
        defaults, rollout, evaluation = config_defaults(entry)
        chosen = {**defaults, **dict(options.get(entry) or {})}
        unknown = sorted(set(rollouts.get(entry) or {}) - set(TASK_ROLLOUT_KEYS))
        if unknown:
            raise UserError(f"task.rollout.{entry}.{unknown[0]} is not a rollout setting a task owns; a task owns "
                            f"{', '.join(TASK_ROLLOUT_KEYS)}, and the others are the run's (rollout.*).")
        own = dict(task_data.get(entry) or {})
        stray = sorted(set(own) - {"path", "image_root"})
        if stray:
            raise UserError(f"task.data.{entry}.{stray[0]} is not a data setting a task owns; a task owns path and "
                            "image_root, the others are the run's (data.*).")
        if entry == Mixture.name:
            raise UserError(f"task.mixture cannot hold a mixture ({entry}); list its tasks directly.")
        if ":" not in entry and entry not in TASKS:
            raise UserError(f"unknown task {entry!r} in task.mixture; valid tasks: {', '.join(TASKS.names())} (or "
                            "name one from outside as module:Class or path/to/file.py:Class).")
        try:
            task = get_task(entry, data_path=own.get("path"), image_root=own.get("image_root"),
                            allow_outside_paths=bool(data.get("allow_outside_paths", False)),
                            max_video_frames=data.get("max_video_frames"), **chosen)
        except UserError as error:
            raise UserError(f"task.mixture.{entry}: {error}") from None
        name = task.name or entry
        if name in tasks:
            raise UserError(f"task.mixture names the task {name!r} twice; give each task once.")
        if name == Mixture.name:
            raise UserError("task.mixture cannot hold a mixture; list its tasks directly.")
        tasks[name] = task
        owned[name] = {**rollout, **dict(rollouts.get(entry) or {})}
        evals[name] = evaluation
        if teachers.get(entry):
            taught[name] = dict(teachers[entry])
    return Mixture(tasks, {task_name: weights[entry] for task_name, entry in zip(tasks, weights, strict=True)}, owned,
                   evals, taught)


def require_shared_run(mixture: Mixture, rollout, trainer) -> None:
    """The settings the tasks of a mixture must share, checked before the model loads: one sentence each."""
    differing = [name for name, owned in mixture.rollouts.items() if any(getattr(rollout, k) != v
                                                                          for k, v in owned.items())]
    if rollout.engine != "hf" and differing:
        raise UserError(f"task {differing[0]!r} sets its own rollout settings ({mixture.rollouts[differing[0]]}) and "
                        f"rollout.engine={rollout.engine} serves one set for the whole run; give every task the run's "
                        "rollout settings or use rollout.engine=hf.")
    if trainer.max_staleness:
        raise UserError("task=mix samples each task with its own engine in the learner's thread, and "
                        f"trainer.max_staleness={trainer.max_staleness} samples beside it; set "
                        "trainer.max_staleness=0.")
    temporal = [name for name, task in mixture.tasks.items() if getattr(task, "temporal", False)]
    if temporal:
        raise UserError(f"task {temporal[0]!r} has T-GRPO's temporal reward on, whose shuffled rollouts need every "
                        "prompt of a step from one video task; turn task.options.<entry>.temporal off in the mixture.")


class MixtureStream:
    """The prompts of a mixture: each prompt's task drawn by weight from the mixture's generator, then that task's
    next good prompt from its own `PromptStream`. `state_dict` holds every task's stream and the generator."""

    def __init__(self, mixture: Mixture, rows: dict[str, Sequence], *, seed: int, rank: int = 0, world_size: int = 1,
                 make_stream: Callable[[str, Sequence], PromptStream]) -> None:
        self.mixture, self.rank, self.world_size = mixture, rank, world_size
        self.names = list(mixture.tasks)
        self.streams = {name: make_stream(name, rows[name]) for name in self.names}
        self.weights = torch.tensor([mixture.weights[name] for name in self.names], dtype=torch.float64)  # [T]
        if not torch.isfinite(self.weights.sum()):  # each finite (mixture_weights), their sum not: the shares are
            self.weights = self.weights / self.weights.max()  # what count, so scale them first (else one task wins)
        self.generator = torch.Generator().manual_seed(seed * 100_003 + MIXTURE_SEED_OFFSET)
        self.drawn = dict.fromkeys(self.names, 0)  # prompts drawn per task (cumulative, global)
        self.bad = MixedBadRows(self.streams)

    def draw_tasks(self, count: int) -> list[str]:
        """The tasks of the next `count` prompts (global, the same on every process)."""
        picks = torch.multinomial(self.weights, count, replacement=True, generator=self.generator).tolist()
        return [self.names[i] for i in picks]

    def next_prompts(self, global_count: int, task=None) -> list:
        """This process's share of the next `global_count` good prompts, each tagged with its task (`Prompt.task`),
        grouped by task in the mixture's order."""
        chosen = self.draw_tasks(global_count)
        prompts = []
        for name in self.names:
            count = chosen.count(name)
            if not count:
                continue
            self.drawn[name] += count
            for prompt in self.streams[name].next_prompts(count, self.mixture.tasks[name]):
                prompt.task = name
                prompts.append(prompt)
        return prompts

    @property
    def records(self) -> bool:
        return any(s.sampler is not None and s.sampler.records for s in self.streams.values())

    def record(self, outcomes: Sequence[tuple[str | None, int, float]]) -> None:
        """Group outcomes (task, row, pass rate) for each task's sampler."""
        for name, index, rate in outcomes:
            self.streams[name].record([(name, index, rate)])

    @property
    def epoch(self) -> int:
        return min(stream.epoch for stream in self.streams.values())

    @property
    def position(self) -> int:
        return sum(self.drawn.values())

    def metrics(self) -> dict:
        found = {**self.bad.metrics(), "data_epoch": self.epoch, "data_position": self.position}
        for name, stream in self.streams.items():
            found.update({f"{name}/{key}": value for key, value in stream.metrics().items()
                          if not key.startswith(("bad_rows", "skipped_rows", "rows_seen"))})
            found[f"{name}/prompts_drawn"] = self.drawn[name]
        return found

    def state_dict(self) -> dict:
        return {"tasks": {name: stream.state_dict() for name, stream in self.streams.items()},
                "generator": self.generator.get_state(), "drawn": dict(self.drawn)}

    def load_state_dict(self, state: dict) -> None:
        if "tasks" not in state or set(state["tasks"]) != set(self.names):
            raise UserError(f"the checkpoint's data position is not of the mixture {', '.join(self.names)}; resume "
                            "with the same task.mixture.")
        for name, stream in self.streams.items():
            stream.load_state_dict(state["tasks"][name])
        self.generator.set_state(state["generator"])
        self.drawn = {name: int(state["drawn"][name]) for name in self.names}


class MixedBadRows:
    """The bad-row logs of a mixture's streams, as one: totals beside each task's, `<task>/bad_rows`."""

    def __init__(self, streams: dict[str, PromptStream]) -> None:
        self.streams = streams

    @property
    def bad(self) -> int:
        return sum(stream.bad.bad for stream in self.streams.values())

    def metrics(self) -> dict:
        totals: dict[str, float] = {}
        for name, stream in self.streams.items():
            for key, value in stream.bad.metrics().items():
                totals[key] = totals.get(key, 0) + value
                totals[f"{name}/{key}"] = value
        return totals

    def summary(self) -> dict:
        return {name: stream.bad.summary() for name, stream in self.streams.items()}

    def report(self, what: str = "rows") -> str:
        return "\n".join(stream.bad.report(f"{name} {what}") for name, stream in self.streams.items()
                         if stream.bad.bad)
