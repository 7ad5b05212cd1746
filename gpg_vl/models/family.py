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
`AutoModelForImageTextToText` model. `PromptBatch` and the per-token helpers live in models/batch.py.
`choose_scoring_path` decides once per run how the update scores sequences (prompt-once, shared vision, or
plain), and everything that depends on that choice (the forward, the micro-batch cost) reads the same
`ScoringPath`.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

import gpg_vl.distributed as distributed  # module access: tests replace forward_is_collective
from gpg_vl.config.names import FAMILY_BUILTINS
from gpg_vl.errors import UserError
from gpg_vl.models.batch import (  # noqa: F401  (PromptBatch and unwrap re-exported)
    PromptBatch,
    extend_per_token,
    image_order,
    message_images,
    per_token_keys,
    trim_left_padding,
    unwrap,
)
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


@dataclass(frozen=True)
class ToolCall:
    """The tool call a model segment ends with: a name and its arguments, or `error`, the sentence that says
    why the call could not be read (the observation the model then gets)."""

    name: str | None = None
    arguments: dict | None = None
    error: str | None = None


_TOOL_CALL_OPEN, _TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_XML_FUNCTION = re.compile(r"^\s*<function=([^>\s]+)>(.*?)</function>\s*$", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.DOTALL)


def _last_call_body(text: str) -> str | ToolCall | None:
    """The text inside the segment's last `<tool_call>` block, a ToolCall error when it is not closed, or None."""
    start = text.rfind(_TOOL_CALL_OPEN)
    if start < 0:
        return None
    body = text[start + len(_TOOL_CALL_OPEN):]
    end = body.find(_TOOL_CALL_CLOSE)
    if end < 0:
        return ToolCall(error="the tool call is not closed with </tool_call>.")
    return body[:end]


def parse_hermes_call(text: str) -> ToolCall | None:
    """The last `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` of a segment (Hermes JSON: Qwen2.5-VL,
    Qwen3-VL), None when there is none; a malformed one is a ToolCall with `error`."""
    body = _last_call_body(text)
    if body is None or isinstance(body, ToolCall):
        return body
    try:
        call = json.loads(body.strip())
    except ValueError as error:
        return ToolCall(error=f"the tool call is not valid JSON ({error}).")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall(error='the tool call must be a JSON object {"name": ..., "arguments": {...}}.')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(call["name"], error="the tool call's arguments must be a JSON object.")
    return ToolCall(call["name"], arguments)


def parse_xml_call(text: str) -> ToolCall | None:
    """The last `<tool_call><function=NAME><parameter=ARG>value</parameter></function></tool_call>` of a segment
    (Qwen3.5's format; a value is read as JSON where it is JSON, else as text), None when there is none."""
    body = _last_call_body(text)
    if body is None or isinstance(body, ToolCall):
        return body
    function = _XML_FUNCTION.match(body)
    if function is None:
        return ToolCall(error="the tool call must be <function=NAME><parameter=ARG>value</parameter></function>.")
    name, inner = function.groups()
    arguments = {}
    for key, raw in _XML_PARAMETER.findall(inner):
        value = raw.strip("\n")
        try:
            arguments[key] = json.loads(value)
        except ValueError:
            arguments[key] = value
    if _XML_PARAMETER.sub("", inner).strip():
        return ToolCall(name, error="the tool call has text outside its <parameter=...> blocks.")
    return ToolCall(name, arguments)


TOOL_CALL_PARSERS = {"hermes": parse_hermes_call, "xml": parse_xml_call}


