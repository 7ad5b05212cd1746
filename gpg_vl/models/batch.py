"""Prompts as the processor returns them (`PromptBatch`), and the per-token helpers that both the family
protocol (models/family.py) and prompt-once scoring (models/scoring.py) use.

A `PromptBatch` holds left-padded prompts and the layout of their image rows, so any subset of prompts can
be selected or repeated without knowing the family. `unwrap` and `eval_mode` are the two model helpers every
stage shares: the bare model under its wrappers, and sampling without dropout.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class PromptBatch:
    """Left-padded prompts and their images, as the processor returns them.

    `rows[key][i]` says how many rows (first-dimension entries) of `inputs[key]` belong to prompt i: Qwen's
    flattened patches, one entry per image, one per prompt; a key not in `rows` has one row per prompt.
    So any subset of prompts can be selected or repeated (`select`) without knowing the family.
    """

    inputs: dict[str, Tensor]  # input_ids [B, P], attention_mask [B, P], pixel tensors, ...
    images_per_prompt: list[int]
    ids: list[str] = field(default_factory=list)
    image_sizes: list[list[tuple[int, int, int, int]]] = field(default_factory=list)  # (W, H, w, h) per image
    rows: dict[str, list[int]] = field(default_factory=dict)
    texts: list[str] = field(default_factory=list)  # the rendered prompts
    videos_per_prompt: list[int] = field(default_factory=list)  # empty: no prompt holds a video

    def __len__(self) -> int:
        return self.inputs["input_ids"].shape[0]

    @property
    def has_images(self) -> bool:
        return sum(self.images_per_prompt) > 0

    @property
    def has_videos(self) -> bool:
        return sum(self.videos_per_prompt) > 0

    def select(self, indices: list[int], *, drop: tuple[str, ...] = ()) -> PromptBatch:
        """The prompts at `indices` (repeats allowed), with their images, in that order; `drop` leaves keys out."""
        selected = {}
        for key, value in self.inputs.items():
            if key in drop:
                continue
            counts = self.rows.get(key)
            if counts is None:
                selected[key] = value[torch.tensor(indices, dtype=torch.long, device=value.device)]
                continue
            starts = [0]
            for count in counts:
                starts.append(starts[-1] + count)
            picked = [r for i in indices for r in range(starts[i], starts[i + 1])]
            selected[key] = value[torch.tensor(picked, dtype=torch.long, device=value.device)]
        return PromptBatch(
            selected, [self.images_per_prompt[i] for i in indices], [self.ids[i] for i in indices] if self.ids else [],
            [self.image_sizes[i] for i in indices] if self.image_sizes else [],
            {key: [counts[i] for i in indices] for key, counts in self.rows.items() if key not in drop},
            [self.texts[i] for i in indices] if self.texts else [],
            [self.videos_per_prompt[i] for i in indices] if self.videos_per_prompt else [])

    def to(self, device: torch.device) -> PromptBatch:
        return PromptBatch({k: v.to(device) for k, v in self.inputs.items()}, self.images_per_prompt, self.ids,
                           self.image_sizes, self.rows, self.texts, self.videos_per_prompt)


# keys of processor outputs that count images per prompt (summed, not stacked, when observations add images)
COUNT_KEYS = ("batch_num_images",)


def per_token_keys(inputs: dict[str, Tensor]) -> list[str]:
    """The inputs that hold one value per prompt token ([B, P], like input_ids)."""
    shape = inputs["input_ids"].shape
    return [key for key, value in inputs.items() if isinstance(value, Tensor) and value.shape == shape]


def trim_left_padding(inputs: dict[str, Tensor]) -> dict[str, Tensor]:
    """Drop the leading columns that are padding in every row (a subset of a padded batch keeps them)."""
    used = inputs["attention_mask"].any(dim=0).nonzero()  # [P] columns with a real token
    start = int(used[0]) if used.numel() else 0
    if start == 0:
        return inputs
    return {**inputs, **{key: inputs[key][:, start:] for key in per_token_keys(inputs)}}


def extend_per_token(inputs: dict[str, Tensor], completion: Tensor, completion_mask: Tensor) -> dict[str, Tensor]:
    """Prompt inputs [B, P] followed by completions [B, C]: ids and mask appended, other per-token keys
    (token types) extended with zeros (text), per-image keys kept."""
    full = dict(inputs)
    for key in per_token_keys(inputs):
        tail = {"input_ids": completion, "attention_mask": completion_mask.to(inputs["attention_mask"].dtype)}.get(
            key, torch.zeros_like(completion, dtype=inputs[key].dtype))
        full[key] = torch.cat([inputs[key], tail], dim=1)  # [B, P + C]
    return full


def per_prompt_rows(per_item: list[int], counts: list[int]) -> list[int]:
    """Per-item row counts (per image, per video) summed per prompt, prompt i holding `counts[i]` items."""
    out, start = [], 0
    for count in counts:
        out.append(int(sum(per_item[start:start + count])))
        start += count
    return out


def image_order(prompts: PromptBatch, prompt_index: list[int], per_prompt: list[int] | None = None) -> list[int]:
    """Indices into the images of `prompts.select(sorted(set(prompt_index)))`, listed per sequence (of its
    videos with `per_prompt=prompts.videos_per_prompt`)."""
    per_prompt = prompts.images_per_prompt if per_prompt is None else per_prompt
    first_image, count = {}, 0
    for prompt in sorted(set(prompt_index)):
        first_image[prompt] = count
        count += per_prompt[prompt]
    return [first_image[prompt] + k for prompt in prompt_index for k in range(per_prompt[prompt])]


def message_images(messages: list[dict]) -> list:
    """The images of a prompt's messages, in order."""
    return [part["image"] for message in messages if isinstance(message.get("content"), list)
            for part in message["content"] if isinstance(part, dict) and part.get("image") is not None]


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The bare Hugging Face model under a DistributedDataParallel (or similar) wrapper and a PEFT wrapper.

    PEFT injects its adapters into the base model's layers, so the base model runs them too."""
    model = getattr(model, "module", model)
    get_base_model = getattr(model, "get_base_model", None)  # peft.PeftModel
    return get_base_model() if get_base_model is not None else model


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module):
    """Switch to eval mode (no dropout) for sampling, and back."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
