"""What the trainer needs from a vision-language model, and its implementation for the Qwen-VL families.

The trainer sees a `Policy`: `encode` turns chat messages into a left-padded `PromptBatch`,
`generate` samples completions, and `token_logps` scores completions under the same distribution
the sampler used (same temperature, same suppressed tokens), so the policy that is trained is the
policy that sampled. Qwen2-VL, Qwen2.5-VL and Qwen3-VL share this code; a family that differs subclasses
`QwenVLAdapter` and overrides what differs (Qwen2-VL: the box frame; Qwen3-VL: also the processor call and
the shared vision features).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from qwen_vl_utils import process_vision_info
from torch import Tensor

from gpg_vl.errors import UserError

ASSETS = Path(__file__).resolve().parents[1] / "assets"
EMBEDDED_PREFIX = "embedded:"
TINY_PREFIX = "tiny:"
VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>")
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"  # the processor expands the pad per image
PROMPT_STYLES = ("chat", "raw")
# The raw-text prompt of the paper's CV-Bench run with the base Qwen2-VL-2B (R1-V's), minus its forced
# "Let me solve this step by step.\n<think>" prefix, so that a completion holds its own <think> tag.
RAW_TEMPLATE = ("A conversation between User and Assistant. The user asks a question about the image, and the "
                "Assistant solves it. The assistant first thinks about the reasoning process in the mind and then "
                "provides the user with the answer.\nUser: {prompt}\nAssistant:")


@dataclass
class PromptBatch:
    """Left-padded prompts and their images, as the processor returns them.

    `images_per_prompt[i]` says how many of the flattened `pixel_values` / `image_grid_thw` rows
    belong to prompt i, so any subset of prompts can be selected (`select`) or repeated.
    """

    inputs: dict[str, Tensor]  # input_ids [B, P], attention_mask [B, P], mm_token_type_ids [B, P], ...
    images_per_prompt: list[int]
    ids: list[str] = field(default_factory=list)
    image_sizes: list[list[tuple[int, int, int, int]]] = field(default_factory=list)  # (W, H, w, h) per image

    def __len__(self) -> int:
        return self.inputs["input_ids"].shape[0]

    def select(self, indices: list[int], *, with_pixels: bool = True) -> PromptBatch:
        """The prompts at `indices` (repeats allowed), with their images, in that order."""
        index = torch.tensor(indices, dtype=torch.long)
        selected = {
            key: value[index.to(value.device)]
            for key, value in self.inputs.items()
            if key not in ("pixel_values", "image_grid_thw")
        }
        if "image_grid_thw" in self.inputs:
            grid = self.inputs["image_grid_thw"]  # [num_images, 3]
            patches = grid.prod(dim=1).tolist()
            image_start = [0]
            for count in self.images_per_prompt:
                image_start.append(image_start[-1] + count)
            patch_start = [0]
            for count in patches:
                patch_start.append(patch_start[-1] + count)
            image_rows, patch_chunks = [], []
            for i in indices:
                for image in range(image_start[i], image_start[i + 1]):
                    image_rows.append(image)
                    if with_pixels:
                        patch_chunks.append(self.inputs["pixel_values"][patch_start[image]:patch_start[image + 1]])
            selected["image_grid_thw"] = grid[torch.tensor(image_rows, dtype=torch.long).to(grid.device)]
            if with_pixels:
                selected["pixel_values"] = torch.cat(patch_chunks)
        return PromptBatch(
            selected,
            [self.images_per_prompt[i] for i in indices],
            [self.ids[i] for i in indices] if self.ids else [],
            [self.image_sizes[i] for i in indices] if self.image_sizes else [],
        )

    def to(self, device: torch.device) -> PromptBatch:
        return PromptBatch({k: v.to(device) for k, v in self.inputs.items()}, self.images_per_prompt, self.ids,
                           self.image_sizes)


_NUMBER = r"(-?\d+(?:\.\d+)?)"
_BOX_PATTERNS = (
    re.compile(rf"\[\s*{_NUMBER}\s*,\s*{_NUMBER}\s*,\s*{_NUMBER}\s*,\s*{_NUMBER}\s*\]"),  # [x1, y1, x2, y2]
    re.compile(rf"\(\s*{_NUMBER}\s*,\s*{_NUMBER}\s*\)\s*,\s*\(\s*{_NUMBER}\s*,\s*{_NUMBER}\s*\)"),  # (x1,y1),(x2,y2)
)
_POINT_PATTERN = re.compile(rf'("point_2d"\s*:\s*)\[\s*{_NUMBER}\s*,\s*{_NUMBER}\s*\]')  # Seg-Zero's "point_2d": [x, y]


def _format_number(value: float) -> str:
    """Two decimals at most, none when they are zero: 50.0 -> '50', 12.345 -> '12.35'."""
    text = f"{value:.2f}".rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


class QwenVLAdapter:
    """Qwen2.5-VL specifics (Qwen2-VL and Qwen3-VL subclass it): processor call, prompt text (chat template, or
    a raw-text template for base models), suppressed vision tokens, 3-D rotary positions, and the coordinate
    frame of boxes: absolute pixels of the RESIZED image."""

    processor_kwargs: dict = {}  # extra keywords of the processor call

    def __init__(self, processor, config, *, min_pixels: int | None, max_pixels: int | None,
                 prompt_style: str = "chat", raw_template: str = RAW_TEMPLATE) -> None:
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.config = config
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        # qwen_vl_utils resizes images to multiples of patch x merge size: 28 for Qwen2/2.5-VL, 32 for Qwen3-VL
        self.image_patch_size = getattr(processor.image_processor, "patch_size", 14)
        if prompt_style not in PROMPT_STYLES:
            raise UserError(f"unknown model.prompt_style {prompt_style!r}; use one of {', '.join(PROMPT_STYLES)}.")
        if prompt_style == "chat" and not getattr(processor, "chat_template", None):
            raise UserError("the model's processor has no chat template; set model.prompt_style=raw "
                            "(a base model) or use a model directory that ships chat_template.jinja.")
        if "{prompt}" not in raw_template:
            raise UserError(f"model.raw_template {raw_template!r} has no {{prompt}} placeholder; add one where "
                            "the question (with its images) goes.")
        self.prompt_style, self.raw_template = prompt_style, raw_template
        vocab = self.tokenizer.get_vocab()
        self.suppressed_ids = sorted({vocab[t] for t in VISION_TOKENS if t in vocab})
        eos = [self.tokenizer.convert_tokens_to_ids("<|im_end|>"), self.tokenizer.eos_token_id,
               self.tokenizer.convert_tokens_to_ids("<|endoftext|>")]
        self.eos_ids = sorted({i for i in eos if isinstance(i, int) and i >= 0})
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]

    # ---- prompts -------------------------------------------------------------------------------
    def render(self, messages: list[dict]) -> str:
        """The prompt text: the chat template (instruct models), or `raw_template` around the messages' text
        with each image's vision tokens where it stands (base models, as the paper's CV-Bench run)."""
        if self.prompt_style == "chat":
            return self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        parts = []
        for message in messages:
            for part in message["content"] if isinstance(message["content"], list) else [message["content"]]:
                if isinstance(part, str):
                    parts.append(part)
                elif part.get("type") == "image" or "image" in part:
                    parts.append(IMAGE_PLACEHOLDER)
                elif "text" in part:
                    parts.append(part["text"])
        return self.raw_template.replace("{prompt}", "".join(parts))

    def encode(self, messages_batch: list[list[dict]], ids: list[str] | None = None) -> PromptBatch:
        """Chat messages -> left-padded processor inputs. Images are resized within min/max pixels."""
        for messages in messages_batch:
            for message in messages:
                for part in message["content"] if isinstance(message["content"], list) else []:
                    if part.get("type") == "image" or "image" in part:
                        if self.min_pixels is not None:
                            part.setdefault("min_pixels", self.min_pixels)
                        if self.max_pixels is not None:
                            part.setdefault("max_pixels", self.max_pixels)
        texts = [self.render(messages) for messages in messages_batch]
        images_per_prompt, images, image_sizes = [], [], []
        for messages in messages_batch:
            originals = [part["image"].size for message in messages if isinstance(message["content"], list)
                         for part in message["content"] if hasattr(part.get("image"), "size")]
            prompt_images, _ = process_vision_info(messages, image_patch_size=self.image_patch_size)
            prompt_images = prompt_images or []
            images_per_prompt.append(len(prompt_images))
            images.extend(prompt_images)
            if len(originals) != len(prompt_images):  # images given by path: their sizes are unknown here
                originals = []
            image_sizes.append([(*original, *resized.size) for original, resized in zip(originals, prompt_images)])  # noqa: B905
        self.tokenizer.padding_side = "left"
        inputs = self.processor(text=texts, images=images or None, padding=True, return_tensors="pt",
                                **self.processor_kwargs)
        return PromptBatch(dict(inputs), images_per_prompt, list(ids or []), image_sizes)

    # ---- boxes: tasks work in original-image pixels, the model in its own frame ----------------------
    def box_scale(self, size: tuple[int, int, int, int]) -> tuple[float, float]:
        """(x, y) factors from original pixels (W, H) to the model's frame; here the resized image (w, h)."""
        width, height, resized_width, resized_height = size
        return resized_width / width, resized_height / height

    def to_model_frame(self, box, size: tuple[int, int, int, int]) -> tuple[float, float, float, float]:
        sx, sy = self.box_scale(size)
        return (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)

    def to_original_frame(self, box, size: tuple[int, int, int, int]) -> tuple[float, float, float, float]:
        sx, sy = self.box_scale(size)
        return (box[0] / sx, box[1] / sy, box[2] / sx, box[3] / sy)

    def completion_to_original(self, text: str, sizes: list[tuple[int, int, int, int]]) -> str:
        """Rewrite the boxes (and Seg-Zero `"point_2d": [x, y]` points) of a completion from the model's frame
        into original pixels of its first image."""
        if not sizes or "," not in text:
            return text

        def rewrite(match: re.Match) -> str:
            box = self.to_original_frame([float(v) for v in match.groups()], sizes[0])
            numbers = iter(_format_number(v) for v in box)
            return re.sub(_NUMBER, lambda _: next(numbers), match.group(0))

        def rewrite_point(match: re.Match) -> str:
            key, x, y = match.groups()
            point = self.to_original_frame([float(x), float(y)] * 2, sizes[0])[:2]
            numbers = iter(_format_number(v) for v in point)
            return key + re.sub(_NUMBER, lambda _: next(numbers), match.group(0)[len(key):])

        for pattern in _BOX_PATTERNS:
            text = pattern.sub(rewrite, text)
        return _POINT_PATTERN.sub(rewrite_point, text)

    # ---- positions and log-probs ---------------------------------------------------------------
    def position_ids(self, model, inputs: dict[str, Tensor]) -> Tensor:
        """Explicit 3-D rotary positions [3, N, L] for a full (prompt + completion) batch.

        Passing them avoids Qwen-VL's `rope_deltas`, which `generate()` caches on the model for its
        own batch and which would otherwise leak into a training forward of another batch size.
        """
        base = _unwrap(model).model
        base.rope_deltas = None
        if "image_grid_thw" not in inputs:
            mask = inputs["attention_mask"]
            positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # [N, L]
            return positions.unsqueeze(0).expand(3, -1, -1)
        positions, _ = base.get_rope_index(
            inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"],
            image_grid_thw=inputs["image_grid_thw"], attention_mask=inputs["attention_mask"],
        )
        return positions  # [3, N, L]

    def token_logps(
        self, model, prompts: PromptBatch, prompt_index: list[int], completion_ids: Tensor,
        completion_mask: Tensor, *, temperature: float = 1.0, share_vision: bool = True, share_prompt: bool = False,
        logits_chunk_tokens: int = 0,
    ) -> Tensor:
        """Log-probs [N, C] of `completion_ids` [N, C]; sequence n continues prompt `prompt_index[n]`.

        With `share_prompt`, each distinct prompt (images included) runs forward once, with gradient,
        and its G sequences' completions attend to its key/value cache (`models/prefix.py`); this
        needs the cache, so it is skipped under gradient checkpointing. Otherwise every sequence runs
        prompt + completion, and with `share_vision` each distinct prompt's images still go through
        the vision tower once (with gradient), the G sequences reusing those embeddings; without it
        every sequence re-encodes its images, as peers do. Logits are computed for completion
        positions only; with `logits_chunk_tokens` > 0 they are computed that many tokens at a time,
        forward and backward, never for all tokens at once. Suppressed tokens get -inf before the
        softmax, exactly as in sampling.

        These fast paths call the bare model's parts directly (the trainer averages gradients itself).
        Under FSDP and ZeRO-3 with several processes a module's weights are gathered only in the wrapped
        forward, so there the wrapped model runs every whole sequence (shared vision still applies: the
        images are encoded inside that forward) and full completion logits are computed.
        """
        from gpg_vl.distributed import forward_is_collective
        from gpg_vl.models import prefix

        bare = prefix.unwrap(model)
        wrapped = forward_is_collective(model)
        chunked = logits_chunk_tokens > 0 and not wrapped
        if share_prompt and not wrapped and not prefix.checkpointing(bare):
            hidden = prefix.prompt_once_hidden(self, model, prompts, prompt_index, completion_ids,
                                               completion_mask)  # [N, C, H]
            return self._hidden_logps(bare, hidden, completion_ids, completion_mask, temperature=temperature,
                                      chunk_tokens=logits_chunk_tokens or hidden.shape[0] * hidden.shape[1])
        has_images = "pixel_values" in prompts.inputs
        shared = share_vision and has_images
        sequences = prefix.trim_left_padding(prompts.select(prompt_index, with_pixels=not shared).inputs)
        input_ids = torch.cat([sequences["input_ids"], completion_ids], dim=1)  # [N, P + C]
        attention = torch.cat([sequences["attention_mask"], completion_mask.to(sequences["attention_mask"].dtype)],
                              dim=1)  # [N, P + C]
        full = {"input_ids": input_ids, "attention_mask": attention}
        if "mm_token_type_ids" in sequences:
            full["mm_token_type_ids"] = torch.cat(
                [sequences["mm_token_type_ids"], torch.zeros_like(completion_ids)], dim=1)  # [N, P + C]
        if has_images:
            full["image_grid_thw"] = sequences["image_grid_thw"]
        vision = {}
        if shared and wrapped:  # encoded inside the wrapped model's forward, see _encode_shared_vision_in_forward
            _encode_shared_vision_in_forward(model, self)
            vision[SHARED_VISION] = (prompts, prompt_index)
        elif shared:
            vision["mm_encoder_outputs"] = {"image": self.shared_image_features(bare, prompts, prompt_index)}
        elif has_images:
            vision["pixel_values"] = sequences["pixel_values"]
        position_ids = self.position_ids(bare, full)  # [3, N, P + C]
        completion_length = completion_ids.shape[1]
        forward = {"input_ids": input_ids, "attention_mask": attention, "position_ids": position_ids,
                   "image_grid_thw": full.get("image_grid_thw"), "use_cache": False, **vision}
        if chunked:  # hidden states only; the output layer runs chunk by chunk
            hidden = bare.model(**forward).last_hidden_state[:, -completion_length - 1:-1]  # [N, C, H]
            return self._hidden_logps(bare, hidden, completion_ids, completion_mask, temperature=temperature,
                                      chunk_tokens=logits_chunk_tokens)
        outputs = (model if wrapped else bare)(**forward, logits_to_keep=completion_length + 1)
        logits = outputs.logits[:, :-1].float()  # [N, C, V]
        return self.logps_from_logits(logits, completion_ids, temperature=temperature)

    def _hidden_logps(self, bare, hidden: Tensor, completion_ids: Tensor, completion_mask: Tensor, *,
                      temperature: float, chunk_tokens: int) -> Tensor:
        """Log-probs [N, C] from the final hidden states [N, C, H] through the output layer, in token chunks."""
        from gpg_vl.models.prefix import completion_logps

        return completion_logps(hidden, bare.get_output_embeddings().weight, completion_ids,
                                completion_mask.bool(), suppressed_ids=self.suppressed_ids,
                                temperature=temperature, chunk_tokens=chunk_tokens)

    def shared_image_features(self, model, prompts: PromptBatch, prompt_index: list[int]):
        """Vision-tower outputs computed once per distinct prompt, listed per sequence (no copy)."""
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        distinct = sorted(set(prompt_index))
        subset = prompts.select(distinct)
        encoded = _unwrap(model).model.get_image_features(
            subset.inputs["pixel_values"], subset.inputs["image_grid_thw"], return_dict=True).pooler_output
        return BaseModelOutputWithPooling(pooler_output=[encoded[i] for i in _image_order(prompts, prompt_index)])

    def logps_from_logits(self, logits: Tensor, token_ids: Tensor, *, temperature: float = 1.0) -> Tensor:
        """Log-softmax over the sampling distribution (suppressed ids removed), gathered at token_ids."""
        if self.suppressed_ids:
            logits = logits.index_fill(-1, torch.tensor(self.suppressed_ids, device=logits.device), float("-inf"))
        if temperature != 1.0:
            logits = logits / temperature
        logps = torch.log_softmax(logits, dim=-1)  # [N, C, V]
        return logps.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)  # [N, C]


