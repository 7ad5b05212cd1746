"""Compute each prompt once per group, in both phases, and score completions without full-vocabulary logits.

A GPG step samples G completions of the same prompt (images included), then scores them. Peers repeat
the prompt G times in both phases. Here:

- rollout (`prefill_once`): the B distinct prompts are prefilled once (each image through the vision
  tower once, each prompt token through the language model once) and the key/value cache is forked
  G ways before `generate` samples the completions;
- update (`prompt_once_hidden`): each distinct prompt runs forward once, with gradient; its cache is
  forked to its G sequences, and the completions run on top of it with explicit 3-D rotary positions
  continuing the prompt's. The gradient reaches the prompt's forward through the cache;
- scoring (`completion_logps`): the hidden states that predict completion tokens go through the output
  layer a chunk of tokens at a time, and the backward pass recomputes each chunk's logits, so fp32
  full-vocabulary logits are never held for all tokens at once.

Every function here gives, up to floating-point rounding, what the plain full-sequence forward gives;
tests/test_fast_paths.py checks values, gradients and greedy tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

IMAGE_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model under a DistributedDataParallel wrapper and a PEFT (LoRA) wrapper.

    PEFT injects its adapters into the base model's layers, so the base model runs them too.
    """
    from gpg_vl.models.base import _unwrap

    return _unwrap(model)


