"""Rollout engines: what samples the G completions of each prompt, behind one seam.

An engine takes `EnginePrompts` (the family's `PromptBatch` plus the raw chat messages with their images, so
each engine renders them its own way), a group size G and a `Sampling`, and returns a `Rollout` (B x G
completions, row b * G + g the g-th of prompt b). After every optimizer step the trainer calls `sync(model)`
(an engine that keeps its own copy of the weights pushes the new ones in); `sleep()` / `wake()` free and
take back an engine's memory around the update where it has such a mode.

Engines register by name (`register_engine`) and `rollout.engine` picks one (or loads one from outside:
`module:Name`, `path.py:Name`); the built-ins are imported on first use:

- `hf` (rollout/hf.py): the trained model itself, through gpg-vl's decode loop or transformers' `generate`;
- `vllm` (rollout/vllm/colocated.py): a colocated vLLM engine in every training process (CUDA only).

An engine owns its settings: its `settings_class` (a dataclass of `meta` fields, gpg_vl/config/keys.py) is the
section `rollout.<name>.*`, typed, checked and documented from that declaration; `settings_in(rollout)` reads
the engine's section of a run's settings. The built-ins' are in gpg_vl/rollout/settings.py (light: the config
reads them before torch loads), an out-of-tree engine's in its own file.

`require_engine` checks, when the config is loaded (before any model loads), that the chosen engine can run
here, and says in one sentence what is missing otherwise; it reads the settings and this machine only, so that
printing or checking a config contacts no server. `require_reachable`, when a run or an evaluation starts (still
before the model loads), checks that what the engine samples on answers.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

from gpg_vl.config.names import ENGINE_BUILTINS
from gpg_vl.errors import UserError
from gpg_vl.models.batch import PromptBatch
from gpg_vl.registry import Registry
from gpg_vl.rollout.multiturn.trajectory import MultiTurnSettings
from gpg_vl.rollout.types import Rollout


class EngineUnreachable(UserError):
    """An engine that samples elsewhere (a vLLM server) could not be reached within its time limit: the run writes a
    checkpoint and stops with this sentence (gpg_vl/train/loop.py)."""


@dataclass(frozen=True)
class Sampling:
    """How an engine samples: the same fields for every engine."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False  # argmax decoding (evaluation); temperature and top_p are then unused
    ignore_eos: bool = False  # always max_new_tokens tokens (EOS is never sampled)

    @classmethod
    def from_settings(cls, rollout) -> Sampling:
        """The sampling of `rollout.*` (RolloutSettings)."""
        return cls(max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature, top_p=rollout.top_p,
                   ignore_eos=rollout.ignore_eos)


_LOCAL = threading.local()


def sampling_generator():
    """The calling thread's own torch.Generator (`thread_generator`), else None: torch's global one. The asynchronous
    sampler (gpg_vl/train/step/pipeline.py) samples beside the learner, whose gradient checkpointing forks and restores
    the global generator, so it draws from a generator of its own, which its checkpoints hold."""
    return getattr(_LOCAL, "generator", None)


@contextlib.contextmanager
def thread_generator(generator):
    """Within the block, this thread's sampling draws (`next_tokens`, T-GRPO's shuffles) come from `generator`."""
    previous = sampling_generator()
    _LOCAL.generator = generator
    try:
        yield generator
    finally:
        _LOCAL.generator = previous


@dataclass(frozen=True)
class Correction:
    """What the update does with the sampler's own log-probs (gpg_vl/objective/corrections.py): `sampler_check`
    compares them with the trainer's (`logp_mismatch_mean` / `_max`), and with `tis_cap` > 0 each token's loss
    is weighted by its truncated importance weight. An engine that samples with the trained model (HF): neither."""

    sampler_check: bool = False
    tis_cap: float = 0.0


@dataclass
class EnginePrompts:
    """Prompts as they reach an engine: the family's encoded batch, and the messages it was encoded from
    (None for a placeholder of the collectives, which only the HF engine decodes)."""

    batch: PromptBatch
    messages: list[list[dict]] | None = None

    def __len__(self) -> int:
        return len(self.batch)

    def select(self, indices: list[int]) -> EnginePrompts:
        messages = [self.messages[i] for i in indices] if self.messages is not None else None
        return EnginePrompts(self.batch.select(indices), messages)