@dataclass
class Policy:
    """The model being trained, its processor and its family adapter."""

    model: torch.nn.Module
    processor: object
    adapter: QwenVLAdapter
    name_or_path: str
    save_format: str = "full"  # how checkpoints write the weights: full, or for LoRA adapter / merged


def _image_order(prompts: PromptBatch, prompt_index: list[int]) -> list[int]:
    """Indices into the images of `prompts.select(sorted(set(prompt_index)))`, listed per sequence."""
    first_image, count = {}, 0
    for prompt in sorted(set(prompt_index)):
        first_image[prompt] = count
        count += prompts.images_per_prompt[prompt]
    return [first_image[prompt] + k for prompt in prompt_index for k in range(prompts.images_per_prompt[prompt])]


class Qwen2VLAdapter(QwenVLAdapter):
    """Qwen2-VL answers boxes in a 0-1000 frame normalised to the image, whatever its size."""

    def box_scale(self, size: tuple[int, int, int, int]) -> tuple[float, float]:
        width, height = size[0], size[1]
        return 1000.0 / width, 1000.0 / height


class Qwen3VLAdapter(Qwen2VLAdapter):
    """Qwen3-VL: boxes in the 0-1000 frame again (as Qwen2-VL), 16-pixel patches, and DeepStack.

    Its processor would resize images a second time to its own pixel limits (at least 65,536 pixels by
    default), so images keep the size qwen_vl_utils gave them (`do_resize=False`, as Qwen's cookbooks do).
    The vision tower returns, besides the merged image tokens, one feature map per DeepStack tap that the
    first decoder layers add at the image positions; shared vision features carry both, so one encoding
    per prompt serves its G sequences exactly as per-sequence pixels would.
    """

    processor_kwargs = {"do_resize": False}

    def shared_image_features(self, model, prompts: PromptBatch, prompt_index: list[int]):
        distinct = sorted(set(prompt_index))
        subset = prompts.select(distinct)
        encoded = _unwrap(model).model.get_image_features(
            subset.inputs["pixel_values"], subset.inputs["image_grid_thw"], return_dict=True)
        order = _image_order(prompts, prompt_index)
        encoded.pooler_output = [encoded.pooler_output[i] for i in order]
        encoded.deepstack_features = [[level[i] for i in order] for level in encoded.deepstack_features]
        return encoded


