"""The key/value cache a prompt is computed once into, forked for its G continuations (the prompt-once fork), in
both phases: generation (`prefill_once`: the B distinct prompts prefilled once, images included, their cache forked
G ways before `generate` or the decode loop samples the completions) and the multi-turn decoder
(gpg_vl/rollout/multiturn/decoding.py, `prefill_forked`); the update's prompt-once forward forks it the same way
(gpg_vl/models/scoring.py, `cache_of`). A forked cache can keep room for the whole completion (`reserve`,
`ReservedLayer`): no copy of the whole cache per decoded token.

What differs between families (how a cache forks, a static copy, positions) is asked of the family
(gpg_vl/models/family.py's `fork_cache`, `static_copy`, `prefill_positions`, `reset_positions`).
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import Tensor
from transformers import DynamicLayer

from gpg_vl.models.batch import per_token_keys, unwrap


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword under which `model`'s forward (and `generate`) takes a key/value cache: `cache` from transformers
    5.24 on, `past_key_values` before (5.24 renamed it). Passed under the other name, a cache is taken as an unknown
    keyword and ignored: the forward starts an empty cache, so completions scored (prompt-once) or decoded (the
    prefill-once loop) on a forked prompt cache lose their prompt (on transformers 5.15-5.23 the tiny Qwen2.5-VL's
    prompt-once log-probs were 1.25 nats per token off whole sequences' before this was asked)."""
    return _keyword_of(type(unwrap(model)))


@functools.cache
def _keyword_of(model_class: type) -> str:
    """`cache_keyword` of a model class, read once (the multi-turn decoder asks it at every fed chunk)."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def cache_of(outputs):
    """The cache of a model output (`cache` in transformers >= 5.x, `past_key_values` before)."""
    cache = getattr(outputs, "cache", None)
    return cache if cache is not None else getattr(outputs, "past_key_values", None)


def prefill_forked(family, bare, inputs: dict[str, Tensor], positions: Tensor | None, *, group_size: int):
    """The cache of B prompts' tokens but the last (`inputs` [B, P], images included), each prompt run once through
    the bare model with its `positions` [..., B, P - 1] (None: the model's own), forked G ways: row b * G + g
    continues prompt b."""
    head = {**inputs, **{key: inputs[key][:, :-1] for key in per_token_keys(inputs)}}  # [B, P - 1] each
    if positions is not None:
        head["position_ids"] = positions
    family.reset_positions(bare)
    prefilled = bare(**head, use_cache=True, logits_to_keep=1)
    index = torch.arange(inputs["input_ids"].shape[0], device=inputs["input_ids"].device).repeat_interleave(
        group_size)  # [B * G]
    return family.fork_cache(bare, cache_of(prefilled), index)


# ---------------------------------------------------------------------------------------------
# rollout: prefill each prompt once, fork its cache G ways
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def prefill_once(family, model, inputs: dict[str, Tensor], *, group_size: int, max_new_tokens: int,
                 static_cache: bool, reserve_cache: bool) -> dict | None:
    """`generate` keyword arguments that continue B prompts prefilled once, as B * G rows.

    All prompt tokens but the last go through the model once per prompt (images included); the family
    forks the cache G ways (into a preallocated static cache with `static_cache`, where the family can;
    else, with `reserve_cache`, into dynamic layers with room reserved for the whole completion), and
    `generate` then runs the last prompt token for the B * G rows, whose logits sample the first
    completion token. Returns None when the prompt cannot be split this way (a prompt ending in a vision
    token, or a single token).
    """
    ids = inputs["input_ids"]  # [B, P]
    last_is_vision = torch.isin(ids[:, -1], torch.tensor(family.suppressed_ids or [-1], device=ids.device))
    if ids.shape[1] < 2 or bool(last_is_vision.any()):
        return None
    bare = unwrap(model)
    positions = family.prefill_positions(bare, inputs)  # [..., B, P]: the family's, as decode and update use
    cache = prefill_forked(family, bare, inputs, None if positions is None else positions[..., :-1],
                           group_size=group_size)
    if static_cache:
        cache = family.static_copy(bare, cache, max_cache_len=ids.shape[1] + max_new_tokens)
    elif reserve_cache:
        cache = reserve(cache, capacity=ids.shape[1] + max_new_tokens)
    expanded = {key: inputs[key].repeat_interleave(group_size, dim=0) for key in per_token_keys(inputs)}
    if positions is not None and positions.dim() == 3:  # multimodal: `generate` continues from the family's
        index = torch.arange(ids.shape[0], device=ids.device).repeat_interleave(group_size)  # [B * G]
        expanded["position_ids"] = positions.index_select(-2, index)  # [3, B * G, P]
    return {**expanded, cache_keyword(bare): cache}


class ReservedLayer(DynamicLayer):
    """A `DynamicLayer` whose room for `capacity` tokens is allocated once.

    `update` writes the new key/value states in place and `keys` / `values` are views of the filled part:
    attention sees the very tensors (values and lengths) a `DynamicLayer` would give, without the
    dynamic layer's copy of the whole cache per decoded token. A cropped layer keeps writing in place after
    its shorter view. A layer that would outgrow its room, whose tensors were replaced from outside
    (reordered, rows selected) or that is asked to keep a gradient grows by concatenation instead, as
    `DynamicLayer` does.
    """

    def __init__(self, keys: Tensor, values: Tensor, capacity: int) -> None:  # keys, values [N, heads, S, d]
        super().__init__()
        self.device, self.is_initialized = keys.device, True
        self._keys = keys.new_empty(*keys.shape[:-2], capacity, keys.shape[-1])  # [N, heads, capacity, d]
        self._values = values.new_empty(*values.shape[:-2], capacity, values.shape[-1])
        self._write(keys, values, 0)

    def _write(self, keys: Tensor, values: Tensor, start: int) -> None:
        end = start + keys.shape[-2]
        self._keys[..., start:end, :] = keys
        self._values[..., start:end, :] = values
        self.keys, self.values = self._keys[..., :end, :], self._values[..., :end, :]

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        filled = self.keys.shape[-2]
        in_place = (self.keys.data_ptr() == self._keys.data_ptr() and self.keys.shape[0] == self._keys.shape[0]
                    and filled + key_states.shape[-2] <= self._keys.shape[-2]
                    and not (torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad)))
        if not in_place:
            return super().update(key_states, value_states, *args, **kwargs)
        self._write(key_states, value_states, filled)
        return self.keys, self.values


def reserve(cache, *, capacity: int):
    """The cache with every plain `DynamicLayer` moved into a `ReservedLayer` of `capacity` tokens (in place;
    other layers, e.g. sliding-window or linear-attention states, are left as they are)."""
    for index, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys.numel() > 0:
            cache.layers[index] = ReservedLayer(layer.keys, layer.values, max(capacity, layer.keys.shape[-2]))
    return cache
