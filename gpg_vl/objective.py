"""GPG objective (arXiv 2504.02546): group advantages and the policy-gradient loss.

For each prompt we sample G completions o_1..o_G with scalar rewards r_i.

* Advantage (F_norm = 1, the GPG default): ``A_i = r_i - mean(r)``.  GRPO's variant, registered as
  "std_normalized": ``A_i = (r_i - mean(r)) / (std(r) + 1e-4)`` with torch's default (Bessel-corrected)
  sample std, as TRL, verl, EasyR1 and R1-V compute it.
* A group is *valid* when its *population* std (``unbiased=False``) is ``> eps``.  Invalid groups (all
  rewards equal, G == 1, or any non-finite reward) get zero advantages, never NaN.
* Loss (no ratio, no clipping, no KL), "seq_mean_token_mean" (the paper's formula)::

      L = -1/N * sum_i 1/|o_i| * sum_t logp(o_i,t) * A_i

  "token_mean" instead divides the sum over all unmasked tokens by their total count T.
* AGE (accurate gradient estimation): with B groups of which M are invalid, the paper scales
  the batch-mean gradient by ``alpha = B / (B - M)``.  Invalid groups contribute exactly zero,
  so the mean over the B*G sequences times alpha equals the mean over the (B-M)*G valid
  sequences.  The trainer therefore feeds only sequences of valid groups to ``policy_loss``;
  ``age_alpha`` is kept for logging and for checking that identity.
* Micro-batching / multi-process: pass ``normalizer`` = the *global* denominator (number of
  sequences, or of unmasked tokens for "token_mean"); summing the per-micro-batch losses then
  equals the full-batch loss, and so do the summed gradients.

Variants, each a pure function registered by name (``register_advantage``, ``register_policy_loss``) and
picked by ``trainer.advantage`` / ``trainer.loss``; ``module:fn`` or ``file.py:fn`` loads one defined
outside the project.  The public contract::

    get_advantage(name)    # -> fn(rewards [B, G]) -> (advantages [B, G], valid [B])
    get_policy_loss(name)  # -> fn(token_logps, completion_mask, advantages, *, old_logps=None, ref_logps=None,
                           #       aggregation=<registered>, normalizer=None, **options) -> (loss, metrics)

A loss registered with an aggregation takes it as its default (and refuses any other), so a direct call
computes what the trainer computes; without one, the default is "seq_mean_token_mean".

A loss declares what it needs (``needs``: "old" = the rollout policy's log-probs, "ref" = the frozen
reference model's) and may fix its aggregation; the trainer computes only what the chosen loss declares.
``old_logps=None`` means on-policy: the old log-probs are the current ones, detached (ratio 1).  Losses:
"gpg" (the objective above; needs nothing), "grpo" (ratio clipping + k3 KL to the reference), "dr_grpo"
(clipped, token sums over a constant), "dapo" (clip-higher, token mean over the batch).

* ``ADVANTAGE_ESTIMATORS``: "group_mean" (GPG), "std_normalized" (GRPO-style) and "none" (plain
  policy gradient: ``A_i = r_i``).  Each returns ``(advantages, valid)``, and *valid* always means
  "some advantage of the group is nonzero", i.e. the group carries gradient.  For the group-mean
  estimators that is "rewards differ"; without a baseline a group of equal NONZERO rewards does carry
  gradient (every completion is pushed up), and only an all-zero group is invalid.  The trainer
  forwards, counts in alpha and resamples on exactly these groups, so what resampling looks for is
  what the estimator treats as signal.
* ``LOSS_NORMALIZERS``: AGE on (the loss is the mean over the sequences of valid groups, i.e. alpha =
  B / (B - M)) or off (the mean over every sampled sequence, invalid groups counted in the
  denominator, i.e. alpha = 1).  Invalid groups add exactly zero to the sum either way, so they are
  never forwarded: only the denominator changes.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
from collections.abc import Callable

import torch
from torch import Tensor

from gpg_vl.config.names import ADVANTAGE_BUILTINS, LOSS_BUILTINS
from gpg_vl.errors import UserError
from gpg_vl.registry import Registry

GRPO_STD_EPS = 1e-4
NEEDS = ("old", "ref")  # what a policy loss may declare: the rollout policy's and the reference's log-probs

Aggregation = Callable[..., Tensor]  # (per_token [N, L], mask [N, L], normalizer, max_tokens) -> loss []
AdvantageEstimator = Callable[[Tensor], tuple[Tensor, Tensor]]  # rewards [B, G] -> (advantages [B, G], valid [B])
PolicyLoss = Callable[..., tuple[Tensor, dict[str, float]]]
Normalizer = Callable[[float, float], float]  # (count over valid groups, count over all sampled groups) -> denominator

# the built-ins are defined below (gpg_vl/config/names.py lists them, as every kind's built-ins are listed)
ADVANTAGE_ESTIMATORS = Registry("advantage estimator", "trainer.advantage", builtins=ADVANTAGE_BUILTINS)
POLICY_LOSSES = Registry("policy loss", "trainer.loss", builtins=LOSS_BUILTINS)


# ----------------------------------------------------------------------------- registries
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


# ----------------------------------------------------------------------------- advantages
def group_advantages(
    rewards: Tensor, *, std_normalize: bool = False, eps: float = 1e-5
) -> tuple[Tensor, Tensor]:
    """rewards [B, G] -> (advantages [B, G], valid [B] bool).  Validity on the population std, the GRPO
    scaling on the sample std; see module doc."""
    rewards = rewards if rewards.is_floating_point() else rewards.float()  # [B, G]
    mean = rewards.mean(dim=1, keepdim=True)  # [B, 1]
    spread = rewards.std(dim=1, unbiased=False)  # [B] population std: the validity test
    valid = torch.isfinite(rewards).all(dim=1) & (spread > eps)  # [B]
    adv = rewards - mean  # [B, G] (NaN/inf rows are zeroed below)
    if std_normalize and rewards.shape[1] > 1:  # sample std (G - 1); with G == 1 every group is invalid
        adv = adv / (rewards.std(dim=1, keepdim=True) + GRPO_STD_EPS)  # [B, G]
    adv = torch.where(valid.unsqueeze(1), adv, torch.zeros_like(adv))  # [B, G]
    return adv, valid


@register_advantage("group_mean")
def group_mean_advantages(rewards: Tensor) -> tuple[Tensor, Tensor]:
    """GPG (and Dr. GRPO): ``A_i = r_i - mean(r)``; valid when the rewards differ."""
    return group_advantages(rewards)


@register_advantage("std_normalized")
def std_normalized_advantages(rewards: Tensor) -> tuple[Tensor, Tensor]:
    """GRPO: ``A_i = (r_i - mean(r)) / (std(r) + 1e-4)``, torch's default (sample) std; valid when the rewards
    differ (population std > 1e-5)."""
    adv, valid = group_advantages(rewards)  # [B, G], [B]
    if rewards.shape[1] < 2:  # the sample std of one reward is undefined; such a group is invalid anyway
        return adv, valid
    std = torch.where(valid.unsqueeze(1), rewards.to(adv.dtype), torch.zeros_like(adv)).std(dim=1, keepdim=True)
    return adv / (std + GRPO_STD_EPS), valid


@register_advantage("none")
def raw_reward_advantages(rewards: Tensor, *, eps: float = 1e-5) -> tuple[Tensor, Tensor]:
    """No baseline: ``A_i = r_i``.  Valid when some |r_i| > eps and all rewards are finite.

    Equal nonzero rewards still carry gradient here, so such a group is valid; an all-zero group is not.
    """
    rewards = rewards if rewards.is_floating_point() else rewards.float()  # [B, G]
    valid = torch.isfinite(rewards).all(dim=1) & (rewards.abs() > eps).any(dim=1)  # [B]
    adv = torch.where(valid.unsqueeze(1), rewards, torch.zeros_like(rewards))  # [B, G]
    return adv, valid


# (trainer.baseline, trainer.std_normalize), the deprecated pair of keys -> trainer.advantage
_ESTIMATOR_NAMES = {("group_mean", False): "group_mean", ("group_mean", True): "std_normalized",
                    ("none", False): "none"}
BASELINES = sorted({baseline for baseline, _ in _ESTIMATOR_NAMES})  # what trainer.baseline may hold


def estimator_name(baseline: str, std_normalize: bool) -> str:
    """The advantage estimator the deprecated keys ``trainer.baseline`` and ``trainer.std_normalize`` chose."""
    if baseline not in BASELINES:
        raise UserError(f"unknown trainer.baseline {baseline!r}; valid options: {', '.join(BASELINES)} "
                        "(trainer.baseline is deprecated: use trainer.advantage).")
    if (baseline, bool(std_normalize)) not in _ESTIMATOR_NAMES:
        raise UserError("trainer.std_normalize=true divides by the group's std around its mean, which needs the "
                        "group baseline; set trainer.advantage=std_normalized (these two keys are deprecated).")
    return _ESTIMATOR_NAMES[(baseline, bool(std_normalize))]


def advantage_from_deprecated(advantage: str, baseline: str | None, std_normalize: bool | None) -> str:
    """`trainer.advantage`, or what the deprecated `trainer.baseline` / `trainer.std_normalize` ask for (one
    warning); a contradiction between them and `trainer.advantage` fails in one sentence."""
    if baseline is None and std_normalize is None:
        return advantage
    chosen = estimator_name("group_mean" if baseline is None else baseline, bool(std_normalize))
    if advantage not in ("group_mean", chosen):
        raise UserError(f"trainer.advantage={advantage} contradicts the deprecated trainer.baseline / "
                        f"trainer.std_normalize (which ask for {chosen}); drop the deprecated keys.")
    print(f"warning: trainer.baseline and trainer.std_normalize are deprecated; use trainer.advantage={chosen}.",
          file=sys.stderr)
    return chosen


# ----------------------------------------------------------------------------- aggregation
def _denominator(local_count: float, normalizer: float | None) -> float:
    """Local count unless a global ``normalizer`` is given; clamped at 1 so empty batches give 0."""
    return max(float(local_count if normalizer is None else normalizer), 1.0)


def _seq_mean_token_mean(per_token: Tensor, mask: Tensor, normalizer: float | None, max_tokens=None) -> Tensor:
    """Token mean per sequence, then mean over sequences (empty rows count, contribute 0)."""
    lengths = mask.sum(dim=1).clamp(min=1).to(per_token.dtype)  # [N]
    per_seq = per_token.sum(dim=1) / lengths  # [N]
    return per_seq.sum() / _denominator(per_token.shape[0], normalizer)


def _token_mean(per_token: Tensor, mask: Tensor, normalizer: float | None, max_tokens=None) -> Tensor:
    """Sum over all unmasked tokens divided by their total count."""
    return per_token.sum() / _denominator(int(mask.sum()), normalizer)


def _seq_mean_token_sum(per_token: Tensor, mask: Tensor, normalizer: float | None, max_tokens=None) -> Tensor:
    """Dr. GRPO: each sequence's token SUM over a constant (`max_tokens`, the completion length limit), then
    mean over sequences; i.e. the batch's token sum over (sequences x max_tokens)."""
    if not max_tokens:
        raise ValueError("aggregation seq_mean_token_sum needs max_tokens (the completion length limit)")
    return per_token.sum() / (float(max_tokens) * _denominator(per_token.shape[0], normalizer))