def tool_system_text(tools: list[dict]) -> str:
    """The tool list in Hermes' form (what Qwen2.5's chat template writes for `tools=`): for a family whose template
    has no tool list of its own."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
            f"function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\nFor each "
            "function call, return a json object with function name and arguments within <tool_call></tool_call> XML "
            'tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def with_tool_system_message(messages: list[dict], tools: list[dict]) -> list[dict]:
    """`messages` with the tool list (`tool_system_text`) at the end of their system message, or in one of its own."""
    text = tool_system_text(tools)
    if messages and messages[0].get("role") == "system":
        content = messages[0]["content"]
        content = content + "\n\n" + text if isinstance(content, str) else \
            [*content, {"type": "text", "text": "\n\n" + text}]
        return [{**messages[0], "content": content}, *messages[1:]]
    return [{"role": "system", "content": [{"type": "text", "text": text}]}, *messages]


def _format_number(value: float) -> str:
    """Two decimals at most, none when they are zero: 50.0 -> '50', 12.345 -> '12.35'."""
    text = f"{value:.2f}".rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


# ---------------------------------------------------------------------------------------------
# the scoring path, chosen once per run
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ScoringPath:
    """How the update scores sequences. `prompt_once`: each distinct prompt runs once, its G completions on
    its forked cache; `shared_vision`: every sequence runs whole, its images encoded once per group;
    `wrapped`: the forward goes through the wrapper (FSDP / ZeRO-3 gather weights there), whole sequences."""

    prompt_once: bool = False
    shared_vision: bool = False
    wrapped: bool = False

    def describe(self) -> str:
        if self.prompt_once:
            return "prompt-once (each prompt runs once per group, completions on its forked cache)"
        how = "through the wrapped model" if self.wrapped else "on the bare model"
        vision = "images encoded once per group" if self.shared_vision else "images encoded per sequence"
        return f"whole sequences {how}, {vision}"


def checkpointing(model: torch.nn.Module) -> bool:
    """Whether activation (gradient) checkpointing is on: it drops the key/value cache in training forwards."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # transformers >= 5.x name first
        if name in dir(type(model)):
            return bool(getattr(model, name))
    return False


def choose_scoring_path(family: Family, model: torch.nn.Module, *, share_prompt: bool, share_vision: bool,
                        warn=None) -> ScoringPath:
    """The scoring path of a run: the fastest the settings allow that is exact for this family and engine.

    Prompt-once needs a cache in the training forward (no gradient checkpointing), the bare model's parts
    (not FSDP / ZeRO-3) and a family that forks its cache exactly; otherwise it steps aside, with one
    warning when the family is the reason. Shared vision needs a family whose model takes image features back.
    """
    wrapped = distributed.forward_is_collective(model)
    bare = unwrap(model)
    prompt_once = share_prompt and not wrapped and not checkpointing(bare)
    if prompt_once and family.prompt_once_unsupported(bare):
        if warn is not None:
            warn(f"trainer.share_prompt=true steps aside for this model: {family.prompt_once_unsupported(bare)}; "
                 "each sequence runs whole (same result, more compute).")
        prompt_once = False
    shared = share_vision and family.shares_vision(bare)
    return ScoringPath(prompt_once=prompt_once, shared_vision=shared, wrapped=wrapped)