FAMILIES: dict[str, type[QwenVLAdapter]] = {"qwen2_vl": Qwen2VLAdapter, "qwen2_5_vl": QwenVLAdapter,
                                            "qwen3_vl": Qwen3VLAdapter}


def resolve_path(name_or_path: str) -> str:
    """`embedded:<name>` means a model shipped in gpg_vl/assets, `tiny:<family>` a tiny random model of a
    family built on first use (gpg_vl.models.tiny); anything else is a hub id or a path."""
    if name_or_path.startswith(TINY_PREFIX):
        from gpg_vl.models.tiny import TINY_FAMILIES, tiny_model_path

        family = name_or_path[len(TINY_PREFIX):]
        if family not in TINY_FAMILIES:
            raise UserError(f"no tiny model of family {family!r}; known: {', '.join(TINY_FAMILIES)}.")
        return str(tiny_model_path(family))
    if name_or_path.startswith(EMBEDDED_PREFIX):
        path = ASSETS / name_or_path[len(EMBEDDED_PREFIX):]
        if not (path / "config.json").is_file():
            raise UserError(f"the embedded model {name_or_path!r} is missing at {path}; "
                            "rebuild it with `python scripts/build_tiny.py`.")
        return str(path)
    return name_or_path


def load_policy(
    name_or_path: str, *, family: str = "qwen2_5_vl", dtype: str = "auto", min_pixels: int | None = None,
    max_pixels: int | None = None, trust_remote_code: bool = False, attn_implementation: str | None = None,
    device: torch.device | str = "cpu", prompt_style: str = "chat", raw_template: str = RAW_TEMPLATE,
) -> Policy:
    """Load model + processor from a hub id or a local directory; a failed download is one sentence."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = resolve_path(name_or_path)
    if family == "auto":
        family = _family_of(path)
    if family not in FAMILIES:
        raise UserError(f"unknown model family {family!r}; known: {', '.join(sorted(FAMILIES))} "
                        "(set model.family=).")
    if dtype == "auto":
        dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
    kwargs = {"trust_remote_code": trust_remote_code}
    try:
        processor = AutoProcessor.from_pretrained(path, **kwargs)
        model = AutoModelForImageTextToText.from_pretrained(
            path, dtype=getattr(torch, dtype), attn_implementation=attn_implementation, **kwargs)
    except OSError as error:
        where = "local directory" if Path(path).exists() else "Hugging Face Hub id"
        raise UserError(
            f"could not load the model {path!r} as a {where} ({str(error).splitlines()[0][:160]}); "
            "without network access, download it elsewhere and pass model.name_or_path=/path/to/local/copy."
        ) from None
    model.to(device)
    adapter = FAMILIES[family](processor, model.config, min_pixels=min_pixels, max_pixels=max_pixels,
                               prompt_style=prompt_style, raw_template=raw_template)
    return Policy(model=model, processor=processor, adapter=adapter, name_or_path=path)


SHARED_VISION = "gpg_shared_vision"  # model(..., gpg_shared_vision=(prompts, prompt_index)): see below


def _encode_shared_vision_in_forward(model: torch.nn.Module, adapter: QwenVLAdapter) -> None:
    """Let `model(...)` take `gpg_shared_vision=(prompts, prompt_index)` and encode those images itself.

    The shared vision features must be computed INSIDE the forward of whatever wraps the model
    (DDP, FSDP, DeepSpeed): FSDP all-gathers the root's parameters (the vision tower's patch embedding
    and merger among them) in its forward pre-hook, so encoding before calling the wrapper reads
    sharded weights; DDP prepares its gradient reducer in its forward. A forward pre-hook on the bare
    model runs inside the wrapper's forward and after FSDP's own pre-hook (FSDP prepends its hook).
    Under PEFT the bare model may be reached through its `forward` (PeftModelForCausalLM -> LoRA tuner ->
    `model.forward`), where no hook runs, or through its `__call__` (PeftModel): the hook goes on the tuner
    and on the bare model, and whichever runs first takes the keyword. Registered once per module; without
    the keyword the model behaves exactly as before.
    """
    bare, inner = _unwrap(model), getattr(model, "module", model)
    modules = [bare]
    if callable(getattr(inner, "get_base_model", None)):  # PEFT
        modules.insert(0, inner.base_model)

    def encode(_, args, kwargs):
        request = kwargs.pop(SHARED_VISION, None)
        if request is not None:
            kwargs["mm_encoder_outputs"] = {"image": adapter.shared_image_features(bare, *request)}
        return args, kwargs

    for module in modules:
        if getattr(module, "_gpg_shared_vision_hook", None) is None:
            module._gpg_shared_vision_hook = module.register_forward_pre_hook(encode, with_kwargs=True)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The bare Hugging Face model under a DistributedDataParallel (or similar) wrapper and a PEFT wrapper."""
    model = getattr(model, "module", model)
    get_base_model = getattr(model, "get_base_model", None)  # peft.PeftModel
    return get_base_model() if get_base_model is not None else model


def _family_of(path: str) -> str:
    """The adapter family of a local model directory, from its config.json's model_type."""
    import json

    config = Path(path) / "config.json"
    if not config.is_file():
        raise UserError(f"{path!r} has no config.json, so its model family is unknown; "
                        f"set model.family= to one of {', '.join(sorted(FAMILIES))}.")
    return json.loads(config.read_text()).get("model_type", "unknown")


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module):
    """Switch to eval mode (no dropout) for sampling, and back."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