def _seq_token_sum(per_token: Tensor, mask: Tensor, normalizer: float | None, max_tokens=None) -> Tensor:
    """LUSPO: each sequence's token SUM (a sequence weighs by its length), then mean over sequences."""
    return per_token.sum() / _denominator(per_token.shape[0], normalizer)


AGGREGATIONS: dict[str, Aggregation] = {
    "seq_mean_token_mean": _seq_mean_token_mean,
    "token_mean": _token_mean,
    "seq_mean_token_sum": _seq_mean_token_sum,
    "seq_token_sum": _seq_token_sum,
}
TOKEN_NORMALIZED = ("token_mean",)  # aggregations whose normalizer counts tokens; the others count sequences


def _aggregate(per_token: Tensor, mask: Tensor, aggregation: str, normalizer: float | None,
               max_tokens: int | None) -> Tensor:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; valid options: {sorted(AGGREGATIONS)}")
    return AGGREGATIONS[aggregation](per_token, mask, normalizer, max_tokens)


def _masked_mean(values: Tensor, mask: Tensor) -> float:
    count = int(mask.sum())
    return float(torch.where(mask, values, torch.zeros_like(values)).sum() / count) if count else 0.0


def _base_metrics(loss: Tensor, token_logps: Tensor, mask: Tensor, adv: Tensor) -> dict[str, float]:
    n = adv.shape[0]
    return {"loss": float(loss.detach()),
            "advantage_mean": float(adv.mean()) if n else 0.0,
            "advantage_abs_mean": float(adv.abs().mean()) if n else 0.0,
            "num_sequences": float(n),
            "num_tokens": float(int(mask.sum())),
            "logp_mean": _masked_mean(token_logps.detach(), mask)}


