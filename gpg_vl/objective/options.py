"""A loss's options: what it declares (its keyword parameters with defaults), and the values it is called with;
DAPO's overlong penalty."""

from __future__ import annotations

import inspect
from typing import Annotated

import torch
from torch import Tensor

from gpg_vl.config.keys import option
from gpg_vl.config.rules import check_options
from gpg_vl.errors import UserError
from gpg_vl.objective.registry import PolicyLoss

# what the trainer passes every loss (`weights`: the off-policy correction's, only when one is in force)
LOSS_INPUTS = ("old_logps", "ref_logps", "aggregation", "normalizer", "weights")

# What the built-in losses' options allow, declared beside their defaults (`loss_options` checks them).
ClipLow = Annotated[float, option("the ratio clipped below at 1 - clip_low", low=0, below=1)]
ClipHigh = Annotated[float | None, option("the ratio clipped above at 1 + clip_high; null = clip_low", low=0,
                                          below=1)]
MaskThreshold = Annotated[float | None, option("the sequence KL above which a negative-advantage sequence is "
                                               "masked; null = off", low=0)]
CapOption = Annotated[float, option("the most weight a token gets", above=0)]
KlCoef = Annotated[float, option("beta of the k3 KL to the reference", low=0)]
Temperature = Annotated[float, option("the soft gate's temperature", above=0)]
VespoShape = Annotated[float, option("the gamma weight's shape k", low=0)]
VespoRate = Annotated[float, option("the gamma weight's rate lambda", above=0)]


def declared_options(loss: PolicyLoss) -> dict[str, object]:
    """The options `loss` declares: its keyword parameters with a default, other than `LOSS_INPUTS`, and
    those defaults."""
    return {name: p.default for name, p in inspect.signature(loss).parameters.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is not p.empty
            and name not in LOSS_INPUTS}


def loss_options(loss: PolicyLoss, given: dict, defaults: dict, *, name: str | None = None) -> dict:
    """The keyword options to call `loss` with. Each option it declares takes its value from `given`
    (trainer.loss_options), else from `defaults` (the trainer's settings of that name: clip_low, clip_high,
    kl_coef; max_tokens = rollout.max_new_tokens), else keeps the loss's own default. A loss that also takes
    `**kwargs` gets every default it does not declare (what it may forward). A key of `given` that the loss
    does not declare fails in one sentence naming the loss and its options; a value outside what the loss declares
    for it (`Annotated[float, option(..., above=0)]`, gpg_vl/config/rules.py's `check_options`) in one naming
    the option and what it allows."""
    declared = declared_options(loss)
    unknown = sorted(set(given) - set(declared))
    if unknown:
        label = name or getattr(loss, "__name__", "the loss")
        raise UserError(f"trainer.loss_options.{unknown[0]}: loss {label} has no option {unknown[0]!r}; its options: "
                        f"{', '.join(sorted(declared)) or 'none'}.")
    check_options(loss, given, prefix="trainer.loss_options", owner=f"loss {name or getattr(loss, '__name__', '')}")
    chosen = {key: given[key] if key in given else defaults.get(key, default) for key, default in declared.items()}
    takes_more = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(loss).parameters.values())
    return {**({k: v for k, v in defaults.items() if k not in declared} if takes_more else {}), **chosen}


def overlong_penalty(lengths: Tensor, max_tokens: int, cache: int) -> Tensor:
    """DAPO's soft overlong punishment. lengths [N] -> [N] in [-1, 0]: 0 up to ``max_tokens - cache`` tokens,
    then linearly down to -1 at ``max_tokens`` (and -1 beyond)."""
    if not 0 < cache <= max_tokens:
        raise ValueError(f"need 0 < cache <= max_tokens, got cache={cache}, max_tokens={max_tokens}")
    return ((max_tokens - cache - lengths.to(torch.float64)) / cache).clamp(min=-1.0, max=0.0)


def takes_weights(loss: PolicyLoss) -> bool:
    """Whether `loss` takes the off-policy correction's `weights` (it names them, or takes `**kwargs`)."""
    parameters = inspect.signature(loss).parameters
    return "weights" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())
