"""The registries of advantage estimators and policy losses: `register_advantage`, `register_policy_loss`
(a loss declares what it needs and may fix its aggregation), `get_advantage`, `get_policy_loss`."""

from __future__ import annotations

import functools
from collections.abc import Callable

from torch import Tensor

from gpg_vl.config.names import ADVANTAGE_BUILTINS, LOSS_BUILTINS
from gpg_vl.errors import UserError
from gpg_vl.objective.aggregation import AGGREGATIONS
from gpg_vl.registry import Registry

NEEDS = ("old", "ref")  # what a policy loss may declare: the rollout policy's and the reference's log-probs

Aggregation = Callable[..., Tensor]  # (per_token [N, L], mask [N, L], normalizer, max_tokens) -> loss []
AdvantageEstimator = Callable[[Tensor], tuple[Tensor, Tensor]]  # rewards [B, G] -> (advantages [B, G], valid [B])
PolicyLoss = Callable[..., tuple[Tensor, dict[str, float]]]
Normalizer = Callable[[float, float], float]  # (count over valid groups, count over all sampled groups) -> denominator

# the built-ins are defined below (gpg_vl/config/names.py lists them, as every kind's built-ins are listed)
ADVANTAGE_ESTIMATORS = Registry("advantage estimator", "trainer.advantage", builtins=ADVANTAGE_BUILTINS)
POLICY_LOSSES = Registry("policy loss", "trainer.loss", builtins=LOSS_BUILTINS)


def register_advantage(name: str):
    """Register ``fn(rewards [B, G]) -> (advantages [B, G], valid [B])`` as ``trainer.advantage=<name>``."""
    return ADVANTAGE_ESTIMATORS.register(name)


def register_policy_loss(name: str, *, needs: tuple[str, ...] = (), aggregation: str | None = None):
    """Register a policy loss as ``trainer.loss=<name>`` (signature in the module doc).

    `needs` lists what the trainer must compute for it ("old", "ref"); `aggregation`, when set, is the only
    aggregation the loss takes (the trainer normalizes by that aggregation's count), and its default when the
    loss is called directly.
    """
    unknown = sorted(set(needs) - set(NEEDS))
    if unknown:
        raise UserError(f"policy loss {name!r} needs {', '.join(unknown)}; a loss can need: {', '.join(NEEDS)}.")
    if aggregation is not None and aggregation not in AGGREGATIONS:
        raise UserError(f"policy loss {name!r} fixes aggregation {aggregation!r}; valid: {', '.join(AGGREGATIONS)}.")

    def register(loss: PolicyLoss) -> PolicyLoss:
        fixed = loss if aggregation is None else _with_aggregation(loss, name, aggregation)
        return POLICY_LOSSES.register(name, needs=tuple(needs), aggregation=aggregation)(fixed)

    return register


def _with_aggregation(loss: PolicyLoss, name: str, fixed: str) -> PolicyLoss:
    """`loss` with its registered aggregation as the default, so a direct call (`get_policy_loss(name)(...)`)
    computes what the trainer computes; another aggregation fails in one sentence."""

    @functools.wraps(loss)
    def aggregated(*args, aggregation: str = fixed, **kwargs):
        if aggregation != fixed:
            raise UserError(f"policy loss {name} aggregates as {fixed} only; it was called with "
                            f"aggregation={aggregation!r}.")
        return loss(*args, aggregation=fixed, **kwargs)

    return aggregated


def get_advantage(name: str) -> AdvantageEstimator:
    """The advantage estimator registered as `name`, or loaded from `module:fn` / `file.py:fn`."""
    return ADVANTAGE_ESTIMATORS.get(name)


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered as `name`, or loaded from `module:fn` / `file.py:fn` (an undecorated
    function needs nothing and takes any aggregation)."""
    return POLICY_LOSSES.get(name)


def loss_needs(loss: PolicyLoss) -> tuple[str, ...]:
    return tuple(getattr(loss, "needs", ()))


def loss_aggregation(loss: PolicyLoss, default: str) -> str:
    """The aggregation a loss fixes, else `default` (trainer.aggregation)."""
    return getattr(loss, "aggregation", None) or default
