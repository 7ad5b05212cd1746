"""Tools a model may call during a rollout: registered Python functions with a JSON schema.

A tool is a function `tool(context, **arguments)` registered with `register_tool(name, description=...,
parameters=...)` (`parameters`: the JSON schema of its arguments, an OpenAI function's `parameters`). It
returns text, images or both (a `ToolResult`, a string, a PIL image, or a list of strings and images); it
raises `ToolError` with a sentence for a call it refuses. `run_tool` never raises: an unknown tool, arguments
that do not fit the schema, a refused call, an exception or a call past its time budget all come back as an
error observation (`ToolResult.error`), which the trajectory shows the model and the metrics count.

`TOOLS` is the registry (`zoom_in` built in); a task offers tools by name, and out-of-tree tools load as
tasks do: `module:name` or `path.py:name`. A tool owns its settings (`register_tool(..., settings=)`):
`rollout.tools.<tool>.*`, typed, checked and documented from that one declaration.

`zoom_in` is DeepEyes' crop: `bbox_2d` = [x1, y1, x2, y2] in the model's own box frame of the image it names
(`source`: 0 or "original_image" for the prompt's first image, k or "observation_k" for the k-th image the
model has seen, Mini-o3), converted by the family into original pixels; the crop is always cut from the
ORIGINAL image (a crop of a crop is the same region cut again at full resolution), the box clamped to the
source image, refused when its short side is at most `min_side` pixels or its aspect ratio above
`max_aspect_ratio` (its settings, `rollout.tools.zoom_in.*`), and the crop resized within the family's pixel
limits.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from gpg_vl.config.names import TOOL_BUILTINS
from gpg_vl.errors import UserError
from gpg_vl.models.tool_calls import ToolCall
from gpg_vl.registry import Registry
from gpg_vl.rollout.multiturn.trajectory import MultiTurnSettings
from gpg_vl.rollout.settings import ZoomInSettings


class ToolError(Exception):
    """A call the tool refuses; its message (one sentence) becomes the observation the model reads."""


@dataclass(frozen=True)
class ImageView:
    """An image the model has seen in a trajectory: which original it shows, which region of it (original
    pixels), and its size (W, H, w, h): the region's size in original pixels, then as the model saw it."""

    image: object  # PIL image, as fed to the model
    original: int  # index among the prompt's images (-1: an image a tool made, cropped from itself)
    box: tuple[float, float, float, float]  # (x1, y1, x2, y2) in that original's pixels
    size: tuple[int, int, int, int]


@dataclass
class ToolContext:
    """What a tool may read: the prompt's original images, every image the model has seen so far (the
    prompt's first, then each observation's), the family (box frame, pixel limits) and the settings."""

    originals: list
    views: list[ImageView]
    family: object
    settings: MultiTurnSettings = field(default_factory=MultiTurnSettings)
    sessions: dict = field(default_factory=dict)  # tool name -> what it keeps across the trajectory's calls

    def close(self) -> None:
        """The trajectory ended: close what its tools kept (the python tool's interpreter)."""
        sessions, self.sessions = self.sessions, {}
        for session in sessions.values():
            session.close()

    @classmethod
    def for_prompt(cls, images: list, sizes: list[tuple[int, int, int, int]], family,
                   settings: MultiTurnSettings) -> ToolContext:
        """The context of a prompt's trajectory: its images (original pixels) with their (W, H, w, h) sizes."""
        views = [ImageView(image, i, (0.0, 0.0, float(size[0]), float(size[1])), tuple(size))
                 for i, (image, size) in enumerate(zip(images, sizes, strict=True))]
        return cls(list(images), views, family, settings)

    def view(self, source) -> ImageView:
        """The image `source` names: None / 0 / "original_image" the prompt's first, k / "observation_k" the
        k-th image seen (0-based over the prompt's images and then the observations')."""
        if source is None or source == "original_image":
            index = 0
        elif isinstance(source, str) and source.startswith("observation_") and source[12:].isdigit():
            index = int(source[12:])
        elif isinstance(source, int) and not isinstance(source, bool):
            index = source
        else:
            raise ToolError(f"source {source!r} names no image; use \"original_image\" or \"observation_k\".")
        if not 0 <= index < len(self.views):
            raise ToolError(f"source {source!r} names no image; there are {len(self.views)} images so far "
                            f"(0 to {len(self.views) - 1}).")
        return self.views[index]