def encode_prompts(policy, messages: list[list[dict]], ids: list[str] | None = None,
                   tools: list[dict] | None = None) -> EnginePrompts:
    """Messages -> EnginePrompts, encoded by the policy's family; `tools`: the function schemas the prompts list
    (`Engine.prompt_tools`)."""
    return EnginePrompts(policy.family.encode(messages, ids=ids, tools=tools), messages)


class Engine:
    """The engine protocol. `generate` is required; an engine without its own weights (HF) keeps the no-op
    `sync`, and one without a sleep mode the no-op `sleep` / `wake`."""

    name = "engine"
    settings_class: type | None = None  # the dataclass of `rollout.<name>.*` (None: the engine has no settings)
    returns_logps = False  # whether Rollout.sampler_logps is filled: the behaviour log-probs trainer.correction reads
    own_weights = False  # whether it samples with weights of its own (vLLM), which `sync` pushes in
    multi_turn = False  # whether it can roll out trajectories with tools (rollout.max_turns > 1)
    # set by `build_engine`: the multi-turn settings (rollout.max_turns, ...) and the tools the task offers
    multiturn: MultiTurnSettings = MultiTurnSettings()
    tools: tuple[str, ...] = ()

    def generate(self, prompts: EnginePrompts, group_size: int, sampling: Sampling) -> Rollout:
        raise NotImplementedError

    @property
    def correction(self) -> Correction:
        """The on-policy check and correction the update applies to this engine's rollouts (none by default)."""
        return Correction()

    def mismatch_warning(self, metrics: dict) -> str | None:
        """A warning when a step's `logp_mismatch_mean` says the rollout was off-policy (None: nothing to say)."""
        return None

    def sync(self, model, version: int) -> None:
        """Take the trained model's weights, those after step `version` (the number the pipeline owns, the run's
        step, so that a resumed run labels its weights as the uninterrupted one did: gpg_vl/train/step/pipeline.py)."""

    def sleep(self) -> None:
        """Free the engine's memory while the update runs."""

    def wake(self) -> None:
        """Take the memory back before the next rollout."""

    def take_tools(self, settings: MultiTurnSettings, tools: tuple[str, ...]) -> None:
        """Take the run's multi-turn settings and the task's tools (an engine checks here, in one sentence, that its
        model can run them)."""
        from gpg_vl.rollout.multiturn.tools import with_tool_stops

        self.multiturn, self.tools = with_tool_stops(settings, tuple(tools)), tuple(tools)

    def prompt_tools(self, task) -> list[dict] | None:
        """The function schemas a prompt lists for the model (multi-turn rollouts of a task that does not describe
        its tools in its own prompt), else None."""
        if not (self.multiturn.multi_turn and self.tools and getattr(task, "describe_tools", True)):
            return None
        from gpg_vl.rollout.multiturn.tools import TOOLS, tool_schema

        return [tool_schema(TOOLS.get(name)) for name in self.tools]

    @classmethod
    def settings_in(cls, rollout):
        """This engine's settings in `rollout` (RolloutSettings): its section `rollout.<name>`, or the defaults of
        its `settings_class` where the run's settings hold none (None for an engine without settings)."""
        if cls.settings_class is None:
            return None
        section = getattr(rollout, cls.name, None)
        if isinstance(section, dict):
            return cls.settings_class(**section)
        return section if section is not None else cls.settings_class()

    @classmethod
    def unavailable(cls, settings) -> str | None:
        """One sentence saying why this engine cannot run here with these settings (None when it can), from the
        settings and this machine alone: the config's checks call it, and printing or checking a config contacts
        nothing."""
        return None

    @classmethod
    def unreachable(cls, rollout) -> str | None:
        """One sentence saying why what this engine samples on does not answer (a server), else None; called once a
        run or an evaluation starts, before the model loads (`require_reachable`)."""
        return None

    @classmethod
    def asynchronous_problem(cls, rollout, max_staleness: int) -> str | None:
        """One sentence saying why this engine cannot sample beside the learner (trainer.max_staleness >= 1) with
        these settings, else None."""
        return None


