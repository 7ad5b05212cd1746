"""The output layer, a chunk of tokens at a time: each completion token's log-prob under
softmax(hidden @ weight.T / temperature) (and, when asked, the entropy of that distribution) without ever holding
the [tokens, vocabulary] logits of a whole sequence; the backward recomputes each chunk's logits. And the entropy of
logits held whole (`logits_entropy`: ``H_t = logsumexp(z) - sum_v softmax(z)_v z_v``)."""

from __future__ import annotations

import torch
from torch import Tensor


class _ChunkedTokenLogps(torch.autograd.Function):
    """log softmax(hidden @ weight.T / temperature)[target], suppressed ids at -inf, chunk by chunk.

    Forward keeps only each token's log-normalizer; backward recomputes a chunk's logits and uses
    d logp / d logits = (onehot(target) - softmax) / temperature.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, suppressed: Tensor | None,
                temperature: float, chunk: int, softcap: float | None, entropy: bool = False):
        logps = hidden.new_empty(hidden.shape[0], dtype=torch.float32)  # [T]
        normalizers = torch.empty_like(logps)  # [T]
        entropies = torch.empty_like(logps) if entropy else logps.new_empty(0)  # [T] when asked
        for start in range(0, hidden.shape[0], chunk):
            logits = output_logits(hidden[start:start + chunk], weight, suppressed, temperature, softcap)  # [t, V]
            normalizers[start:start + chunk] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(-1, targets[start:start + chunk].unsqueeze(-1)).squeeze(-1)  # [t]
            logps[start:start + chunk] = picked - normalizers[start:start + chunk]
            if entropy:  # from the chunk's logits already in memory, one [t, V] buffer more: no extra forward
                entropies[start:start + chunk] = _entropy_in_place(logits)
        ctx.save_for_backward(hidden, weight, targets, normalizers, suppressed)
        ctx.temperature, ctx.chunk, ctx.softcap = temperature, chunk, softcap
        ctx.mark_non_differentiable(entropies)
        return logps, entropies

    @staticmethod
    def backward(ctx, grad_logps: Tensor, _grad_entropies: Tensor | None = None):
        hidden, weight, targets, normalizers, suppressed = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = start + ctx.chunk
            logits = output_logits(hidden[start:end], weight, suppressed, ctx.temperature, ctx.softcap)  # [t, V]
            grad = torch.exp(logits - normalizers[start:end, None]).mul_(-grad_logps[start:end, None].float())
            grad.scatter_add_(-1, targets[start:end, None], grad_logps[start:end, None].float())
            grad.div_(ctx.temperature)  # d logp / d capped logits [t, V]
            if ctx.softcap:  # d cap * tanh(x / cap) / dx = 1 - tanh(x / cap)^2
                grad.mul_(1 - torch.tanh((hidden[start:end] @ weight.T).float() / ctx.softcap) ** 2)
            if want_hidden:
                grad_hidden[start:end] = (grad.to(weight.dtype) @ weight).to(hidden.dtype)
            if want_weight:
                grad_weight += grad.T @ hidden[start:end].float()
        return (grad_hidden, (grad_weight.to(weight.dtype) if want_weight else None), None, None, None, None, None,
                None)


def _entropy_in_place(logits: Tensor) -> Tensor:
    """Entropy [t] of softmax(logits [t, V]) in nats (the logits are overwritten), from terms >= 0 alone. With
    s = z - max z (<= 0, 0 at the top id) and R = sum of exp(s) over the other ids: H = log1p(R) - sum p_i s_i,
    p_i = exp(s_i) / (1 + R). The plain lse(z) - sum_i p_i z_i takes the difference of two numbers of the logits'
    size, which in float32 errs by ~eps |z| (1e-6 nats on a tiny model whose logits reach 15: 1e-5 of a 0.08-nat
    entropy, and a batch split another way moved it that much); here the error is ~eps H, down to entropies of
    1e-6. A suppressed id (-inf) gives 0 * -inf = NaN and counts 0, as `logits_entropy`'s does."""
    top = logits.max(dim=-1, keepdim=True)  # [t, 1]
    shifted = logits.sub_(top.values)  # [t, V] <= 0, in the logits' buffer
    weighted = shifted.exp().scatter_(-1, top.indices, 0.0)  # exp(s) off the top id [t, V]
    rest = weighted.sum(dim=-1)  # R [t]
    weighted.mul_(shifted)  # exp(s) * s <= 0 (the top id: 0)
    return torch.log1p(rest) - torch.nansum(weighted, dim=-1) / (1.0 + rest)


def output_logits(hidden: Tensor, weight: Tensor, suppressed: Tensor | None, temperature: float,
                  softcap: float | None = None) -> Tensor:
    logits = (hidden @ weight.T).float()  # [t, V]
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    if suppressed is not None:
        logits.index_fill_(-1, suppressed, float("-inf"))
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


def completion_logps(hidden: Tensor, weight: Tensor, token_ids: Tensor, mask: Tensor, *, suppressed_ids: list[int],
                     temperature: float, chunk_tokens: int, softcap: float | None = None, entropy: bool = False):
    """Log-probs [N, C] of token_ids under softmax(hidden @ weight.T / temperature), suppressed ids removed
    (with `softcap`, the logits are first capped as cap * tanh(logits / cap), as Gemma's output layer does).

    Only tokens where `mask` is True are scored (others are 0); they go through the output layer
    `chunk_tokens` at a time, forward and backward. With `entropy`, (log-probs, entropies [N, C] of the same
    distributions, without gradient, 0 off the mask).
    """
    selected = mask.nonzero(as_tuple=True)
    suppressed = torch.tensor(suppressed_ids, device=hidden.device) if suppressed_ids else None
    values, entropies = _ChunkedTokenLogps.apply(hidden[selected], weight, token_ids[selected], suppressed,
                                                 temperature, max(int(chunk_tokens), 1), softcap, entropy)  # [T]
    logps = torch.zeros(token_ids.shape, dtype=values.dtype, device=values.device)
    logps = logps.index_put(selected, values)  # [N, C]
    if not entropy:
        return logps
    return logps, torch.zeros_like(logps).index_put(selected, entropies)  # [N, C], [N, C]


def logits_entropy(logits: Tensor) -> Tensor:
    """Entropy [...] of softmax(logits [..., V]) in nats; -inf logits (suppressed ids) count 0."""
    logits = logits.float()
    normalizer = torch.logsumexp(logits, dim=-1, keepdim=True)  # [..., 1]
    probs = torch.exp(logits - normalizer)  # [..., V]
    weighted = torch.where(probs > 0, probs * logits, torch.zeros_like(probs)).sum(dim=-1)
    return normalizer.squeeze(-1) - weighted
