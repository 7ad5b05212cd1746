"""The family protocol: everything the trainer needs from a vision-language model family, in one class.

A `Family` turns chat messages into a `PromptBatch` (left-padded processor outputs plus the layout of their
image rows), and answers every model-specific question the trainer, the rollout and the collectives ask:

- `encode` / `PromptBatch.select`: prompts, selected or repeated together with their images;
- `position_ids`: the positions of a full (prompt + completion) batch, or None where the model computes
  its own from the attention mask alone;
- `image_features`: the vision tower's outputs for the distinct prompts of a batch, in a form the model's
  forward accepts back (`mm_encoder_outputs`), so a group of G sequences encodes its images once;
- `fork_cache`: a prompt's cache (key/value layers, and the conv + recurrent states of linear-attention
  layers) repeated or indexed out to its G sequences, still in the autograd graph;
- `box_frame`: the frame of the boxes in the model's answers (`BOX_FRAMES`), and both conversions;
- `suppressed_ids`: token ids never sampled nor scored (vision placeholders);
- `vision_modules`: the qualified names of the vision tower's modules (freeze_vision, LoRA exclusion);
- `placeholder_prompts`: a one-image prompt that a process without data feeds the model in collectives;
- `completion_prefix`: text the chat template put at the end of the prompt that the task reads as part
  of the completion (an opened `<think>` block).

Families register by name (`register_family`; `FAMILIES` imports the built-ins on first use); `family_for`
picks the one of a model type, with the generic family (models/generic.py) for any other
`AutoModelForImageTextToText` model.

What is not the protocol lives beside it: `PromptBatch` and the per-token helpers in models/batch.py; tool-call
parsing and observation rendering in models/tool_calls.py (the methods here of the same names call it); the
mixture-of-experts router loss in models/router.py; the scoring path and the one scoring function in
models/scoring.py, which calls this protocol's small methods (`position_ids`, `fork_cache`, `vision_features`,
`logps_from_logits`) and is never called from here.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import replace

import torch
from torch import Tensor

from gpg_vl.config.names import FAMILY_BUILTINS
from gpg_vl.errors import UserError
from gpg_vl.models import tool_calls
from gpg_vl.models.batch import PromptBatch, image_order, message_images, unwrap
from gpg_vl.models.points import coordinates_to_original
from gpg_vl.models.points import format_number as _format_number
from gpg_vl.models.positions import text_positions
from gpg_vl.models.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_PARSERS, ToolCall
from gpg_vl.registry import Registry

PROMPT_STYLES = ("chat", "raw")
# The raw-text prompt of the paper's CV-Bench run with the base Qwen2-VL-2B (R1-V's), minus its forced
# "Let me solve this step by step.\n<think>" prefix, so that a completion holds its own <think> tag.
RAW_TEMPLATE = ("A conversation between User and Assistant. The user asks a question about the image, and the "
                "Assistant solves it. The assistant first thinks about the reasoning process in the mind and then "
                "provides the user with the answer.\nUser: {prompt}\nAssistant:")
# The frames a family's boxes can be in: (x, y) factors from original pixels (W, H, resized w, h) to the frame.
BOX_FRAMES = {
    "relative-1000": lambda W, H, w, h: (1000.0 / W, 1000.0 / H),  # 0-1000, relative to the image
    "resized-pixels": lambda W, H, w, h: (w / W, h / H),  # absolute pixels of the resized image
    "relative-1": lambda W, H, w, h: (1.0 / W, 1.0 / H),  # 0-1, relative to the image
    "none": None,  # the model has no box convention
}


_NUMBER = r"(-?\d+(?:\.\d+)?)"
_BOX_PATTERNS = (
    re.compile(rf"\[\s*{_NUMBER}\s*,\s*{_NUMBER}\s*,\s*{_NUMBER}\s*,\s*{_NUMBER}\s*\]"),  # [x1, y1, x2, y2]
    re.compile(rf"\(\s*{_NUMBER}\s*,\s*{_NUMBER}\s*\)\s*,\s*\(\s*{_NUMBER}\s*,\s*{_NUMBER}\s*\)"),  # (x1,y1),(x2,y2)
)
_POINT_PATTERN = re.compile(rf'("point_2d"\s*:\s*)\[\s*{_NUMBER}\s*,\s*{_NUMBER}\s*\]')  # Seg-Zero's "point_2d": [x, y]


# ---------------------------------------------------------------------------------------------
# the protocol, with what most families share
# ---------------------------------------------------------------------------------------------
class Family:
    """One model family. Subclasses set the class attributes and implement `encode` (and what differs).

    `box_frame`: a key of BOX_FRAMES. `pixel_keys`: the inputs that carry pixels (left out when image
    features are shared). `vision_tokens`: special tokens never sampled nor scored. `image_placeholder`:
    what stands for an image in a raw-text prompt. `thinking`: whether the chat template opens a think block
    at the generation prompt (Qwen3.5), which `enable_thinking=False` closes where the template allows.
    """

    name = "family"
    model_types: tuple[str, ...] = ()
    box_frame = "none"
    pixel_keys: tuple[str, ...] = ("pixel_values",)
    vision_tokens: tuple[str, ...] = ()
    image_placeholder = "<image>"
    video_placeholder: str | None = None  # what stands for a video in a raw-text prompt (None: no video)
    engine_takes_video = False  # whether `engine_videos` hands an engine (vLLM) a prompt's videos
    video_times_in_text = False  # whether text stands between a video's tokens (Qwen3-VL: frame timestamps)
    eos_tokens: tuple[str, ...] = ()
    max_aspect_ratio = 200.0  # images more elongated than this are bad rows
    placeholder_size = (32, 32)  # the blank image of `placeholder_prompts`
    processor_kwargs: dict = {}  # extra keywords of the processor call
    tool_call_format = "hermes"  # how the model writes tool calls: a key of TOOL_CALL_PARSERS
    tool_stop_strings: tuple[str, ...] = (TOOL_CALL_CLOSE,)  # a model segment ends after one of these

    def __init__(self, processor, config, *, min_pixels: int | None = None, max_pixels: int | None = None,
                 prompt_style: str = "chat", raw_template: str = RAW_TEMPLATE, enable_thinking: bool = True,
                 video_pixels: dict | None = None) -> None:
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.config = config
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        # a video frame's pixel budgets (min_pixels, max_pixels, total_pixels), where a part sets none
        self.video_pixels = dict(video_pixels or {"min_pixels": min_pixels, "max_pixels": max_pixels})
        if prompt_style not in PROMPT_STYLES:
            raise UserError(f"unknown model.prompt_style {prompt_style!r}; use one of {', '.join(PROMPT_STYLES)}.")
        if prompt_style == "chat" and not getattr(processor, "chat_template", None):
            raise UserError("the model's processor has no chat template; set model.prompt_style=raw "
                            "(a base model) or use a model directory that ships chat_template.jinja.")
        if "{prompt}" not in raw_template:
            raise UserError(f"model.raw_template {raw_template!r} has no {{prompt}} placeholder; add one where "
                            "the question (with its images) goes.")
        self.prompt_style, self.raw_template, self.enable_thinking = prompt_style, raw_template, enable_thinking
        vocab = self.tokenizer.get_vocab()
        self.suppressed_ids = sorted({vocab[t] for t in self.vision_tokens if t in vocab})
        eos = [self.tokenizer.convert_tokens_to_ids(t) for t in self.eos_tokens if t in vocab]
        eos.append(self.tokenizer.eos_token_id)
        self.eos_ids = sorted({i for i in eos if isinstance(i, int) and i >= 0})
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]

    # ---- prompts -------------------------------------------------------------------------------
    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The prompt text: the chat template (instruct models), or `raw_template` around the messages' text
        with each image's placeholder where it stands (base models, as the paper's CV-Bench run). `tools`: the
        function schemas the model may call (multi-turn rollouts), listed as the template lists them (`tools=`),
        or in a system message in Hermes' form where the template has no tool list."""
        if self.prompt_style == "chat":
            extra = {} if self.enable_thinking else {"enable_thinking": False}
            if tools and "tools" in (getattr(self.processor, "chat_template", None) or ""):
                extra["tools"] = tools
            elif tools:
                messages = tool_calls.with_tool_system_message(messages, tools)
            return self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
        parts = []
        for message in messages:
            for part in message["content"] if isinstance(message["content"], list) else [message["content"]]:
                if isinstance(part, str):
                    parts.append(part)
                elif part.get("type") == "image" or "image" in part:
                    parts.append(self.image_placeholder)
                elif part.get("type") == "video" or "video" in part:
                    parts.append(self.video_placeholder or "")  # a family without video refuses it in encode
                elif "text" in part:
                    parts.append(part["text"])
        return self.raw_template.replace("{prompt}", "".join(parts))

    def encode(self, messages_batch: list[list[dict]], ids: list[str] | None = None,
               tools: list[dict] | None = None) -> PromptBatch:
        """Chat messages -> a left-padded PromptBatch (images resized within the family's pixel limits); `tools`
        as `render` takes them."""
        raise NotImplementedError

    def completion_prefix(self, prompt_text: str) -> str:
        """The part of a completion that the chat template wrote into the prompt: an opened `<think>` block
        (Qwen3.5 in thinking mode) belongs to the answer the task scores. Empty for most families."""
        stripped = prompt_text.rstrip()
        if stripped.endswith("<think>"):
            return "<think>" + prompt_text[len(stripped):]
        return ""

    # ---- tool calls (multi-turn rollouts) ---------------------------------------------------------
    def parse_tool_call(self, text: str) -> ToolCall | None:
        """The tool call a model segment ends with (only the last call of a segment runs), None when it has
        none; a call that cannot be read is a ToolCall with `error`."""
        return TOOL_CALL_PARSERS[self.tool_call_format](text)

    def render_observation(self, text: str, images: list) -> str:
        """The text that follows a model segment ending in a tool call, as the chat template writes the turns
        (models/tool_calls.py)."""
        return tool_calls.render_observation(self, text, images)

    def encode_observation(self, text: str, images: list) -> tuple[list[int], dict[str, Tensor]]:
        """(token ids to append after a segment, the processor's image inputs for its new images)."""
        return tool_calls.encode_observation(self, text, images)

    def multi_turn_unsupported(self) -> str | None:
        """Why this family cannot carry images in a later turn (rollout.max_turns > 1), or None when it can."""
        return tool_calls.multi_turn_unsupported(self)

    def placeholder_prompts(self) -> PromptBatch:
        """One prompt holding a blank image: what a process without data feeds the model so that it still runs
        the same modules (the vision tower included) as the processes that have data."""
        from PIL import Image

        image = Image.new("RGB", self.placeholder_size)
        messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": ""}]}]
        return self.encode([messages], ids=["placeholder"])

    # ---- boxes: tasks work in original-image pixels, the model in its own frame ----------------------
    def box_scale(self, size: tuple[int, int, int, int]) -> tuple[float, float]:
        """(x, y) factors from original pixels (W, H) to the model's frame (`box_frame`)."""
        scale = BOX_FRAMES[self.box_frame]
        if scale is None:
            raise UserError(f"the {self.name} family declares no box frame, so a grounding task cannot read its "
                            "boxes; train a grounding task on a family with one (the Qwen-VL families).")
        return scale(*size)

    def require_box_frame(self, task) -> None:
        """A task that reads boxes on a family without a box frame fails in one sentence, before any work."""
        if getattr(task, "uses_boxes", False) and BOX_FRAMES[self.box_frame] is None:
            raise UserError(f"task {task.name!r} reads boxes, but the {self.name} model family declares no box "
                            "frame (0-1000, resized pixels or 0-1); choose a model family with one, such as Qwen-VL.")

    def to_model_frame(self, box, size: tuple[int, int, int, int]) -> tuple[float, float, float, float]:
        sx, sy = self.box_scale(size)
        return (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)

    def to_original_frame(self, box, size: tuple[int, int, int, int]) -> tuple[float, float, float, float]:
        sx, sy = self.box_scale(size)
        return (box[0] / sx, box[1] / sy, box[2] / sx, box[3] / sy)

    def fit_image(self, image):
        """An image a tool returns, resized as this family's processor would see it within its pixel limits
        (so its size as the model sees it is known). Unchanged where the processor resizes on its own."""
        return image

    def completion_to_original(self, text: str, sizes: list[tuple[int, int, int, int]], *,
                               points: bool = False) -> str:
        """Rewrite the boxes (and Seg-Zero `"point_2d": [x, y]` points) of a completion from the model's frame
        into original pixels of its first image; with `points` (a task that reads clicks: `Task.uses_points`),
        every box and point form of models/points.py, each number once."""
        if not sizes or BOX_FRAMES[self.box_frame] is None:
            return text
        if points:
            return coordinates_to_original(text, lambda values: self.to_original_frame(values, sizes[0]))
        if "," not in text:
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

    # ---- modules -------------------------------------------------------------------------------
    def vision_modules(self, model: torch.nn.Module) -> list[str]:
        """Qualified names of the modules of the vision tower and its projector, as `model` names them."""
        bare = unwrap(model)
        encoder = bare.get_encoder(modality="image") if hasattr(bare, "get_encoder") else None
        targets = [] if encoder is None or encoder is bare else [encoder]
        for name in ("multi_modal_projector", "mm_projector", "connector", "embed_vision"):
            for holder in (bare, getattr(bare, "model", None)):
                if holder is not None and isinstance(getattr(holder, name, None), torch.nn.Module):
                    targets.append(getattr(holder, name))
        ids = {id(m) for m in targets}
        return [name for name, module in model.named_modules() if id(module) in ids and name]

    # ---- positions, caches, image features -------------------------------------------------------
    # Called on every forward, these take the bare model (`unwrap(model)`, unwrapped once by the caller).
    def reset_positions(self, model: torch.nn.Module) -> None:
        """Forget rotary offsets (`rope_deltas`) that `generate` cached on the model for its own batch."""
        base = getattr(model, "model", None)
        if base is not None and hasattr(base, "rope_deltas"):
            base.rope_deltas = None

    def position_ids(self, model, inputs: dict[str, Tensor]) -> Tensor | None:
        """Positions [N, L] (or multimodal rotary positions [3, N, L]) of a full left-padded batch: the one place
        that decides them for scoring, the rollout's prefill, decode loop and `generate`, packing, prompt-once,
        multi-turn prefill and the teacher. Here the attention mask's count, as `generate` gives them; a family
        with multimodal rotary positions places them as vLLM does (models/positions.py)."""
        self.reset_positions(model)
        return text_positions(inputs["attention_mask"])  # [N, L]

    def prefill_positions(self, model, inputs: dict[str, Tensor]) -> Tensor | None:
        """The positions [..., N, P] the rollout's prefill of a left-padded prompt batch passes (`position_ids`),
        which the decode steps and the update use too (a model left to itself would count the padding, and place
        a video's text by its own rule)."""
        return self.position_ids(model, inputs)

    def prompt_once_unsupported(self, model: torch.nn.Module) -> str | None:
        """Why this model cannot run prompt-once exactly (None when it can)."""
        return None

    def packing_unsupported(self, model: torch.nn.Module) -> str | None:
        """Why the update cannot pack this model's sequences exactly (None when it can): models/packing.py."""
        from gpg_vl.models.packing import packing_unsupported

        return packing_unsupported(unwrap(model))

    def prefill_once_unsupported(self, model: torch.nn.Module) -> str | None:
        """Why the rollout cannot prefill each prompt once and fork its cache exactly here (None when it can)."""
        return self.prompt_once_unsupported(model)

    def fork_cache(self, model, cache, index: Tensor):
        """The cache with row `index[n]` of the prompts' cache as row n (key/value layers and linear-attention
        conv + recurrent states alike), out of place, so the gradient reaches the prompt through it."""
        cache.reorder_cache(index)
        base = getattr(model, "model", None)  # the rotary offsets generate continues from, forked alike
        deltas = getattr(base, "rope_deltas", None)
        if isinstance(deltas, Tensor) and deltas.shape[0] != index.numel():
            base.rope_deltas = deltas[index.to(deltas.device)]  # [B * G, 1]
        return cache

    def static_copy(self, model, cache, *, max_cache_len: int):
        """The forked cache copied into a preallocated `StaticCache` (no reallocation per decoded token), where
        every layer is a plain key/value layer; otherwise the dynamic cache as it is."""
        from transformers import DynamicLayer, StaticCache

        if not all(type(layer) is DynamicLayer for layer in cache.layers):
            return cache
        static = StaticCache(config=model.config, max_cache_len=max_cache_len)
        for source, target in zip(cache.layers, static.layers, strict=True):
            target.update(source.keys, source.values)  # [B * G, heads, P - 1, d]
        return static

    def shares_vision(self, model: torch.nn.Module) -> bool:
        """Whether the model's forward takes image features back (`mm_encoder_outputs`)."""
        return "mm_encoder_outputs" in inspect.signature(unwrap(model).model.forward).parameters

    def image_features(self, model, prompts: PromptBatch, prompt_index: list[int]):
        """Vision-tower outputs computed once per distinct prompt, listed per sequence (no copy)."""
        bare = model
        subset = prompts.select(sorted(set(prompt_index)))
        encoder = bare.model.get_image_features
        accepted = inspect.signature(encoder).parameters
        pixels = subset.inputs[self.pixel_keys[0]]
        extra = {key: value for key, value in subset.inputs.items() if key in accepted and key not in
                 ("input_ids", "attention_mask", self.pixel_keys[0])}
        encoded = encoder(pixels, **extra, return_dict=True)
        pooled = encoded.pooler_output  # per image (or per tile): a list, or a tensor with that first dimension
        rows = prompts.rows.get(self.pixel_keys[0])
        if rows is not None and len(pooled) == sum(rows[i] for i in sorted(set(prompt_index))) != sum(
                prompts.images_per_prompt[i] for i in sorted(set(prompt_index))):
            order = image_order(replace(prompts, images_per_prompt=rows), prompt_index)  # one entry per tile
        else:
            order = image_order(prompts, prompt_index)
        encoded.pooler_output = pooled[torch.tensor(order, device=pooled.device)] if isinstance(pooled, Tensor) \
            else [pooled[i] for i in order]
        return encoded

    def vision_features(self, model, prompts: PromptBatch, prompt_index: list[int]) -> dict:
        """`mm_encoder_outputs` for a batch's sequences: each modality's tower outputs once per distinct prompt
        (images here; a family whose processor reads video adds `video`)."""
        return {"image": self.image_features(model, prompts, prompt_index)} if prompts.has_images else {}

    def videos_unsupported(self) -> str | None:
        """Why this family cannot take a video in a prompt (None when it can)."""
        return None

    # ---- log-probs -------------------------------------------------------------------------------
    def logit_softcap(self, model) -> float | None:
        """The soft cap the model applies to its logits after the output layer (some Gemma models), or None."""
        text = getattr(model.config, "text_config", model.config)
        return getattr(text, "final_logit_softcapping", None) or None

    def logps_from_logits(self, logits: Tensor, token_ids: Tensor, *, temperature: float = 1.0) -> Tensor:
        """Log-softmax over the sampling distribution (suppressed ids removed), gathered at token_ids."""
        if self.suppressed_ids:
            logits = logits.index_fill(-1, torch.tensor(self.suppressed_ids, device=logits.device), float("-inf"))
        if temperature != 1.0:
            logits = logits / temperature
        logps = torch.log_softmax(logits, dim=-1)  # [N, C, V]
        return logps.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)  # [N, C]

    # ---- other rollout engines (gpg_vl/rollout/: vLLM) ----------------------------------------------
    def engine_images(self, messages: list[dict]) -> list:
        """A prompt's images as this family's processor receives them (an engine that renders prompts
        itself gets the same pixels)."""
        return message_images(messages)

    def engine_videos(self, messages: list[dict]) -> list:
        """A prompt's videos as this family's processor receives them: (frames, metadata) each. A family without
        video refuses a prompt that holds one."""
        from gpg_vl.data.video import message_videos

        if message_videos(messages):
            raise UserError(self.videos_unsupported() or f"the {self.name} family does not pass videos to an engine.")
        return []

    def engine_processor_kwargs(self) -> dict:
        """Keywords for an engine's own copy of this family's processor, so that it resizes images as
        `encode` does (the same min/max pixels)."""
        return {}

    def engine_weight_name(self, name: str) -> str | None:
        """The name an engine's loader takes for the checkpoint weight `name` (None: the engine has no place
        for it). vLLM's loaders read Hugging Face checkpoint names, which `models/weights.py` produces."""
        return name

    def describe(self, model: torch.nn.Module) -> str:
        """One line: the family, its box frame, and which throughput paths it can take on this model."""
        bare = unwrap(model)
        once, prefill = self.prompt_once_unsupported(bare), self.prefill_once_unsupported(bare)
        packing = self.packing_unsupported(bare)
        return (f"{self.name} family ({type(bare).__name__}): box frame {self.box_frame}; prompt-once update "
                f"{'yes' if once is None else 'no (' + once + ')'}; prefill-once rollout "
                f"{'yes' if prefill is None else 'no (' + prefill + ')'}; shared vision "
                f"{'yes' if self.shares_vision(bare) else 'no'}; packed update "
                f"{'yes' if packing is None else 'no (' + packing + ')'}")