# ----------------------------------------------------------------------------- policy losses
@register_policy_loss("gpg")
def policy_loss(
    token_logps: Tensor,
    completion_mask: Tensor,
    advantages: Tensor,
    *,
    old_logps: Tensor | None = None,
    ref_logps: Tensor | None = None,
    aggregation: str = "seq_mean_token_mean",
    normalizer: float | None = None,
    max_tokens: int | None = None,
    **options,
) -> tuple[Tensor, dict[str, float]]:
    """GPG loss. token_logps [N, L], completion_mask [N, L] (bool or 0/1), advantages [N] (or per token [N, L]:
    a teacher's, gpg_vl/distill.py).

    No ratio, no clipping, no KL: `old_logps`, `ref_logps` and other options are not used.
    Masked positions are selected out with ``torch.where`` (so even -inf/NaN padding log-probs
    give neither NaN loss nor NaN gradient).  Returns (scalar loss, float metrics).
    """
    mask = completion_mask.bool()  # [N, L]
    adv = advantages.detach().to(token_logps.dtype)  # [N] or [N, L]
    per_token = -token_logps * per_token_advantages(adv)  # [N, L]
    per_token = torch.where(mask, per_token, torch.zeros_like(per_token))  # [N, L]
    loss = _aggregate(per_token, mask, aggregation, normalizer, max_tokens)  # []
    with torch.no_grad():
        metrics = _base_metrics(loss, token_logps, mask, adv)
    return loss, metrics