def _is_engine(obj) -> bool:
    return isinstance(obj, type) and issubclass(obj, Engine)


# The built-in engines, imported on first use (`ENGINES.get`): no module imports them just to register them.
ENGINES = Registry("rollout engine", "rollout.engine", builtins=ENGINE_BUILTINS, accepts=_is_engine,
                   expects="an Engine subclass")


def register_engine(engine: type[Engine]) -> type[Engine]:
    """Register an Engine subclass under its `name`; usable as a class decorator. A second engine under a
    taken name raises."""
    if not _is_engine(engine):
        raise UserError(f"register_engine needs an Engine subclass with a `name`; got {engine!r}.")
    return ENGINES.register(engine)


def logp_mismatch_warning(metrics: dict, limit: float, *, sampler: str, section: str, checks: str) -> str | None:
    """The sentence of an engine that samples with weights of its own (`Engine.mismatch_warning`) when a step's
    `logp_mismatch_mean` is over `limit` (`<section>.max_logp_mismatch`), else None. `sampler` names who sampled
    ("the sampler's"), `checks` what to check."""
    if metrics.get("logp_mismatch_mean", 0.0) <= limit:
        return None
    return (f"{sampler} log-probs differ from the trainer's by {metrics['logp_mismatch_mean']:.4f} per token on "
            f"average, over {section}.max_logp_mismatch={limit}: the rollout is off-policy; check {checks}, or set "
            f"{section}.tis_cap=2.")


def require_engine(rollout) -> type[Engine]:
    """The engine class `rollout.engine` names (a registered name, `module:Name` or `file.py:Name`), after
    checking that it can run here (else one sentence)."""
    engine = ENGINES.get(rollout.engine)
    reason = engine.unavailable(rollout)
    if reason is not None:
        raise UserError(reason)
    return engine


def require_reachable(rollout) -> None:
    """What the engine `rollout.engine` samples on answers (a vLLM server's /health), else one sentence: a run or
    an evaluation calls it before the model loads; the config's checks do not (`require_engine`)."""
    reason = require_engine(rollout).unreachable(rollout)
    if reason is not None:
        raise UserError(reason)


def build_engine(rollout, policy, *, accelerator=None, tools: tuple[str, ...] = ()) -> Engine:
    """The engine of `rollout.*` for `policy` (the HF engine samples with `policy.model` itself). With
    rollout.max_turns > 1 it rolls out trajectories that may call `tools` (the task's `Task.tools`); an engine that
    cannot, a tool that is not registered or a task without tools: one sentence, before any sampling."""
    engine_class = require_engine(rollout)
    settings = MultiTurnSettings.from_rollout(rollout)
    if settings.multi_turn:
        require_tools(rollout, engine_class, tools)
    engine = engine_class(policy, rollout, accelerator=accelerator)
    engine.take_tools(settings, tools)
    return engine


def prepare_tools(rollout, tools: tuple[str, ...]) -> None:
    """Before the model loads: the offered tools' own preparation with rollout.max_turns > 1 (the python tool starts
    its sandbox's warm pool; a sandbox that cannot start is one sentence): tools.prepare_tools."""
    from gpg_vl.rollout.multiturn.tools import prepare_tools as prepare

    prepare(rollout, tools)


def require_tools(rollout, engine_class: type[Engine], tools: tuple[str, ...]) -> None:
    """rollout.max_turns > 1 needs an engine that rolls out trajectories and a task offering registered tools."""
    from gpg_vl.rollout.multiturn.tools import TOOLS

    if not engine_class.multi_turn:
        raise UserError(f"rollout.engine={rollout.engine} cannot roll out trajectories with tools "
                        f"(rollout.max_turns={rollout.max_turns}); use rollout.engine=hf or rollout.max_turns=1.")
    if not tools:
        raise UserError(f"rollout.max_turns={rollout.max_turns} needs a task that offers tools (Task.tools), and "
                        "this one offers none; set rollout.max_turns=1 or pick a task with tools.")
    for name in tools:
        TOOLS.get(name)  # an unknown tool: one sentence naming it and the registered ones

