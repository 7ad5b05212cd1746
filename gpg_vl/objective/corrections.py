"""Off-policy corrections (`trainer.correction`), registered by name like losses, each a pure tensor function; the
on-policy check of an engine with its own weights (`logp_mismatch`); which correction an update applies
(`resolve_correction`, once per update).

A rollout sampled by a behaviour policy pi_b (an older weight version under trainer.max_staleness >= 1, or an
engine with its own kernels: vLLM) is trained on by the current policy pi_theta. Per token,
log rho_t = log pi_theta - log pi_b, pi_theta from the forward the update already runs (detached), pi_b the
engine's own log-probs at its sampling temperature (`Rollout.sampler_logps`). A correction turns rho into a
weight w [n, C] (no gradient) and may reject whole sequences. The weights are resolved once per update, from
pi_prox (the learner's policy before the update) against pi_b, and passed to the loss (`weights=`), which multiplies
its per-token term by them and never changes a ratio: GPG's loss becomes

    L = -1/N * sum_i 1/|o_i| * sum_t sg(w_i,t) * A_i * log pi_theta(o_i,t)

and a ratio loss's per-token term is sg(w) times its clipped surrogate, its ratio to pi_prox (AReaL's decoupled
objective, docs/async.md), over the sequences it keeps (N: the AGE normalizer, rejected sequences left out; see
`age_counts`).

Built in (ρ_seq = exp(sum_t log rho_t), ρ_geo = exp(mean_t log rho_t)):

- `none`: w = 1;
- `token_tis` (cap C): w_t = min(rho_t, C) (rollout.vllm.tis_cap / rollout.vllm_server.tis_cap is this correction
  with C = tis_cap);
- `sequence_tis` (cap C): w = min(ρ_seq, C) for every token of the sequence;
- `geo_reject` (delta): w = 1, the sequence rejected when ρ_geo leaves [1 - delta, 1 + delta] (verl's geo_rs);
- `topr`: TOPR's asymmetric rule, w = 1 when A >= 0, w = clip(ρ_seq, 0, 1) when A < 0.

A correction declares its options as keyword arguments with defaults (`correction_options` checks
trainer.correction_options against them) and `rejects=True` when it may reject sequences: the update then scores
pi_theta once before its optimizer step, so that the normalizer already leaves the rejected sequences out. It
returns (weights, rejected, capped): `capped` marks the tokens whose weight its rule set below the importance
ratio it stands for (its cap was reached), read by the `truncated_fraction` metric; a correction that returns
only (weights, rejected) is read as token-level (capped where w_t < rho_t).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from gpg_vl.config.names import CORRECTION_BUILTINS
from gpg_vl.errors import UserError
from gpg_vl.registry import Registry

# fn(log_ratio [n, C], mask [n, C] bool, advantages [n], **options)
#     -> (weights [n, C], rejected [n] bool, capped [n, C] bool)
Correction = Callable[..., tuple[Tensor, Tensor, Tensor]]
CORRECTIONS = Registry("off-policy correction", "trainer.correction", builtins=CORRECTION_BUILTINS)
CORRECTION_INPUTS = ("log_ratio", "mask", "advantages")


def register_correction(name: str, *, rejects: bool = False):
    """Register `fn(log_ratio, mask, advantages, **options) -> (weights, rejected, capped)` as
    trainer.correction=<name> (see the module doc); `rejects`: it may reject sequences (the update then scores the
    policy before its step)."""
    return CORRECTIONS.register(name, rejects=rejects)


def get_correction(name: str) -> Correction:
    """The correction registered as `name`, or loaded from `module:fn` / `file.py:fn`."""
    return CORRECTIONS.get(name)


def correction_options(name: str, given: dict | None) -> dict:
    """The options of trainer.correction=`name`: its declared defaults, overridden by `given`
    (trainer.correction_options); an option it does not declare fails in one sentence."""
    correction = get_correction(name)
    declared = {key: p.default for key, p in inspect.signature(correction).parameters.items()
                if p.default is not p.empty and key not in CORRECTION_INPUTS}
    unknown = sorted(set(given or {}) - set(declared))
    if unknown:
        raise UserError(f"trainer.correction_options.{unknown[0]}: correction {name} has no option {unknown[0]!r}; "
                        f"its options: {', '.join(sorted(declared)) or 'none'}.")
    return {**declared, **(given or {})}


def _sequence_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """[n]: sum over the counted tokens of log rho (log of the sequence's importance ratio)."""
    return torch.where(mask, log_ratio, torch.zeros_like(log_ratio)).sum(dim=1)


def _no_rejection(mask: Tensor) -> Tensor:
    return torch.zeros(mask.shape[0], dtype=torch.bool, device=mask.device)


def _uncapped(mask: Tensor) -> Tensor:
    return torch.zeros_like(mask, dtype=torch.bool)


@register_correction("none")
def no_correction(log_ratio: Tensor, mask: Tensor, advantages: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """w = 1: the rollout is trained on as if on-policy (nothing capped: no ratio is weighed)."""
    return torch.ones_like(log_ratio), _no_rejection(mask), _uncapped(mask)


@register_correction("token_tis")
def token_tis(log_ratio: Tensor, mask: Tensor, advantages: Tensor, *,
              cap: float = 2.0) -> tuple[Tensor, Tensor, Tensor]:
    """Token-level truncated importance sampling: w_t = min(rho_t, cap), capped where rho_t > cap. log_ratio,
    mask [n, C]."""
    ratio = torch.exp(log_ratio)
    return ratio.clamp(max=cap), _no_rejection(mask), (ratio > cap) & mask


@register_correction("sequence_tis")
def sequence_tis(log_ratio: Tensor, mask: Tensor, advantages: Tensor, *,
                 cap: float = 5.0) -> tuple[Tensor, Tensor, Tensor]:
    """Sequence-level truncated IS: w = min(prod_t rho_t, cap) on every token of the sequence, all of its tokens
    capped where the product exceeds the cap."""
    log_sequence = _sequence_log_ratio(log_ratio, mask)  # [n]
    weight = torch.exp(log_sequence.clamp(max=math.log(cap)))  # [n]
    capped = (log_sequence > math.log(cap)).unsqueeze(1) & mask
    return weight.unsqueeze(1).expand_as(log_ratio), _no_rejection(mask), capped


@register_correction("geo_reject", rejects=True)
def geo_reject(log_ratio: Tensor, mask: Tensor, advantages: Tensor, *,
               delta: float = 0.2) -> tuple[Tensor, Tensor, Tensor]:
    """Geometric-mean rejection: a sequence whose exp(mean_t log rho_t) leaves [1 - delta, 1 + delta] is rejected
    (it adds nothing to the gradient and leaves the normalizer); the others keep w = 1."""
    tokens = mask.sum(dim=1).clamp(min=1)  # [n]
    geometric = torch.exp(_sequence_log_ratio(log_ratio, mask) / tokens)  # [n]
    rejected = (geometric < 1.0 - delta) | (geometric > 1.0 + delta)
    return torch.ones_like(log_ratio), rejected & mask.any(dim=1), _uncapped(mask)


@register_correction("topr")
def topr(log_ratio: Tensor, mask: Tensor, advantages: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """TOPR (Tapered Off-Policy REINFORCE): no weight on positive advantages (w = 1), clip(prod_t rho_t, 0, 1) on
    negative ones, per sequence; capped: the negative ones whose product exceeds 1 (a positive one weighs no
    ratio, so nothing of it is capped)."""
    log_sequence = _sequence_log_ratio(log_ratio, mask)  # [n]
    negative = advantages.to(log_ratio.device) < 0  # [n]
    clipped = torch.exp(log_sequence.clamp(max=0.0))  # [n] in (0, 1]
    weight = torch.where(negative, clipped, torch.ones_like(clipped))  # [n]
    capped = (negative & (log_sequence > 0)).unsqueeze(1) & mask
    return weight.unsqueeze(1).expand_as(log_ratio), _no_rejection(mask), capped


def logp_mismatch(trainer_logps: Tensor, sampler_logps: Tensor, mask: Tensor) -> tuple[float, float, int]:
    """The on-policy check of an engine that samples with its own kernels (vLLM: its bf16 rounding differs): (sum,
    max, count) of |sampler - trainer| log-probs over the tokens where `mask` is True (the trainer logs the mean and
    the max each step). trainer_logps, sampler_logps [N, C] (any float dtype), mask [N, C] bool."""
    mask = mask.bool()
    gap = (sampler_logps.double() - trainer_logps.detach().double()).abs()[mask]  # [T]
    if gap.numel() == 0:
        return 0.0, 0.0, 0
    return float(gap.sum()), float(gap.max()), int(gap.numel())


@dataclass(frozen=True)
class ActiveCorrection:
    """The correction an update applies, worked out once (`resolve_correction`): its name and options, whether it
    may reject sequences (the update then scores pi_prox before its first step), and whether the update reports
    the correction's metrics (on every process alike: they depend on the settings only)."""

    name: str = "none"
    options: dict = field(default_factory=dict)
    rejects: bool = False
    reports: bool = False

    @property
    def weighs(self) -> bool:
        """Whether the loss gets weights: every correction but `none`."""
        return self.name != "none"


def resolve_correction(name: str, options: dict | None, *, engine_cap: float = 0.0,
                       stale: bool = False) -> ActiveCorrection:
    """trainer.correction=`name` with `options` (trainer.correction_options); `none` with an engine's tis_cap > 0
    (rollout.vllm.tis_cap, the engine's on-policy correction) is token_tis with that cap. `stale`: the rollouts may
    be older than the learner (trainer.max_staleness >= 1, the pipeline's), which reports the metrics even
    without a correction."""
    if name == "none" and engine_cap > 0:
        name, options = "token_tis", {"cap": engine_cap}
    else:
        options = correction_options(name, options)
    rejects = bool(getattr(get_correction(name), "rejects", False))
    return ActiveCorrection(name, options, rejects, reports=stale or name != "none")


def apply_correction(name: str, options: dict, logps: Tensor, behaviour: Tensor, mask: Tensor,
                     advantages: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(weights [n, C], rejected [n], capped [n, C]) of trainer.correction=`name` for the current log-probs `logps`
    [n, C] (only their values: no gradient flows) and the behaviour ones [n, C] over `mask` [n, C]; weights are 1
    on tokens outside the mask and 0 on rejected sequences, capped only on the mask's kept tokens."""
    mask = mask.bool()
    log_ratio = torch.where(mask, logps.detach().float() - behaviour.float(), torch.zeros_like(behaviour.float()))
    returned = get_correction(name)(log_ratio, mask, advantages.detach(), **options)
    weights, rejected = returned[0], returned[1].bool()
    # a correction that does not say what it capped is read as token-level: capped where w_t < rho_t
    capped = returned[2].bool() if len(returned) > 2 else weights.float() < torch.exp(log_ratio) * (1 - 1e-6)
    kept = mask & ~rejected.unsqueeze(1)
    weights = torch.where(kept, weights.float(), torch.zeros_like(log_ratio))
    weights = torch.where(mask, weights, torch.ones_like(weights))
    return weights.detach(), rejected, capped & kept


@dataclass
class CorrectionSums:
    """What one process's micro-batches add up for the step's correction metrics."""

    tokens: float = 0.0
    kept: float = 0.0  # tokens of sequences not rejected
    weight_sum: float = 0.0
    weight_max: float = 0.0
    truncated: float = 0.0  # tokens the correction capped (`apply_correction`)
    sequences: float = 0.0
    rejected: float = 0.0
    kl: float = 0.0  # k3(pi_theta, pi_b) summed over tokens

    def add(self, logps: Tensor, behaviour: Tensor, mask: Tensor, weights: Tensor, rejected: Tensor,
            capped: Tensor) -> None:
        """Add one micro-batch: logps, behaviour, weights [n, C], mask [n, C] bool, rejected [n] bool, capped [n, C]
        bool (the correction's capped tokens)."""
        mask = mask.bool()
        delta = behaviour.float() - logps.detach().float()  # log pi_b - log pi_theta
        kept = mask & ~rejected.unsqueeze(1)
        self.tokens += float(mask.sum())
        self.kept += float(kept.sum())
        self.weight_sum += float(weights[kept].sum())
        self.weight_max = max(self.weight_max, float(weights[kept].max()) if kept.any() else 0.0)
        self.truncated += float((capped.bool() & kept).sum())
        self.sequences += float(mask.any(dim=1).sum())
        self.rejected += float(rejected.sum())
        k3 = torch.exp(delta) - delta - 1.0  # [n, C] >= 0: k3 estimate of KL(pi_theta || pi_b) on pi_theta's samples
        self.kl += float(k3[mask].sum())

    def as_list(self) -> list[float]:
        return [self.tokens, self.kept, self.weight_sum, self.weight_max, self.truncated, self.sequences,
                self.rejected, self.kl]


CORRECTION_METRICS = ("is_weight_mean", "is_weight_max", "truncated_fraction", "rejected_fraction", "behaviour_kl")


def correction_metrics(rows: Tensor) -> dict[str, float]:
    """The step's metrics from every process's `CorrectionSums.as_list()` rows [processes, 8]."""
    tokens, kept, weights, _, truncated, sequences, rejected, kl = rows.sum(0).tolist()
    return {"is_weight_mean": weights / kept if kept else 1.0, "is_weight_max": float(rows[:, 3].max()),
            "truncated_fraction": truncated / max(tokens, 1.0), "rejected_fraction": rejected / max(sequences, 1.0),
            "behaviour_kl": kl / max(tokens, 1.0)}


@dataclass(frozen=True)
class AgeCounts:
    """AGE's counts once staleness and the correction have acted: B (groups sampled, minus those dropped as too
    stale), M (groups without signal, plus those whose sequences were all rejected), the loss normalizer
    (sequences of the other groups, rejected ones left out) and alpha = B / (B - M)."""

    groups: int
    without_signal: int
    normalizer: int
    alpha: float


def age_counts(valid: Tensor, rejected: Tensor, stale: Tensor | None = None) -> AgeCounts:
    """AGE's counts for groups `valid` [g] bool, rejected sequences `rejected` [g, G] bool and groups dropped as
    too stale `stale` [g] bool (None: none). The reference the update's normalizer is tested against."""
    stale = torch.zeros_like(valid) if stale is None else stale.bool()
    kept = ~stale
    all_rejected = rejected.all(dim=1)
    groups = int(kept.sum())
    without_signal = int((kept & (~valid | all_rejected)).sum())
    normalizer = int(((kept & valid).unsqueeze(1) & ~rejected).sum())
    alpha = groups / (groups - without_signal) if groups > without_signal else 0.0
    return AgeCounts(groups, without_signal, normalizer, alpha)