_OPSM = "off_policy_mask_threshold"  # TRL's name of DeepSeek-V3.2's off-policy mask threshold (`off_policy_mask`)


def ratio_inputs(token_logps: Tensor, completion_mask: Tensor, advantages: Tensor,
                 old_logps: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(mask [N, L] bool, logps [N, L] with padding zeroed, old [N, L] detached (logps detached when `old_logps`
    is None: ratio 1), advantages [N, 1] detached): what every ratio loss starts from. Padding (maybe -inf) is
    selected out before any arithmetic."""
    mask = completion_mask.bool()  # [N, L]
    zeros = torch.zeros_like(token_logps)
    logps = torch.where(mask, token_logps, zeros)  # [N, L]
    old = logps.detach() if old_logps is None else torch.where(mask, old_logps.to(logps.dtype), zeros).detach()
    return mask, logps, old, per_token_advantages(advantages.detach().to(logps.dtype))


def per_token_advantages(advantages: Tensor) -> Tensor:
    """advantages [N] -> [N, 1] (one per sequence, broadcast over its tokens); per-token ones [N, L] as they are
    (a teacher's: A_t = A_group + coef * sg(log teacher - log student), gpg_vl/distill.py)."""
    return advantages.unsqueeze(1) if advantages.dim() == 1 else advantages


def sequence_mean(values: Tensor, mask: Tensor) -> Tensor:
    """values [N, L] -> [N, 1]: the mean over each sequence's unmasked tokens (0 for an empty sequence)."""
    return torch.where(mask, values, torch.zeros_like(values)).sum(dim=1, keepdim=True) / \
        mask.sum(dim=1, keepdim=True).clamp(min=1).to(values.dtype)


def off_policy_mask(adv: Tensor, logps: Tensor, old: Tensor, mask: Tensor, threshold: float | None) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (TRL's `off_policy_mask_threshold`, delta of its equation 9).

    adv [N, 1], logps / old [N, L] -> keep [N, 1] (1.0 keep, 0.0 drop): a sequence is dropped when its advantage
    is negative AND its mean per-token KL(old || current), mean(old - logp), exceeds `threshold`. None keeps all.
    """
    if threshold is None:
        return torch.ones_like(adv)
    kl = sequence_mean(torch.nan_to_num(old - logps.detach(), nan=0.0), mask)  # [N, 1]
    return ((adv >= 0) | (kl <= threshold)).to(logps.dtype)


def _ratio_metrics(loss: Tensor, token_logps: Tensor, mask: Tensor, adv: Tensor, ratio: Tensor,
                   keep: Tensor | None, drift: Tensor) -> dict[str, float]:
    """The base metrics, ratio_mean / ratio_max over unmasked tokens, logp_drift (token mean of `drift` = logp -
    old), kl and the clip fractions at 0 (a loss with a KL or a clip sets its own), and (with the off-policy mask
    on) the fraction of sequences it dropped, `off_policy_masked`."""
    metrics = _base_metrics(loss, token_logps, mask, adv.squeeze(1))
    ratio = ratio.detach().expand(mask.shape)
    metrics.update({"ratio_mean": _masked_mean(ratio, mask),
                    "ratio_max": float(torch.where(mask, ratio, torch.zeros_like(ratio)).max()) if mask.any() else 1.0,
                    "logp_drift": _masked_mean(drift.detach(), mask), "kl": 0.0, "clip_fraction_low": 0.0,
                    "clip_fraction_high": 0.0})
    if keep is not None:
        metrics["off_policy_masked"] = float((keep == 0).to(torch.float64).mean()) if keep.numel() else 0.0
    return metrics


def clipped_surrogate(
    token_logps: Tensor, completion_mask: Tensor, advantages: Tensor, *, old_logps: Tensor | None = None,
    ref_logps: Tensor | None = None, clip_low: float = 0.2, clip_high: float | None = None, kl_coef: float = 0.0,
    **aggregate,
) -> tuple[Tensor, dict[str, float]]:
    """PPO's clipped surrogate, per token, plus ``kl_coef`` x the k3 KL estimate to the reference.

    token_logps, old_logps, ref_logps, completion_mask [N, L]; advantages [N].  ratio = exp(logp - old)
    (old = logp detached when `old_logps` is None: ratio 1, the gradient of a plain policy gradient);
    per token ``-min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A) + kl_coef * k3`` with
    ``k3 = exp(ref - logp) - (ref - logp) - 1``.  `aggregate` may also hold `level`: "sequence" (GSPO, TRL's
    importance_sampling_level) takes one ratio per sequence, exp of the mean of its tokens' log ratios, on every
    token ("token", the default: one per token); and `off_policy_mask_threshold`: DeepSeek-V3.2's sequence mask
    (`off_policy_mask`) on the surrogate (None, the default: off). Metrics: kl (token mean of k3),
    clip_fraction_low / clip_fraction_high (tokens whose ratio is clipped below / above, where the clip takes the
    gradient away), ratio_mean, ratio_max, logp_drift (token mean of logp - old), off_policy_masked.
    `aggregate`: how the per-token loss is reduced (`aggregation`, default seq_mean_token_mean; the global
    `normalizer`; `max_tokens`).
    """
    mask, logps, old, adv = ratio_inputs(token_logps, completion_mask, advantages, old_logps)
    zeros = torch.zeros_like(logps)
    high = clip_low if clip_high is None else clip_high
    level, off_policy_mask_threshold = aggregate.get("level", "token"), aggregate.get(_OPSM)
    log_ratio = logps - old  # [N, L]
    if level == "sequence":
        log_ratio = sequence_mean(log_ratio, mask).expand_as(logps)  # [N, L] one value per sequence
    elif level != "token":
        raise ValueError(f"unknown importance sampling level {level!r}; valid: token, sequence")
    ratio = torch.exp(log_ratio)  # [N, L]
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + high)  # [N, L]
    keep = off_policy_mask(adv, logps, old, mask, off_policy_mask_threshold)  # [N, 1]
    per_token = -torch.minimum(ratio * adv, clipped * adv) * keep  # [N, L]
    kl = zeros
    if kl_coef:
        if ref_logps is None:
            raise ValueError("kl_coef > 0 needs ref_logps (the reference model's log-probs)")
        delta = torch.where(mask, ref_logps.to(logps.dtype), zeros).detach() - logps  # [N, L]
        kl = torch.exp(delta) - delta - 1.0  # [N, L] k3, >= 0
        per_token = per_token + kl_coef * kl
    per_token = torch.where(mask, per_token, zeros)  # [N, L]
    loss = _aggregate(per_token, mask, aggregate.get("aggregation", "seq_mean_token_mean"),
                      aggregate.get("normalizer"), aggregate.get("max_tokens"))  # []
    with torch.no_grad():
        metrics = _ratio_metrics(loss, token_logps, mask, adv, ratio, None if off_policy_mask_threshold is None
                                 else keep, logps - old)
        ratio = ratio.detach()
        metrics.update({
            "kl": _masked_mean(kl.detach(), mask),
            "clip_fraction_low": _masked_mean(((ratio < 1.0 - clip_low) & (adv < 0)).to(logps.dtype), mask),
            "clip_fraction_high": _masked_mean(((ratio > 1.0 + high) & (adv > 0)).to(logps.dtype), mask),
        })
    return loss, metrics


@register_policy_loss("grpo", needs=("old", "ref"))
def grpo_loss(token_logps: Tensor, completion_mask: Tensor, advantages: Tensor, *, clip_low: float = 0.2,
              clip_high: float | None = None, kl_coef: float = 0.0, off_policy_mask_threshold: float | None = None,
              **inputs):
    """GRPO (DeepSeekMath, R1-V's trainer): clipped ratio (default eps 0.2), k3 KL to the reference with
    `kl_coef`, and the aggregation given (per-sequence token mean, then mean, by default)."""
    return clipped_surrogate(token_logps, completion_mask, advantages, clip_low=clip_low, clip_high=clip_high,
                             kl_coef=kl_coef, off_policy_mask_threshold=off_policy_mask_threshold, **inputs)


@register_policy_loss("dr_grpo", needs=("old",), aggregation="seq_mean_token_sum")
def dr_grpo_loss(token_logps: Tensor, completion_mask: Tensor, advantages: Tensor, *, clip_low: float = 0.2,
                 clip_high: float | None = None, max_tokens: int | None = None,
                 off_policy_mask_threshold: float | None = None, **inputs):
    """Dr. GRPO: the clipped ratio, each sequence's token sum over the constant `max_tokens` (the trainer
    passes rollout.max_new_tokens), no KL."""
    if not max_tokens:
        raise UserError("policy loss dr_grpo needs the option max_tokens (the completion length limit each "
                        "sequence's token sum is divided by; the trainer passes rollout.max_new_tokens).")
    return clipped_surrogate(token_logps, completion_mask, advantages, clip_low=clip_low, clip_high=clip_high,
                             max_tokens=max_tokens, off_policy_mask_threshold=off_policy_mask_threshold,
                             **{**inputs, "kl_coef": 0.0})


@register_policy_loss("dapo", needs=("old",), aggregation="token_mean")
def dapo_loss(token_logps: Tensor, completion_mask: Tensor, advantages: Tensor, *, clip_low: float = 0.2,
              clip_high: float | None = 0.28, off_policy_mask_threshold: float | None = None, **inputs):
    """DAPO: clip-higher (eps_low 0.2, eps_high 0.28 by default), the token mean over the batch, no KL."""
    return clipped_surrogate(token_logps, completion_mask, advantages, clip_low=clip_low, clip_high=clip_high,
                             off_policy_mask_threshold=off_policy_mask_threshold, **{**inputs, "kl_coef": 0.0})


# ----------------------------------------------------------------------------- the 2026 losses
# TRL 1.16's loss types under TRL's names (bnpo, gspo, luspo, sapo, vespo; each equals TRL's `_compute_loss` on the
# same inputs: tests/unit/test_trl_losses.py) and verl's GMPO (`geo_mean`). Each ratio loss also takes TRL's
# `off_policy_mask_threshold` (DeepSeek-V3.2's off-policy sequence mask, `off_policy_mask`).
@register_policy_loss("bnpo", needs=("old",), aggregation="token_mean")
def bnpo_loss(token_logps: Tensor, completion_mask: Tensor, advantages: Tensor, *, clip_low: float = 0.2,
              clip_high: float | None = None, off_policy_mask_threshold: float | None = None, **inputs):
    """BNPO (TRL `loss_type="bnpo"`): the clipped surrogate per token, summed over the batch's tokens and divided
    by their count (TRL normalises by the local batch; here by the global token count), no KL."""
    return clipped_surrogate(token_logps, completion_mask, advantages, clip_low=clip_low, clip_high=clip_high,
                             **{**inputs, "kl_coef": 0.0, _OPSM: off_policy_mask_threshold})


@register_policy_loss("gspo", needs=("old",), aggregation="seq_mean_token_mean")
def gspo_loss(token_logps: Tensor, completion_mask: Tensor, advantages: Tensor, *, clip_low: float = 3e-4,
              clip_high: float | None = 4e-4, off_policy_mask_threshold: float | None = None, **inputs):
    """GSPO (TRL `loss_type="grpo"` with `importance_sampling_level="sequence"`): one ratio per sequence,
    ``s_i = exp(mean_t (logp - old))``, clipped to [1 - clip_low, 1 + clip_high] (GSPO's 3e-4 / 4e-4), loss
    ``-min(s_i A_i, clip(s_i) A_i)`` per sequence, mean over sequences; no KL."""
    return clipped_surrogate(token_logps, completion_mask, advantages, clip_low=clip_low, clip_high=clip_high,
                             level="sequence", **{**inputs, "kl_coef": 0.0, _OPSM: off_policy_mask_threshold})


@register_policy_loss("luspo", needs=("old",), aggregation="seq_token_sum")
def luspo_loss(token_logps: Tensor, completion_mask: Tensor, advantages: Tensor, *, clip_low: float = 3e-4,
               clip_high: float | None = 4e-4, off_policy_mask_threshold: float | None = None, **inputs):
    """LUSPO (TRL `loss_type="luspo"`, sequence-level ratio): GSPO's per-sequence loss times the sequence's length
    (its token sum), mean over sequences; no KL."""
    return clipped_surrogate(token_logps, completion_mask, advantages, clip_low=clip_low, clip_high=clip_high,
                             level="sequence", **{**inputs, "kl_coef": 0.0, _OPSM: off_policy_mask_threshold})


@register_policy_loss("sapo", needs=("old",), aggregation="seq_mean_token_mean")
def sapo_loss(token_logps: Tensor, completion_mask: Tensor, advantages: Tensor, *, temperature_pos: float = 1.0,
              temperature_neg: float = 1.05, off_policy_mask_threshold: float | None = None,
              **inputs) -> tuple[Tensor, dict[str, float]]:
    """SAPO (TRL `loss_type="sapo"`): a soft gate instead of the clip. Per token, with r = exp(logp - old) and
    tau = `temperature_pos` where A > 0 else `temperature_neg`: ``-sigmoid(tau (r - 1)) * 4 / tau * A``
    (gradient A r at r = 1, fading as r leaves 1); per-sequence token mean, then mean; no KL."""
    mask, logps, old, adv = ratio_inputs(token_logps, completion_mask, advantages, inputs.get("old_logps"))
    ratio = torch.exp(logps - old)  # [N, L]
    tau = torch.where(adv > 0, torch.full_like(adv, temperature_pos), torch.full_like(adv, temperature_neg))  # [N, 1]
    keep = off_policy_mask(adv, logps, old, mask, off_policy_mask_threshold)  # [N, 1]
    per_token = -torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * adv * keep  # [N, L]
    per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
    loss = _aggregate(per_token, mask, inputs.get("aggregation", "seq_mean_token_mean"), inputs.get("normalizer"),
                      None)
    with torch.no_grad():
        metrics = _ratio_metrics(loss, token_logps, mask, adv, ratio, None if off_policy_mask_threshold is None
                                 else keep, logps - old)
    return loss, metrics


def gamma_weights(adv: Tensor, log_ratio: Tensor, mask: Tensor, *, k_pos: float, lambda_pos: float, k_neg: float,
                  lambda_neg: float) -> Tensor:
    """VESPO's weight per sequence, without gradient. adv [N, 1], log_ratio [N, L] -> phi [N, 1].

    w = exp(sum_t clamp(log ratio_t, -20, 20)) (the sequence's ratio, its log clamped to [log 1e-8, 20]);
    phi(w) = exp(lambda + k log w - lambda w) = e^lambda w^k e^(-lambda w) (1 at w = 1), with (k, lambda) =
    (k_pos, lambda_pos) where A >= 0, else (k_neg, lambda_neg); a non-finite phi is 0."""
    with torch.no_grad():
        low = math.log(1e-8)
        log_w = torch.where(mask, log_ratio.clamp(-20.0, 20.0), torch.zeros_like(log_ratio)).sum(1, keepdim=True)
        log_w = log_w.clamp(low, 20.0)  # [N, 1]
        k = torch.where(adv >= 0, torch.full_like(adv, k_pos), torch.full_like(adv, k_neg))
        lam = torch.where(adv >= 0, torch.full_like(adv, lambda_pos), torch.full_like(adv, lambda_neg)).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)  # [N, 1]


@register_policy_loss("vespo", needs=("old",), aggregation="token_mean")
def vespo_loss(token_logps: Tensor, completion_mask: Tensor, advantages: Tensor, *, k_pos: float = 2.0,
               lambda_pos: float = 3.0, k_neg: float = 3.0, lambda_neg: float = 2.0,
               off_policy_mask_threshold: float | None = None, **inputs) -> tuple[Tensor, dict[str, float]]:
    """VESPO (TRL `loss_type="vespo"`): a policy gradient weighted per sequence by the gamma function of its
    ratio (`gamma_weights`, no gradient through it): per token ``-phi_i A_i logp``, token mean over the batch."""
    mask, logps, old, adv = ratio_inputs(token_logps, completion_mask, advantages, inputs.get("old_logps"))
    phi = gamma_weights(adv, logps - old, mask, k_pos=k_pos, lambda_pos=lambda_pos, k_neg=k_neg,
                        lambda_neg=lambda_neg)  # [N, 1]
    keep = off_policy_mask(adv, logps, old, mask, off_policy_mask_threshold)  # [N, 1]
    per_token = torch.where(mask, -phi * adv * logps * keep, torch.zeros_like(logps))  # [N, L]
    loss = _aggregate(per_token, mask, inputs.get("aggregation", "token_mean"), inputs.get("normalizer"), None)
    with torch.no_grad():
        metrics = _ratio_metrics(loss, token_logps, mask, adv, torch.exp(sequence_mean(logps - old, mask)),
                                 None if off_policy_mask_threshold is None else keep, logps - old)
        metrics["phi_mean"] = float(phi.mean()) if phi.numel() else 0.0
    return loss, metrics


@register_policy_loss("gmpo", needs=("old",), aggregation="seq_mean_token_mean")
def gmpo_loss(token_logps: Tensor, completion_mask: Tensor, advantages: Tensor, *, clip_low: float = 0.4,
              clip_high: float | None = 0.4, off_policy_mask_threshold: float | None = None,
              **inputs) -> tuple[Tensor, dict[str, float]]:
    """GMPO (verl `loss_mode=geo_mean`): the geometric mean of the token ratios, clipped per token in log space.

    With d_t = logp_t - old_t and s = sign(A_i): ``d'_t = s * min(s * d_t, s * clamp(d_t, -clip_low, clip_high))``;
    loss_i = ``-A_i * exp(mean_t d'_t)``; mean over sequences (an empty sequence counts and adds 0). GMPO's clip is
    (-0.4, 0.4) in log space: ratios within [e^-0.4, e^0.4]."""
    mask, logps, old, adv = ratio_inputs(token_logps, completion_mask, advantages, inputs.get("old_logps"))
    high = clip_low if clip_high is None else clip_high
    delta = logps - old  # [N, L]
    sign = torch.sign(adv)  # [N, 1]
    clipped = sign * torch.minimum(sign * delta, sign * delta.clamp(-clip_low, high))  # [N, L]
    ratio = torch.exp(sequence_mean(clipped, mask))  # [N, 1]
    keep = off_policy_mask(adv, logps, old, mask, off_policy_mask_threshold)  # [N, 1]
    per_token = torch.where(mask, (-adv * ratio * keep).expand_as(logps), torch.zeros_like(logps))  # [N, L]
    loss = _aggregate(per_token, mask, inputs.get("aggregation", "seq_mean_token_mean"), inputs.get("normalizer"),
                      None)
    with torch.no_grad():
        metrics = _ratio_metrics(loss, token_logps, mask, adv, ratio, None if off_policy_mask_threshold is None
                                 else keep, delta)
        outside = (delta != delta.clamp(-clip_low, high))
        metrics["clip_fraction_high"] = _masked_mean((outside & (adv > 0)).to(logps.dtype), mask)
        metrics["clip_fraction_low"] = _masked_mean((outside & (adv < 0)).to(logps.dtype), mask)
    return loss, metrics


@register_policy_loss("cispo", needs=("old",), aggregation="token_mean")
def cispo_loss(token_logps: Tensor, completion_mask: Tensor, advantages: Tensor, *, old_logps: Tensor | None = None,
               cap: float = 5.0, **inputs) -> tuple[Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1): per token -sg(min(rho_t, cap)) * A * log pi_t, rho_t = exp(logp - old), the token mean
    over the batch; the weight is detached, so every token keeps a gradient (no clipping takes it away). TRL 1.16's
    loss_type="cispo" caps at its `epsilon_high` itself: cap here is that number. token_logps, old_logps,
    completion_mask [N, L]; advantages [N]. Metrics: the gpg loss's, with ratio_mean / ratio_max, kl 0 and
    clip_fraction_high (tokens whose weight was capped)."""
    mask = completion_mask.bool()  # [N, L]
    zeros = torch.zeros_like(token_logps)
    logps = torch.where(mask, token_logps, zeros)  # [N, L]
    old = logps.detach() if old_logps is None else torch.where(mask, old_logps.to(logps.dtype), zeros).detach()
    ratio = torch.exp(logps.detach() - old)  # [N, L]
    weight = ratio.clamp(max=cap)  # [N, L] detached
    per_token = torch.where(mask, -weight * per_token_advantages(advantages.detach().to(logps.dtype)) * logps, zeros)
    loss = _aggregate(per_token, mask, inputs.get("aggregation", "token_mean"), inputs.get("normalizer"), None)
    with torch.no_grad():
        metrics = _base_metrics(loss, token_logps, mask, advantages.detach())
        metrics.update({"kl": 0.0, "clip_fraction_low": 0.0,
                        "clip_fraction_high": _masked_mean((ratio > cap).to(logps.dtype), mask),
                        "ratio_mean": _masked_mean(ratio, mask),
                        "ratio_max": float(torch.where(mask, ratio, zeros).max()) if mask.any() else 1.0,
                        "logp_drift": _masked_mean(logps.detach() - old, mask)})
    return loss, metrics


# ----------------------------------------------------------------------------- loss options
LOSS_INPUTS = ("old_logps", "ref_logps", "aggregation", "normalizer")  # what the trainer passes every loss


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
    does not declare fails in one sentence naming the loss and its options."""
    declared = declared_options(loss)
    unknown = sorted(set(given) - set(declared))
    if unknown:
        label = name or getattr(loss, "__name__", "the loss")
        raise UserError(f"trainer.loss_options.{unknown[0]}: loss {label} has no option {unknown[0]!r}; its options: "
                        f"{', '.join(sorted(declared)) or 'none'}.")
    chosen = {key: given[key] if key in given else defaults.get(key, default) for key, default in declared.items()}
    takes_more = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(loss).parameters.values())
    return {**({k: v for k, v in defaults.items() if k not in declared} if takes_more else {}), **chosen}


def overlong_penalty(lengths: Tensor, max_tokens: int, cache: int) -> Tensor:
    """DAPO's soft overlong punishment. lengths [N] -> [N] in [-1, 0]: 0 up to ``max_tokens - cache`` tokens,
    then linearly down to -1 at ``max_tokens`` (and -1 beyond)."""
    if not 0 < cache <= max_tokens:
        raise ValueError(f"need 0 < cache <= max_tokens, got cache={cache}, max_tokens={max_tokens}")
    return ((max_tokens - cache - lengths.to(torch.float64)) / cache).clamp(min=-1.0, max=0.0)


def age_alpha(num_groups: int, num_valid: int) -> float:
    """AGE scale B / (B - M) = num_groups / num_valid (M = invalid groups).

    Returns 0.0 when ``num_valid == 0``: every advantage is zero and no update happens.
    """
    return loss_alpha(True, num_groups, num_valid)


# ----------------------------------------------------------------------------- loss normalizers (AGE)
def age_normalizer(valid_count: float, sampled_count: float) -> float:
    """AGE on: the mean over valid groups' sequences (or tokens), = alpha * the mean over all sampled."""
    return valid_count


def all_sampled_normalizer(valid_count: float, sampled_count: float) -> float:
    """AGE off: the mean over every sampled sequence (or token), invalid groups included (alpha = 1)."""
    return sampled_count


LOSS_NORMALIZERS: dict[bool, Normalizer] = {True: age_normalizer, False: all_sampled_normalizer}  # key: trainer.age


def loss_alpha(age: bool, num_groups: int, num_valid: int) -> float:
    """The scale applied to the mean over all `num_groups` sampled groups: B / normalizer(B - M, B).

    B / (B - M) with AGE, 1 without; 0.0 when no group is valid (no update happens).
    """
    if not 0 <= num_valid <= num_groups:
        raise ValueError(f"need 0 <= num_valid <= num_groups, got {num_valid}, {num_groups}")
    return num_groups / LOSS_NORMALIZERS[age](num_valid, num_groups) if num_valid else 0.0