@dataclass
class ToolResult:
    """What a call returned: text, images (with their views, for crops), and whether it is an error."""

    text: str = ""
    images: list = field(default_factory=list)
    views: list[ImageView] = field(default_factory=list)
    error: bool = False
    encoded: tuple | None = None  # (token ids, image inputs) from the family's encode_observation, when done


def _is_tool(obj) -> bool:
    return callable(obj) and isinstance(getattr(obj, "parameters", None), dict)


# The built-in tools (gpg_vl/config/names.py), imported on first use; tools are named by a task's `tools`.
TOOLS = Registry("tool", "a task's `tools`", builtins=TOOL_BUILTINS, accepts=_is_tool,
                 expects="a tool (a function registered with register_tool)")


@dataclass(frozen=True)
class TextCall:
    """A call written as plain text instead of the family's tool-call format (a fenced code block): a segment
    stops at `stop`, and `parse(segment_text)` gives the tool's arguments when the segment ends in such a call
    (None otherwise)."""

    stop: str
    parse: Callable[[str], dict | None]


def register_tool(name: str, *, description: str, parameters: dict, settings: type | None = None,
                  text_call: TextCall | None = None, prepare: Callable | None = None):
    """Decorator: register `function(context, **arguments)` as the tool `name` with its JSON schema. `settings`:
    the tool's own settings, a dataclass of `meta` fields (gpg_vl/config/keys.py), which the config types, checks
    and documents as `rollout.tools.<name>.*`; the tool reads the run's values with `context.settings.tool(name,
    settings)`. `text_call`: a plain-text form of a call, read where the family's format finds none. `prepare(
    settings)`: run before the model loads (`prepare_tools`), with the run's MultiTurnSettings; it raises UserError
    (one sentence) when the tool cannot run here."""
    if parameters.get("type") != "object" or not isinstance(parameters.get("properties"), dict):
        raise UserError(f"tool {name!r}: parameters must be a JSON schema of type object with properties.")

    def decorate(function):
        function.name, function.description, function.parameters = name, description, parameters
        function.settings_class, function.text_call, function.prepare = settings, text_call, prepare
        return TOOLS.add(name, function)

    return decorate


def _text_calls(tools: tuple[str, ...] | None) -> list[tuple[str, TextCall]]:
    return [(name, TOOLS.get(name).text_call) for name in tools or ()
            if getattr(TOOLS.get(name), "text_call", None) is not None]


def with_tool_stops(settings: MultiTurnSettings, tools: tuple[str, ...] | None) -> MultiTurnSettings:
    """`settings` whose `stop_strings` are those of the offered tools' plain-text calls (a segment also stops there)."""
    stops = tuple(dict.fromkeys(call.stop for _, call in _text_calls(tools)))
    return settings if stops == settings.stop_strings else replace(settings, stop_strings=stops)


def read_call(family, text: str, tools: tuple[str, ...] | None):
    """The call a segment ends with: the family's format first (`Family.parse_tool_call`), else an offered tool's
    plain-text form (`TextCall`); None when there is none."""
    call = family.parse_tool_call(text)
    if call is not None:
        return call
    for name, text_call in _text_calls(tools):
        arguments = text_call.parse(text)
        if arguments is not None:
            return ToolCall(name, arguments)
    return None


def prepare_tools(rollout, tools: tuple[str, ...]) -> None:
    """Before the model loads: each offered tool's `prepare` with the multi-turn settings of `rollout`
    (RolloutSettings), when trajectories are on (a sandbox that cannot start: one sentence)."""
    settings = MultiTurnSettings.from_rollout(rollout)
    if not settings.multi_turn:
        return
    for name in tools:
        prepare = getattr(TOOLS.get(name), "prepare", None)
        if prepare is not None:
            prepare(settings)


def tool_schema(tool) -> dict:
    """The OpenAI / Hermes function schema of a tool, as chat templates take it in `tools=`."""
    return {"type": "function", "function": {"name": tool.name, "description": tool.description,
                                             "parameters": tool.parameters}}


# ---------------------------------------------------------------------------------------------
# running a call
# ---------------------------------------------------------------------------------------------
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "array": (list,),
               "object": (dict,), "null": (type(None),)}