SHARED_VISION = "gpg_shared_vision"  # model(..., gpg_shared_vision=(prompts, prompt_index)): see below


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
    eos_tokens: tuple[str, ...] = ()
    max_aspect_ratio = 200.0  # images more elongated than this are bad rows
    placeholder_size = (32, 32)  # the blank image of `placeholder_prompts`
    processor_kwargs: dict = {}  # extra keywords of the processor call
    tool_call_format = "hermes"  # how the model writes tool calls: a key of TOOL_CALL_PARSERS
    tool_stop_strings: tuple[str, ...] = (_TOOL_CALL_CLOSE,)  # a model segment ends after one of these

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
                messages = with_tool_system_message(messages, tools)
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

    def has_tool_role(self) -> bool:
        """Whether the chat template renders `tool` messages itself (Qwen3-VL's and Qwen3.5's: a user
        `<tool_response>` block, images kept); otherwise observations are user turns (`observation_messages`)."""
        template = getattr(self.processor, "chat_template", None) or ""
        return "tool_response" in template

    def observation_messages(self, text: str, images: list) -> list[dict]:
        """The chat message of an observation: a `tool` message where the template has the role, else a user
        turn holding `<tool_response>` + its images + its text + `</tool_response>` (DeepEyes' form)."""
        parts = [{"type": "image", "image": image} for image in images]
        if text:
            parts.append({"type": "text", "text": text})
        if self.has_tool_role():
            return [{"role": "tool", "content": parts}]
        return [{"role": "user", "content": [{"type": "text", "text": "<tool_response>\n"}, *parts,
                                             {"type": "text", "text": "\n</tool_response>"}]}]

    def render_observation(self, text: str, images: list) -> str:
        """The text that follows a model segment ending in a tool call: the end of the assistant's turn, the
        observation's turn and the next generation prompt, each as the chat template writes them."""
        marker = "GPGVLSEGMENTMARKER"
        before = [{"role": "user", "content": [{"type": "text", "text": "q"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": marker}]}]
        extra = {} if self.enable_thinking else {"enable_thinking": False}
        closed = self.processor.apply_chat_template(before, tokenize=False, add_generation_prompt=False, **extra)
        full = self.processor.apply_chat_template(before + self.observation_messages(text, images), tokenize=False,
                                                  add_generation_prompt=True, **extra)
        if not full.startswith(closed) or marker not in closed:
            raise UserError(f"the {self.name} family's chat template renders earlier turns differently once a "
                            "tool's observation follows, so a trajectory cannot continue its tokens; keep "
                            "rollout.max_turns=1 for this model.")
        return closed[closed.index(marker) + len(marker):] + full[len(closed):]

    def encode_observation(self, text: str, images: list) -> tuple[list[int], dict[str, Tensor]]:
        """(token ids to append after a segment, the processor's image inputs for its new images, e.g.
        pixel values and grid): the observation through the processor, images resized as `fit_image` does."""
        images = [self.fit_image(image) for image in images]
        rendered = self.render_observation(text, images)
        kwargs = {"images": images} if images else {}
        inputs = dict(self.processor(text=[rendered], return_tensors="pt", add_special_tokens=False, **kwargs,
                                     **self.processor_kwargs))
        ids = inputs.pop("input_ids")[0].tolist()
        inputs.pop("attention_mask", None)
        return ids, {key: value for key, value in inputs.items() if isinstance(value, Tensor)}

    def multi_turn_unsupported(self) -> str | None:
        """Why this family cannot carry images in a later turn (rollout.max_turns > 1), or None when it can."""
        if self.prompt_style != "chat":
            return "model.prompt_style=raw has no turns to put a tool's observation in; use the chat style"
        try:
            self.render_observation("probe", [])
        except UserError as error:
            return str(error)
        return None

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

    def completion_to_original(self, text: str, sizes: list[tuple[int, int, int, int]]) -> str:
        """Rewrite the boxes (and Seg-Zero `"point_2d": [x, y]` points) of a completion from the model's frame
        into original pixels of its first image."""
        if not sizes or "," not in text or BOX_FRAMES[self.box_frame] is None:
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
    def reset_positions(self, model: torch.nn.Module) -> None:
        """Forget rotary offsets (`rope_deltas`) that `generate` cached on the model for its own batch."""
        base = getattr(unwrap(model), "model", None)
        if base is not None and hasattr(base, "rope_deltas"):
            base.rope_deltas = None

    def position_ids(self, model, inputs: dict[str, Tensor]) -> Tensor | None:
        """Positions [N, L] of a full left-padded batch, as `generate` gives them (the attention mask's count)."""
        self.reset_positions(model)
        return (inputs["attention_mask"].long().cumsum(-1) - 1).clamp(min=0)  # [N, L]

    def prompt_once_unsupported(self, model: torch.nn.Module) -> str | None:
        """Why this model cannot run prompt-once exactly (None when it can)."""
        return None

    def prefill_once_unsupported(self, model: torch.nn.Module) -> str | None:
        """Why the rollout cannot prefill each prompt once and fork its cache exactly here (None when it can)."""
        return self.prompt_once_unsupported(model)

    def fork_cache(self, model, cache, index: Tensor):
        """The cache with row `index[n]` of the prompts' cache as row n (key/value layers and linear-attention
        conv + recurrent states alike), out of place, so the gradient reaches the prompt through it."""
        cache.reorder_cache(index)
        base = getattr(unwrap(model), "model", None)  # the rotary offsets generate continues from, forked alike
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
        bare = unwrap(model)
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
    def token_logps(
        self, model, prompts: PromptBatch, prompt_index: list[int], completion_ids: Tensor,
        completion_mask: Tensor, *, temperature: float = 1.0, share_vision: bool = True, share_prompt: bool = False,
        logits_chunk_tokens: int = 0, path: ScoringPath | None = None,
    ) -> Tensor:
        """Log-probs [N, C] of `completion_ids` [N, C]; sequence n continues prompt `prompt_index[n]`.

        `path` (chosen once per run by `choose_scoring_path`, or here from `share_vision` / `share_prompt`)
        says how: prompt-once runs each distinct prompt once, with gradient, its G sequences' completions on
        its forked cache (`models/scoring.py`); otherwise every sequence runs prompt + completion, and with
        shared vision each distinct prompt's images go through the vision tower once (with gradient), the G
        sequences reusing those features. Logits are computed for completion positions only; with
        `logits_chunk_tokens` > 0 that many tokens at a time, forward and backward. Suppressed tokens get
        -inf before the softmax, exactly as in sampling. The fast paths call the bare model's parts (the
        trainer averages gradients itself); under FSDP and ZeRO-3 the wrapped model runs whole sequences
        (images still encoded once per group, inside its forward) and full completion logits are computed.
        """
        if path is None:
            path = choose_scoring_path(self, model, share_prompt=share_prompt, share_vision=share_vision)
        return self._scored(model, prompts, prompt_index, completion_ids, completion_mask, None, path=path,
                            temperature=temperature, logits_chunk_tokens=logits_chunk_tokens)

    def trajectory_logps(self, model, prompts: PromptBatch, prompt_index: list[int], completion_ids: Tensor,
                         completion_mask: Tensor, observations: list, *, path: ScoringPath,
                         temperature: float = 1.0, logits_chunk_tokens: int = 0) -> Tensor:
        """`token_logps` of multi-turn trajectories: `observations[n]` is trajectory n (rollout/trajectory.py),
        whose completion holds observations; their token types and images go in with it, on every path
        (prompt-once too: the prompt once per group, the completions with their observations on its cache).
        `completion_mask` covers every token of a trajectory (the loss mask is the caller's)."""
        return self._scored(model, prompts, prompt_index, completion_ids, completion_mask, observations, path=path,
                            temperature=temperature, logits_chunk_tokens=logits_chunk_tokens)

    def _scored(self, model, prompts: PromptBatch, prompt_index: list[int], completion_ids: Tensor,
                completion_mask: Tensor, observations: list | None, *, path: ScoringPath, temperature: float,
                logits_chunk_tokens: int) -> Tensor:
        from gpg_vl.models import scoring

        bare = unwrap(model)
        chunked = logits_chunk_tokens > 0 and not path.wrapped
        if path.prompt_once:
            hidden = scoring.prompt_once_hidden(self, model, prompts, prompt_index, completion_ids,
                                               completion_mask, observations)  # [N, C, H]
            return self._hidden_logps(bare, hidden, completion_ids, completion_mask, temperature=temperature,
                                      chunk_tokens=logits_chunk_tokens or hidden.shape[0] * hidden.shape[1])
        shared = path.shared_vision and (prompts.has_images or prompts.has_videos) and observations is None
        sequences = trim_left_padding(prompts.select(prompt_index, drop=self.pixel_keys if shared else ()).inputs)
        if observations is None:
            full = extend_per_token(sequences, completion_ids, completion_mask)  # [N, P + C] per-token keys
        else:  # multi-turn: the observations' token types and images inside the completions
            full = scoring.with_observations(prompts, prompt_index, sequences, completion_ids, completion_mask,
                                             observations)
        if shared and path.wrapped:  # encoded inside the wrapped model's forward, see _encode_shared_vision_in_forward
            _encode_shared_vision_in_forward(model, self)
            full[SHARED_VISION] = (prompts, prompt_index)
        elif shared:
            full["mm_encoder_outputs"] = self.vision_features(bare, prompts, prompt_index)
        positions = self.position_ids(bare, full)
        if positions is not None:
            full["position_ids"] = positions
        completion_length = completion_ids.shape[1]
        # the router loss's tokens, as on the prompt-once path: not the padding, not the last completion column
        mask = full["attention_mask"]
        self.weigh_router_tokens(bare, lambda: torch.cat([mask[:, :-1], mask[:, -1:] * 0], dim=1))
        if chunked:  # hidden states only; the output layer runs chunk by chunk
            hidden = bare.model(**full, use_cache=False).last_hidden_state[:, -completion_length - 1:-1]  # [N, C, H]
            return self._hidden_logps(bare, hidden, completion_ids, completion_mask, temperature=temperature,
                                      chunk_tokens=logits_chunk_tokens)
        outputs = (model if path.wrapped else bare)(**full, use_cache=False, logits_to_keep=completion_length + 1)
        logits = outputs.logits[:, :-1].float()  # [N, C, V]
        return self.logps_from_logits(logits, completion_ids, temperature=temperature)

    def _hidden_logps(self, bare, hidden: Tensor, completion_ids: Tensor, completion_mask: Tensor, *,
                      temperature: float, chunk_tokens: int) -> Tensor:
        """Log-probs [N, C] from the final hidden states [N, C, H] through the output layer, in token chunks."""
        from gpg_vl.models.scoring import completion_logps

        return completion_logps(hidden, bare.get_output_embeddings().weight, completion_ids,
                                completion_mask.bool(), suppressed_ids=self.suppressed_ids,
                                temperature=temperature, chunk_tokens=chunk_tokens, softcap=self.logit_softcap(bare))

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

    # ---- mixture of experts -----------------------------------------------------------------------
    def router_aux_loss(self, model) -> Tensor | None:
        """The router's load-balancing loss (times `router_aux_loss_coef`) over the forwards since the last call,
        or None when the coefficient is 0 (the default, as TRL's GPG trainer) or the model has no router.

        The router logits are recorded by forward hooks on the model's router modules (the ones transformers
        itself records as `router_logits`), with each token's weight from `weigh_router_tokens` (forwards under
        no_grad, sampling, are not recorded). The loss is transformers' load-balancing loss with those weights
        (`router_balance_loss`): padding counts for nothing, and a prompt token counts once per sequence that
        continues it, on every scoring path, so prompt-once and the plain path give the same loss."""
        bare = unwrap(model)
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

    def weigh_router_tokens(self, model, weights: Callable[[], Tensor]) -> None:
        """The router loss's weight of each token, `weights()` [rows, seq], for the training forward that
        follows (0 for padding; a prompt run once for G sequences weighs G). Computed only when the router
        loss is on."""
        bare = unwrap(model)
        if _router_coef(bare)[0] > 0 and _router_recorder(bare) is not None:
            bare._gpg_router_weight = weights().detach().reshape(-1).float()

    def describe(self, model: torch.nn.Module) -> str:
        """One line: the family, its box frame, and which throughput paths it can take on this model."""
        bare = unwrap(model)
        once, prefill = self.prompt_once_unsupported(bare), self.prefill_once_unsupported(bare)
        return (f"{self.name} family ({type(bare).__name__}): box frame {self.box_frame}; prompt-once update "
                f"{'yes' if once is None else 'no (' + once + ')'}; prefill-once rollout "
                f"{'yes' if prefill is None else 'no (' + prefill + ')'}; shared vision "
                f"{'yes' if self.shares_vision(bare) else 'no'}")


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


def _encode_shared_vision_in_forward(model: torch.nn.Module, family: Family) -> None:
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
    bare, inner = unwrap(model), getattr(model, "module", model)
    modules = [bare]
    if callable(getattr(inner, "get_base_model", None)):  # PEFT
        modules.insert(0, inner.base_model)

    def encode(_, args, kwargs):
        request = kwargs.pop(SHARED_VISION, None)
        if request is not None:
            kwargs["mm_encoder_outputs"] = family.vision_features(bare, *request)
        return args, kwargs

    for module in modules:
        if getattr(module, "_gpg_shared_vision_hook", None) is None:
            module._gpg_shared_vision_hook = module.register_forward_pre_hook(encode, with_kwargs=True)


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module):
    """Switch to eval mode (no dropout) for sampling, and back."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