# ---------------------------------------------------------------------------------------------
# the registry
# ---------------------------------------------------------------------------------------------
def _is_family(obj) -> bool:
    return isinstance(obj, type) and issubclass(obj, Family)


GENERIC = "generic"
# The built-in families, imported on first use (`FAMILIES.get`): no module imports them just to register them.
FAMILIES = Registry("model family", "model.family", builtins=FAMILY_BUILTINS, accepts=_is_family,
                    expects="a Family subclass")


def register_family(family: type[Family]) -> type[Family]:
    """Register a Family subclass under its `name` (its `model_types` then map to it); usable as a class
    decorator. A second family under a taken name raises."""
    if not _is_family(family):
        raise UserError(f"register_family needs a Family subclass with a `name`; got {family!r}.")
    return FAMILIES.register(family)


def model_types() -> dict[str, str]:
    """config.json model_type -> family name, over every registered family (the built-ins imported)."""
    return {model_type: name for name, family in FAMILIES.load_all().items() for model_type in family.model_types}


def family_for(model_type: str) -> str:
    """The family of a model type: its own where one is registered, else the generic family."""
    return model_types().get(model_type, GENERIC)


def get_family(name: str) -> type[Family]:
    """The family class `model.family` names: a registered name, a model type a family covers
    (qwen3_vl_moe -> qwen3_vl), `module:Name` or `path.py:Name`; else one sentence listing the valid names."""
    if ":" not in name and name not in FAMILIES:
        name = model_types().get(name, name)
    return FAMILIES.get(name)