def check_arguments(tool, arguments) -> None:
    """Raise ToolError when `arguments` do not fit the tool's schema (required keys, unknown keys, types)."""
    if not isinstance(arguments, dict):
        raise ToolError(f"the arguments of {tool.name} must be an object, not {type(arguments).__name__}.")
    properties = tool.parameters.get("properties", {})
    missing = [key for key in tool.parameters.get("required", []) if key not in arguments]
    if missing:
        raise ToolError(f"{tool.name} needs the argument(s) {', '.join(missing)}.")
    unknown = [key for key in arguments if key not in properties]
    if unknown:
        raise ToolError(f"{tool.name} takes no argument(s) {', '.join(unknown)}; it takes {', '.join(properties)}.")
    for key, value in arguments.items():
        kinds = properties[key].get("type")
        allowed = [kinds] if isinstance(kinds, str) else list(kinds or [])
        if allowed and not any(isinstance(value, _JSON_TYPES.get(kind, object)) and not (
                kind in ("integer", "number") and isinstance(value, bool)) for kind in allowed):
            raise ToolError(f"argument {key} of {tool.name} must be of type {' or '.join(allowed)}, not {value!r}.")


def _as_result(value) -> ToolResult:
    if isinstance(value, ToolResult):
        return value
    parts = value if isinstance(value, list | tuple) else [value]
    result = ToolResult()
    for part in parts:
        if isinstance(part, str):
            result.text += part
        elif hasattr(part, "size") and hasattr(part, "crop"):  # a PIL image
            result.images.append(part)
        else:
            raise ToolError(f"returned {type(part).__name__}; a tool returns text and/or images.")
    return result


def run_tool(name: str, arguments, context: ToolContext, *, allowed: tuple[str, ...] | None = None,
             seconds: float | None = None, room: int | None = None) -> ToolResult:
    """Run one call within `seconds` (default: the settings' `tool_seconds`) on a daemon thread; anything
    that goes wrong comes back as an error observation, never an exception. `allowed`: the tools offered.

    Inside the same guard and time budget, each image the tool returned is checked (pixels, aspect ratio) and
    resized by the family (`fit_image`), and with `room` (the tokens the trajectory has left) the observation is
    encoded (`ToolResult.encoded`), its text first cut to what could still fit in `room` tokens."""
    seconds = context.settings.tool_seconds if seconds is None else seconds
    if allowed is not None and name not in allowed:
        offered = ", ".join(allowed) or "none"
        return ToolResult(f"Error: there is no tool {name!r}; the tools are: {offered}.", error=True)
    try:
        tool = TOOLS.get(name)
    except UserError:
        return ToolResult(f"Error: there is no tool {name!r}.", error=True)
    outcome: dict = {}

    def call() -> None:
        try:
            check_arguments(tool, arguments)
            outcome["result"] = _observation(_as_result(tool(context, **arguments)), context, room)
        except ToolError as error:
            outcome["result"] = ToolResult(_cut(f"Error: {error}"), error=True)
        except Exception as error:  # noqa: BLE001  a tool's own failure is the trajectory's, never the run's
            outcome["result"] = ToolResult(_cut(f"Error: {name} failed ({type(error).__name__}: {error})."), error=True)
        except BaseException as error:  # noqa: BLE001  SystemExit, KeyboardInterrupt raised by the tool itself
            outcome["result"] = ToolResult(f"Error: {name} exited ({type(error).__name__}"
                                           f"{f': {error}' if str(error) else ''}).", error=True)

    worker = threading.Thread(target=call, name=f"tool-{name}", daemon=True)  # never joined past the budget
    worker.start()
    worker.join(seconds if seconds and seconds > 0 else None)
    if "result" not in outcome:
        return ToolResult(f"Error: {name} took longer than {seconds:g} s.", error=True)
    return outcome["result"]


ERROR_CHARS = 1000  # an error sentence longer than this is cut: the model reads its start


def _cut(text: str) -> str:
    return text if len(text) <= ERROR_CHARS else text[:ERROR_CHARS] + " ..."


def _observation(result: ToolResult, context: ToolContext, room: int | None) -> ToolResult:
    """The tool's result made ready for the trajectory: its images checked and fitted (a view each for those
    the tool made itself), and with `room`, its text cut and the observation encoded."""
    family = context.family
    limit = getattr(family, "max_aspect_ratio", None)
    for k, image in enumerate(result.images):
        width, height = image.size
        if min(width, height) < 1:
            raise ToolError(f"the tool returned an image of {width} x {height} pixels, which has nothing to show.")
        if limit and max(width, height) / min(width, height) > limit:
            raise ToolError(f"the tool returned an image of {width} x {height} pixels, whose aspect ratio "
                            f"{max(width, height) / min(width, height):.0f}:1 is above the {limit:g}:1 the "
                            "model's processor takes.")
        if k >= len(result.views):  # an image the tool made itself: a view of its own, as the model sees it
            fitted = family.fit_image(image)
            result.images[k] = fitted
            result.views.append(ImageView(fitted, -1, (0.0, 0.0, float(fitted.width), float(fitted.height)),
                                          (fitted.width, fitted.height, fitted.width, fitted.height)))
    if room is not None:
        most = max(0, room) * longest_token(family.tokenizer) + 1  # more characters than this cannot fit
        if len(result.text) > most:
            result.text = result.text[:most]
        result.encoded = family.encode_observation(result.text, result.images)
    return result


