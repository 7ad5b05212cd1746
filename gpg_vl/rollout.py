"""Grouped rollouts: B prompts (images + text) -> B x G sampled completions.

Vision special tokens are suppressed during sampling (and, by the adapter, in the update's
log-probs), so they are never generated and never fed back as image placeholders. A completion's
mask covers its tokens up to and including the first end-of-sequence token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gpg_vl.distributed import forward_is_collective, gathered_for_generation
from gpg_vl.models import prefix
from gpg_vl.models.base import Policy
from gpg_vl.models.family import PromptBatch, eval_mode


@dataclass
class Rollout:
    """B x G completions; row b * G + g is the g-th completion of prompt b."""

    completion_ids: Tensor  # [B * G, C]
    completion_mask: Tensor  # [B * G, C] bool, True up to and including the first EOS
    texts: list[str]  # B * G decoded completions (special tokens removed)
    group_size: int


def completion_mask_from_eos(completion_ids: Tensor, eos_ids: list[int], *, ignore_eos: bool = False) -> Tensor:
    """[N, C] bool mask: True up to and including the first EOS of each row (all True with ignore_eos)."""
    if ignore_eos or not eos_ids:
        return torch.ones_like(completion_ids, dtype=torch.bool)
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))  # [N, C]
    eos_seen_before = (is_eos.long().cumsum(dim=1) - is_eos.long()) > 0  # [N, C]
    return ~eos_seen_before


@torch.no_grad()
def generate(
    policy: Policy, prompts: PromptBatch, *, group_size: int, max_new_tokens: int, temperature: float = 1.0,
    top_p: float = 1.0, do_sample: bool = True, ignore_eos: bool = False, prefill_once: bool = False,
    static_cache: bool = False,
) -> Rollout:
    """Sample `group_size` completions for every prompt with Hugging Face `generate`.

    With `prefill_once`, each prompt (images included) is prefilled once and its key/value cache forked
    G ways (`models/prefix.py`), instead of prefilling every one of the B * G rows; `static_cache`
    preallocates that cache (no per-token reallocation while decoding). Under FSDP / ZeRO-3 with several
    processes (generation is collective there) the rows are prefilled by `generate` itself, in step.
    """
    adapter, model = policy.adapter, policy.model
    inputs = prompts.to(model.device).inputs
    adapter.reset_positions(model)  # rotary offsets an earlier generate cached for its own batch
    collective = forward_is_collective(model)
    expand, forked = group_size, None
    if prefill_once and group_size > 1 and not collective and adapter.prefill_once_unsupported(model) is None:
        with eval_mode(model):
            forked = prefix.prefill_once(adapter, model, inputs, group_size=group_size, max_new_tokens=max_new_tokens,
                                         static_cache=static_cache)
    if forked is not None:
        inputs, expand = forked, 1
    elif static_cache:
        inputs = {**inputs, "cache_implementation": "static"}
    suppress = list(adapter.suppressed_ids)
    if ignore_eos:
        suppress += adapter.eos_ids
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0} if do_sample else {
        "do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    # Under FSDP / ZeRO-3 generation is collective: synced_gpus keeps every process decoding until all are done.
    with eval_mode(model), gathered_for_generation(model):
        output = model.generate(
            **inputs, max_new_tokens=max_new_tokens, num_return_sequences=expand,
            suppress_tokens=suppress or None, eos_token_id=adapter.eos_ids, pad_token_id=adapter.pad_id,
            synced_gpus=collective, **sampling,
        )
    completion_ids = output[:, prompts.inputs["input_ids"].shape[1]:]  # [B * G, C]
    if completion_ids.shape[1] == 0:
        completion_ids = torch.full((output.shape[0], 1), adapter.pad_id, dtype=output.dtype, device=output.device)
    mask = completion_mask_from_eos(completion_ids, adapter.eos_ids, ignore_eos=ignore_eos)  # [B * G, C]
    completion_ids = completion_ids.masked_fill(~mask, adapter.pad_id)  # [B * G, C]
    texts = adapter.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return Rollout(completion_ids=completion_ids, completion_mask=mask, texts=texts, group_size=group_size)


def in_task_frame(policy: Policy, task, texts: list[str], prompts: PromptBatch, group_size: int) -> list[str]:
    """Completions as the task scores them: with what the chat template opened in the prompt for them (a
    think block), and boxes moved from the model's frame into original pixels."""
    prefixes = [policy.adapter.completion_prefix(text) for text in prompts.texts] if prompts.texts else []
    if prefixes:
        texts = [prefixes[i // group_size] + text for i, text in enumerate(texts)]
    if not getattr(task, "uses_boxes", False) or not prompts.image_sizes:
        return texts
    return [policy.adapter.completion_to_original(text, prompts.image_sizes[i // group_size])
            for i, text in enumerate(texts)]
