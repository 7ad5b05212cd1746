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

# The package's names, each imported from its module on first use (PEP 562): the modules import one another
# (the registries, the aggregations), never this package, so importing any one of them loads no other.
_LAZY = {
    **dict.fromkeys(("ADVANTAGE_ESTIMATORS", "AdvantageEstimator", "NEEDS", "POLICY_LOSSES", "PolicyLoss",
                     "get_advantage", "get_policy_loss", "loss_aggregation", "loss_needs", "register_advantage",
                     "register_policy_loss"), "registry"),
    **dict.fromkeys(("BASELINES", "GRPO_STD_EPS", "advantage_from_deprecated", "estimator_name", "group_advantages",
                     "group_mean_advantages", "raw_reward_advantages", "std_normalized_advantages"), "advantages"),
    **dict.fromkeys(("AGGREGATIONS", "Aggregation", "TOKEN_NORMALIZED"), "aggregation"),
    **dict.fromkeys(("clipped_surrogate", "dapo_loss", "dr_grpo_loss", "grpo_loss", "off_policy_mask",
                     "per_token_advantages", "policy_loss", "ratio_inputs", "sequence_mean"), "losses"),
    **dict.fromkeys(("bnpo_loss", "cispo_loss", "gamma_weights", "gmpo_loss", "gspo_loss", "luspo_loss", "sapo_loss",
                     "vespo_loss"), "recent_losses"),
    **dict.fromkeys(("LOSS_INPUTS", "declared_options", "loss_options", "overlong_penalty"), "options"),
    **dict.fromkeys(("LOSS_NORMALIZERS", "Normalizer", "age_alpha", "age_normalizer", "all_sampled_normalizer",
                     "loss_alpha"), "age"),
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f"gpg_vl.objective.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'gpg_vl.objective' has no attribute {name!r}")
