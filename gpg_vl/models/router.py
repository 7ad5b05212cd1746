"""The mixture-of-experts router's load-balancing loss, over the training forwards of any scoring path.

`router_aux_loss(bare)` is the router's load-balancing loss (times `router_aux_loss_coef`) over the forwards
since the last call, or None when the coefficient is 0 (the default, as TRL's GPG trainer) or the model has no
router. The router logits are recorded by forward hooks on the model's router modules (the ones transformers
itself records as `router_logits`), with each token's weight from `weigh_router_tokens` (forwards under no_grad,
sampling, are not recorded). The loss is transformers' load-balancing loss with those weights
(`router_balance_loss`): padding counts for nothing, and a prompt token counts once per sequence that continues
it, on every scoring path (models/scoring.py), so prompt-once and the plain path give the same loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def router_aux_loss(bare) -> Tensor | None:
    """The router's load-balancing loss over the training forwards since the last call (see the module's
    docstring), or None when it is off or the model has no router. `bare`: the bare model (`unwrap`)."""
    coef, text = _router_coef(bare)
    if coef <= 0:
        return None
    recorded = _router_recorder(bare)
    bare._gpg_router_weight = None
    if recorded is None or not recorded:
        return None
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    loss = router_balance_loss([logits for logits, _ in recorded], [weight for _, weight in recorded],
                               experts, getattr(text, "num_experts_per_tok", 2))
    recorded.clear()
    return coef * loss


def weigh_router_tokens(bare, weights: Callable[[], Tensor]) -> None:
    """The router loss's weight of each token, `weights()` [rows, seq], for the training forward that
    follows (0 for padding; a prompt run once for G sequences weighs G). Computed only when the router
    loss is on. `bare`: the bare model (`unwrap`)."""
    if _router_coef(bare)[0] > 0 and _router_recorder(bare) is not None:
        bare._gpg_router_weight = weights().detach().reshape(-1).float()


def _router_coef(bare: torch.nn.Module) -> tuple[float, object]:
    """(router_aux_loss_coef, the text config); the coefficient is 0 unless the model records router logits."""
    text = getattr(bare.config, "text_config", bare.config)
    coef = float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0)
    return (coef if getattr(text, "output_router_logits", False) else 0.0), text


def router_balance_loss(logits: list[Tensor], weights: list[Tensor | None], experts: int, top_k: int) -> Tensor:
    """The Switch-Transformer load-balancing loss over router logits `logits[i]` [T_i, E] (layers and forwards
    alike), each row weighted by `weights[i]` [T_i] (None: every row weighs 1):
    E * sum_e (weighted share of top-k assignments to e) * (weighted mean router probability of e).
    With 0/1 weights this is transformers' `load_balancing_loss_func` with an attention mask."""
    device = logits[0].device
    assigned = torch.zeros(experts, dtype=torch.float32, device=device)  # [E]
    probability = torch.zeros(experts, dtype=torch.float32, device=device)  # [E]
    total = torch.zeros((), dtype=torch.float32, device=device)
    for layer, weight in zip(logits, weights, strict=True):
        probs = torch.softmax(layer.float(), dim=-1)  # [T, E]
        if weight is None or weight.numel() != probs.shape[0]:  # a forward nobody weighed: every row counts
            weight = probs.new_ones(probs.shape[0])
        weight = weight.to(device)  # [T]
        chosen = torch.topk(probs, top_k, dim=-1).indices  # [T, k]
        assigned = assigned.scatter_add(0, chosen.reshape(-1), weight.repeat_interleave(top_k))
        probability = probability + (probs * weight.unsqueeze(-1)).sum(dim=0)
        total = total + weight.sum()
    return experts * torch.sum((assigned / total) * (probability / total))


def _router_recorder(bare: torch.nn.Module) -> list | None:
    """The list the router hooks of `bare` append their logits to (hooks registered on first use)."""
    recorded = getattr(bare, "_gpg_router_logits", None)
    if recorded is not None:
        return recorded
    target, index = None, 0
    for module in bare.modules():
        recorder = getattr(type(module), "_can_record_outputs", None) or {}
        spec = recorder.get("router_logits")
        if spec is not None:
            target, index = getattr(spec, "target_class", spec), getattr(spec, "index", 0)
            break
    if target is None:
        return None
    recorded = []

    def record(_module, _inputs, output):
        if torch.is_grad_enabled():  # training forwards only, not sampling
            logits = output[index] if isinstance(output, tuple) else output
            recorded.append((logits.reshape(-1, logits.shape[-1]), getattr(bare, "_gpg_router_weight", None)))

    for module in bare.modules():
        if isinstance(module, target):
            module.register_forward_hook(record)
    bare._gpg_router_logits = recorded
    return recorded

