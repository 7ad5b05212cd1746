"""The trained model's weights, one tensor at a time, under the names and in the layout of a Hugging Face
checkpoint: what an engine with its own copy of the weights (vLLM) loads after every optimizer step.

- wrappers are looked through: DDP's `module.`, FSDP's `_fsdp_wrapped_module.`, checkpointing's
  `_checkpoint_wrapped_module.`, PEFT's `base_model.model.` and `.base_layer`; LoRA's own tensors are
  left out (the adapter is merged into the base weights first, and unmerged after: `merged_lora`);
- sharded parameters are gathered: FSDP2 `DTensor`s through `full_tensor()`, ZeRO-3 parameters inside
  DeepSpeed's `GatheredParameters`, one at a time (never the whole model at once);
- transformers' load-time conversions (fused MoE experts, renamed prefixes) are reverted with its own
  `revert_weight_conversion`, the step `save_pretrained` takes, so the names are the checkpoint's; the legacy
  renamings transformers records under DeepSpeed ZeRO-3 are left out, here and in checkpoints
  (`checkpoint_conversions`);
- the family may rename what its engine's loader expects differently (`Family.engine_weight_name`; None
  drops a tensor the engine has no place for).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch

_WRAPPERS = re.compile(r"(^|\.)(module|_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)\.")
_LORA = re.compile(r"\.(lora_[AB]|lora_embedding_[AB]|lora_magnitude_vector)(\.|$)")


def checkpoint_name(name: str) -> str | None:
    """A parameter's name without its wrappers' parts, as a Hugging Face checkpoint names it (None: a LoRA
    tensor, which never leaves the trainer: the engine gets merged weights)."""
    if _LORA.search(name):
        return None
    name = _WRAPPERS.sub(r"\1", name)
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


def whole_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter as one whole tensor (an FSDP2 DTensor gathered)."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else tensor


def _gathered(parameter: torch.nn.Parameter):
    """DeepSpeed ZeRO-3 gathers a partitioned parameter in this context; anything else is already whole."""
    if hasattr(parameter, "ds_id"):
        import deepspeed

        return deepspeed.zero.GatheredParameters([parameter], modifier_rank=None)
    return contextlib.nullcontext()


@contextlib.contextmanager
def merged_lora(model: torch.nn.Module):
    """The LoRA adapter merged into the base weights inside the block, unmerged after (no PEFT: nothing)."""
    peft_model = getattr(model, "module", model)
    merge = getattr(peft_model, "merge_adapter", None)
    if merge is None:
        yield
        return
    merge()
    try:
        yield
    finally:
        peft_model.unmerge_adapter()


def bare_transformers_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under DDP / FSDP / PEFT wrappers (what knows its weight conversions)."""
    model = getattr(model, "module", model)
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def engine_weights(model: torch.nn.Module, family=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, whole tensor) for every weight of `model`, one at a time; call inside `merged_lora`."""
    from transformers.core_model_loading import revert_weight_conversion

    bare = bare_transformers_model(model)
    conversions = _without_legacy(bare)
    seen: set[str] = set()
    for raw, parameter in model.named_parameters():  # buffers (rotary tables) the engine computes itself
        name = checkpoint_name(raw)
        if name is None or name in seen:
            continue
        seen.add(name)
        with _gathered(parameter):
            tensor = whole_tensor(parameter.detach())
            with _conversions(bare, conversions):
                converted_weights = revert_weight_conversion(bare, {name: tensor})
            for converted, value in converted_weights.items():
                final = family.engine_weight_name(converted) if family is not None else converted
                if final is not None:
                    yield final, value


def _without_legacy(bare: torch.nn.Module) -> list | None:
    """The conversions transformers recorded when `bare` loaded, less its legacy renamings (None: none recorded).
    What is recorded depends on the load path: under DeepSpeed ZeRO-3 it keeps the legacy renamings too, which
    revert Qwen2.5-VL's model.language_model.embed_tokens into model.model.embed_tokens, a name no engine loads."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    recorded = getattr(bare, "_weight_conversions", None)
    if recorded is None:
        return None

    def key(conversion) -> tuple:
        return (type(conversion).__name__, repr(getattr(conversion, "source_patterns", None)),
                repr(getattr(conversion, "target_patterns", None)))

    current = {key(c) for c in get_model_conversion_mapping(bare, add_legacy=False)}
    legacy = {key(c) for c in get_model_conversion_mapping(bare, add_legacy=True)} - current
    return [c for c in recorded if key(c) not in legacy]


@contextlib.contextmanager
def checkpoint_conversions(model: torch.nn.Module):
    """Within the block `save_pretrained` names `model`'s weights as the plain load path would (`_without_legacy`):
    under ZeRO-3 too, a checkpoint holds model.embed_tokens, not model.model.embed_tokens, for engines to load."""
    bare = bare_transformers_model(model)
    with _conversions(bare, _without_legacy(bare)):
        yield


@contextlib.contextmanager
def _conversions(bare: torch.nn.Module, conversions: list | None):
    """Within the block transformers reverts `bare`'s names with `conversions` (`_without_legacy`'s)."""
    if conversions is None:
        yield
        return
    recorded = bare._weight_conversions
    bare._weight_conversions = conversions
    try:
        yield
    finally:
        bare._weight_conversions = recorded