def checkpointing(model: torch.nn.Module) -> bool:
    """Whether activation (gradient) checkpointing is on: it drops the key/value cache in training forwards."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # transformers >= 5.x name first
        if name in dir(type(model)):
            return bool(getattr(model, name))
    return False


def _cache_of(outputs):
    """The key/value cache of a model output (`cache` in transformers >= 5.x, `past_key_values` before)."""
    cache = getattr(outputs, "cache", None)
    return cache if cache is not None else getattr(outputs, "past_key_values", None)


def per_token_keys(inputs: dict[str, Tensor]) -> list[str]:
    """The processor outputs that hold one value per prompt token ([B, P], like input_ids)."""
    shape = inputs["input_ids"].shape
    return [key for key, value in inputs.items()
            if key not in IMAGE_KEYS and isinstance(value, Tensor) and value.shape == shape]


def trim_left_padding(inputs: dict[str, Tensor]) -> dict[str, Tensor]:
    """Drop the leading columns that are padding in every row (a subset of a padded batch keeps them)."""
    used = inputs["attention_mask"].any(dim=0).nonzero()  # [P] columns with a real token
    start = int(used[0]) if used.numel() else 0
    if start == 0:
        return inputs
    return {**inputs, **{key: inputs[key][:, start:] for key in per_token_keys(inputs)}}


# ---------------------------------------------------------------------------------------------
# rollout: prefill each prompt once, fork its cache G ways
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def prefill_once(model, inputs: dict[str, Tensor], *, group_size: int, max_new_tokens: int,
                 static_cache: bool) -> dict | None:
    """`generate` keyword arguments that continue B prompts prefilled once, as B * G rows.

    All prompt tokens but the last go through the model once per prompt (images included); the cache
    is repeated G ways (into a preallocated static cache with `static_cache`), and `generate` then
    runs the last prompt token for the B * G rows, whose logits sample the first completion token.
    The rotary offsets (`rope_deltas`) of the B prompts are repeated the same way. Returns None when
    the prompt cannot be split this way (a prompt ending in a vision token, or a single token).
    """
    ids = inputs["input_ids"]  # [B, P]
    kinds = inputs.get("mm_token_type_ids")
    if ids.shape[1] < 2 or (kinds is not None and bool(kinds[:, -1].any())):
        return None
    bare = unwrap(model)
    base = bare.model
    per_token = {key: inputs[key] for key in per_token_keys(inputs)}
    head = {**inputs, **{key: value[:, :-1] for key, value in per_token.items()}}  # [B, P - 1] each
    base.rope_deltas = None
    prefilled = bare(**head, use_cache=True, logits_to_keep=1)
    cache = _cache_of(prefilled)
    if static_cache:
        from transformers import StaticCache

        forked = StaticCache(config=bare.config, max_cache_len=ids.shape[1] + max_new_tokens)
        for source, target in zip(cache.layers, forked.layers, strict=True):
            target.update(source.keys.repeat_interleave(group_size, dim=0),
                          source.values.repeat_interleave(group_size, dim=0))  # [B * G, heads, P - 1, d]
        cache = forked
    else:
        cache.batch_repeat_interleave(group_size)
    if getattr(base, "rope_deltas", None) is not None:
        base.rope_deltas = base.rope_deltas.repeat_interleave(group_size, dim=0)  # [B * G, 1]
    expanded = {key: value.repeat_interleave(group_size, dim=0) for key, value in per_token.items()}
    return {**expanded, "cache": cache}


# ---------------------------------------------------------------------------------------------
# update: the prompt once per group, the G completions on its cache
# ---------------------------------------------------------------------------------------------
def prompt_once_hidden(adapter, model, prompts, prompt_index: list[int], completion_ids: Tensor,
                       completion_mask: Tensor) -> Tensor:
    """Final hidden states [N, C, H]; row n, column t is the state that predicts completion_ids[n, t].

    Each distinct prompt of `prompt_index` runs forward once (its images through the vision tower
    once) with gradient; its cache is indexed out to the sequences that continue it, and the
    completions (all but their last token, which predicts nothing) run on that cache. Column 0 is the
    prompt's last state (left padding puts every prompt's last token in the last column).
    """
    bare = unwrap(model)
    distinct = sorted(set(prompt_index))
    row_of = {prompt: row for row, prompt in enumerate(distinct)}
    expand = torch.tensor([row_of[p] for p in prompt_index], device=completion_ids.device)  # [N]
    inputs = trim_left_padding(prompts.select(distinct).inputs)
    prompt_ids, prompt_mask = inputs["input_ids"], inputs["attention_mask"]  # [B, P]
    width, length = prompt_ids.shape[1], completion_ids.shape[1]
    # 3-D rotary positions of prompt + completion, from the model's own rule on the full sequence
    full = {"input_ids": torch.cat([prompt_ids, prompt_ids.new_full((len(distinct), length), adapter.pad_id)], 1),
            "attention_mask": torch.cat([prompt_mask, prompt_mask.new_ones(len(distinct), length)], 1)}
    if "mm_token_type_ids" in inputs:
        kinds = inputs["mm_token_type_ids"]
        full["mm_token_type_ids"] = torch.cat([kinds, kinds.new_zeros(len(distinct), length)], 1)
    if "image_grid_thw" in inputs:
        full["image_grid_thw"] = inputs["image_grid_thw"]
    positions = adapter.position_ids(bare, full)  # [3, B, P + C]
    vision = {key: inputs[key] for key in ("pixel_values", "image_grid_thw", "mm_token_type_ids") if key in inputs}
    prompt_out = bare.model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions[:, :, :width],
                            use_cache=True, **vision)
    last = prompt_out.last_hidden_state[:, -1][expand].unsqueeze(1)  # [N, 1, H]
    if length == 1:
        return last
    cache = _cache_of(prompt_out)
    cache.batch_select_indices(expand)  # [N, heads, P, d] per layer, still in the graph
    mask = torch.cat([prompt_mask[expand], completion_mask[:, :-1].to(prompt_mask.dtype)], dim=1)  # [N, P + C - 1]
    completion_out = bare.model(input_ids=completion_ids[:, :-1], attention_mask=mask,
                                position_ids=positions[:, expand, width:width + length - 1], cache=cache,
                                use_cache=True)
    return torch.cat([last, completion_out.last_hidden_state], dim=1)  # [N, C, H]


# ---------------------------------------------------------------------------------------------
# scoring: log-softmax over the vocabulary, a chunk of tokens at a time
# ---------------------------------------------------------------------------------------------
class _ChunkedTokenLogps(torch.autograd.Function):
    """log softmax(hidden @ weight.T / temperature)[target], suppressed ids at -inf, chunk by chunk.

    Forward keeps only each token's log-normaliser; backward recomputes a chunk's logits and uses
    d logp / d logits = (onehot(target) - softmax) / temperature.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, suppressed: Tensor | None,
                temperature: float, chunk: int) -> Tensor:
        logps = hidden.new_empty(hidden.shape[0], dtype=torch.float32)  # [T]
        normalisers = torch.empty_like(logps)  # [T]
        for start in range(0, hidden.shape[0], chunk):
            logits = _chunk_logits(hidden[start:start + chunk], weight, suppressed, temperature)  # [t, V] fp32
            normalisers[start:start + chunk] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(-1, targets[start:start + chunk].unsqueeze(-1)).squeeze(-1)  # [t]
            logps[start:start + chunk] = picked - normalisers[start:start + chunk]
        ctx.save_for_backward(hidden, weight, targets, normalisers, suppressed)
        ctx.temperature, ctx.chunk = temperature, chunk
        return logps

    @staticmethod
    def backward(ctx, grad_logps: Tensor):
        hidden, weight, targets, normalisers, suppressed = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = start + ctx.chunk
            logits = _chunk_logits(hidden[start:end], weight, suppressed, ctx.temperature)  # [t, V]
            grad = torch.exp(logits - normalisers[start:end, None]).mul_(-grad_logps[start:end, None].float())
            grad.scatter_add_(-1, targets[start:end, None], grad_logps[start:end, None].float())
            grad.div_(ctx.temperature)  # d logp / d raw logits [t, V]
            if want_hidden:
                grad_hidden[start:end] = (grad.to(weight.dtype) @ weight).to(hidden.dtype)
            if want_weight:
                grad_weight += grad.T @ hidden[start:end].float()
        return grad_hidden, (grad_weight.to(weight.dtype) if want_weight else None), None, None, None, None


def _chunk_logits(hidden: Tensor, weight: Tensor, suppressed: Tensor | None, temperature: float) -> Tensor:
    logits = (hidden @ weight.T).float()  # [t, V]
    if suppressed is not None:
        logits.index_fill_(-1, suppressed, float("-inf"))
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


def completion_logps(hidden: Tensor, weight: Tensor, token_ids: Tensor, mask: Tensor, *, suppressed_ids: list[int],
                     temperature: float, chunk_tokens: int) -> Tensor:
    """Log-probs [N, C] of token_ids under softmax(hidden @ weight.T / temperature), suppressed ids removed.

    Only tokens where `mask` is True are scored (others are 0); they go through the output layer
    `chunk_tokens` at a time, forward and backward.
    """
    selected = mask.nonzero(as_tuple=True)
    suppressed = torch.tensor(suppressed_ids, device=hidden.device) if suppressed_ids else None
    values = _ChunkedTokenLogps.apply(hidden[selected], weight, token_ids[selected], suppressed, temperature,
                                      max(int(chunk_tokens), 1))  # [T]
    logps = torch.zeros(token_ids.shape, dtype=values.dtype, device=values.device)
    return logps.index_put(selected, values)  # [N, C]
