"""Prompt samplers (`data.sampler`): which rows of its walk the prompt stream (gpg_vl/data/stream.py) takes.

The stream walks a seeded permutation of the split, epoch after epoch; a sampler decides, row by row, whether the
walk takes the row now or defers it to a later epoch. Registered by name:

- `uniform` (the default): every row is taken; the stream is the plain permutation walk, as it always was.
- `difficulty`: prompts are drawn by what they still teach. Each prompt's pass rate (the share of its group's
  completions whose `accuracy` reward is 1) is kept for its last `data.difficulty_window` groups. A prompt whose
  last groups were all all-right or all all-wrong (pass rate 1 or 0 every time: no reward variance, no signal for
  GPG) is "settled": the walk takes it with probability `data.difficulty_keep` and otherwise defers it to the next
  epoch, where it is offered again. So settled prompts come back less often and never vanish; one that is drawn
  again and turns informative is unsettled. This is prime-rl's difficulty pools (a zero-advantage group sends its
  problem to the easy pool at reward 1, the hard pool at reward 0; the pools are then drawn at set fractions) as a
  per-prompt rule, and, like VL-Rethinker's selective sample replay, it spends rollouts on the prompts whose groups
  still carry advantage.

A sampler's state (pass rates, its generator) goes into the stream's state, hence the checkpoint: a resumed run
draws exactly what the uninterrupted one draws. With a task mixture each task's stream has its own sampler, so the
rates are kept per task.
"""

from __future__ import annotations

import torch

from gpg_vl.config.names import SAMPLER_BUILTINS
from gpg_vl.registry import Registry

SAMPLER_SEED_OFFSET = 7_919  # the difficulty sampler's generator: seed * 100_003 + this


class UniformSampler:
    """Every row of the walk is taken (the default; draws nothing, holds nothing)."""

    name = "uniform"
    records = False  # whether the trainer reports group outcomes to it

    def __init__(self, size: int, *, seed: int, keep: float = 0.25, window: int = 2) -> None:
        self.size = size

    def take(self, index: int) -> bool:
        return True

    def record(self, index: int, pass_rate: float) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class DifficultySampler:
    """Settled prompts (pass rate 0 or 1 on each of their last `window` groups) are taken with probability `keep`,
    else deferred to the next epoch; the others always (see the module doc)."""

    name = "difficulty"
    records = True

    def __init__(self, size: int, *, seed: int, keep: float = 0.25, window: int = 2) -> None:
        self.size, self.keep, self.window = size, float(keep), int(window)
        self.rates: dict[int, list[float]] = {}  # row -> its last `window` pass rates, oldest first
        self.generator = torch.Generator().manual_seed(seed * 100_003 + SAMPLER_SEED_OFFSET)
        self.deferred = 0  # rows the walk passed over (cumulative)

    def settled(self, index: int) -> bool:
        rates = self.rates.get(index)
        return bool(rates) and all(rate in (0.0, 1.0) for rate in rates)

    def take(self, index: int) -> bool:
        if not self.settled(index):
            return True
        taken = bool(torch.rand((), generator=self.generator) < self.keep)
        self.deferred += not taken
        return taken

    def record(self, index: int, pass_rate: float) -> None:
        rates = self.rates.setdefault(int(index), [])
        rates.append(float(pass_rate))
        del rates[:-self.window]

    def metrics(self) -> dict[str, float]:
        """How many prompts are settled now, and how many draws were deferred so far."""
        return {"sampler/settled": sum(self.settled(i) for i in self.rates), "sampler/deferred": self.deferred}

    def state_dict(self) -> dict:
        return {"rates": {str(k): list(v) for k, v in self.rates.items()}, "deferred": self.deferred,
                "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.rates = {int(k): [float(r) for r in v] for k, v in state["rates"].items()}
        self.deferred = int(state["deferred"])
        self.generator.set_state(state["generator"])


# the built-ins are gpg_vl/config/names.py's SAMPLER_BUILTINS; `module:Class` / `file.py:Class` load a sampler
SAMPLERS = Registry("prompt sampler", "data.sampler", builtins=SAMPLER_BUILTINS,
                    accepts=lambda obj: isinstance(obj, type), expects="a sampler class")


def build_sampler(name: str, size: int, *, seed: int, keep: float = 0.25, window: int = 2):
    """The sampler `data.sampler` names, for a split of `size` rows."""
    return SAMPLERS.get(name)(size, seed=seed, keep=keep, window=window)


def group_pass_rates(accuracy: torch.Tensor | None, rewards: torch.Tensor) -> list[float]:
    """Each group's pass rate [b]: the share of its completions whose `accuracy` [b, G] is 1; a task without an
    accuracy reward: 1 or 0 when the group's rewards [b, G] are all equal (all at its best or not: no signal either
    way), 0.5 when they differ."""
    if accuracy is not None:
        return (accuracy == 1).float().mean(dim=1).tolist()
    same = (rewards == rewards[:, :1]).all(dim=1)
    return [0.0 if bool(s) else 0.5 for s in same]