_LONGEST: dict[int, tuple[object, int]] = {}


def longest_token(tokenizer) -> int:
    """The most characters one token of `tokenizer` stands for (its longest vocabulary entry, byte-level
    entries counted in bytes): a text of n characters is at least n / this many tokens, however it is cut."""
    known = _LONGEST.get(id(tokenizer))
    if known is None or known[0] is not tokenizer:
        known = _LONGEST[id(tokenizer)] = (tokenizer, max(len(entry) for entry in tokenizer.get_vocab()))
    return known[1]


# ---------------------------------------------------------------------------------------------
# zoom_in (DeepEyes' image_zoom_in_tool)
# ---------------------------------------------------------------------------------------------
ZOOM_PARAMETERS = {
    "type": "object",
    "properties": {
        "bbox_2d": {"type": "array", "items": {"type": "number"}, "minItems": 4, "maxItems": 4,
                    "description": "The region to zoom into, [x1, y1, x2, y2], in your own box coordinates."},
        "label": {"type": "string", "description": "What the region shows (optional)."},
        "source": {"type": ["string", "integer"],
                   "description": "The image to crop: \"original_image\" (default) or \"observation_k\"."},
    },
    "required": ["bbox_2d"],
}


@register_tool("zoom_in", description="Zoom in on a region of the image: returns that region, cropped and enlarged.",
               parameters=ZOOM_PARAMETERS, settings=ZoomInSettings)
def zoom_in(context: ToolContext, bbox_2d, label: str | None = None, source=None) -> ToolResult:
    view = context.view(source)
    if len(bbox_2d) != 4 or not all(isinstance(v, int | float) and math.isfinite(v) for v in bbox_2d):
        raise ToolError(f"bbox_2d must be four numbers [x1, y1, x2, y2], not {bbox_2d!r}.")
    try:
        x1, y1, x2, y2 = context.family.to_original_frame([float(v) for v in bbox_2d], view.size)
    except UserError as error:
        raise ToolError(str(error)) from None
    left, top, right, bottom = view.box  # the source's region of its original: its frame's origin
    x1, x2 = sorted((left + x1, left + x2))
    y1, y2 = sorted((top + y1, top + y2))
    x1, x2 = min(max(x1, left), right), min(max(x2, left), right)  # clamped to the source image
    y1, y2 = min(max(y1, top), bottom), min(max(y2, top), bottom)
    width, height = x2 - x1, y2 - y1
    settings = context.settings.tool("zoom_in", ZoomInSettings)  # rollout.tools.zoom_in.*
    if min(width, height) <= settings.min_side:
        raise ToolError(f"the box is {width:.0f} x {height:.0f} pixels after clamping to the image; its short side "
                        f"must be more than {settings.min_side} pixels.")
    if max(width, height) / min(width, height) > settings.max_aspect_ratio:
        raise ToolError(f"the box's aspect ratio is {max(width, height) / min(width, height):.0f}; it must be at "
                        f"most {settings.max_aspect_ratio:g}.")
    box = (round(x1), round(y1), round(x2), round(y2))
    source_image = context.originals[view.original] if view.original >= 0 else view.image
    crop = source_image.crop(box)
    fitted = context.family.fit_image(crop)
    new_view = ImageView(fitted, view.original, tuple(float(v) for v in box), (*crop.size, *fitted.size))
    return ToolResult("", [fitted], [new_view])


def answer_call(call, context: ToolContext, *, allowed: tuple[str, ...] | None = None,
                room: int | None = None) -> ToolResult:
    """The observation for a parsed call (`Family.parse_tool_call`): its error sentence when the call could not
    be read, else what `run_tool` returns (encoded within `room` tokens, when given). Never raises."""
    if call.error is not None:
        return ToolResult(f"Error: {call.error}", error=True)
    return run_tool(call.name, call.arguments, context, allowed=allowed, room=room)
