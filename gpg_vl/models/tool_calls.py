"""Tool calls and observations in a multi-turn rollout: reading the call a model segment ends with, and writing
the tool's observation back as the family's chat template writes a turn.

- `parse_hermes_call` / `parse_xml_call` (`TOOL_CALL_PARSERS`, picked by a family's `tool_call_format`): the
  last `<tool_call>` block of a segment, as a `ToolCall` (or its `error`, the sentence the model then reads);
- `tool_system_text` / `with_tool_system_message`: the tool list for a template that has none of its own;
- `observation_messages`, `render_observation`, `encode_observation`, `multi_turn_unsupported`: an observation
  as chat messages, as the text that continues a trajectory, and as token ids plus image inputs.

The family protocol (models/family.py) exposes these through its methods of the same names; what a family does
differently is read from its attributes (`processor`, `enable_thinking`, `fit_image`, `processor_kwargs`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from torch import Tensor

from gpg_vl.errors import UserError


@dataclass(frozen=True)
class ToolCall:
    """The tool call a model segment ends with: a name and its arguments, or `error`, the sentence that says
    why the call could not be read (the observation the model then gets)."""

    name: str | None = None
    arguments: dict | None = None
    error: str | None = None


TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_XML_FUNCTION = re.compile(r"^\s*<function=([^>\s]+)>(.*?)</function>\s*$", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.DOTALL)


def _last_call_body(text: str) -> str | ToolCall | None:
    """The text inside the segment's last `<tool_call>` block, a ToolCall error when it is not closed, or None."""
    start = text.rfind(TOOL_CALL_OPEN)
    if start < 0:
        return None
    body = text[start + len(TOOL_CALL_OPEN):]
    end = body.find(TOOL_CALL_CLOSE)
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



def has_tool_role(processor) -> bool:
    """Whether the chat template renders `tool` messages itself (Qwen3-VL's and Qwen3.5's: a user
    `<tool_response>` block, images kept); otherwise observations are user turns (`observation_messages`)."""
    template = getattr(processor, "chat_template", None) or ""
    return "tool_response" in template


def observation_messages(processor, text: str, images: list) -> list[dict]:
    """The chat message of an observation: a `tool` message where the template has the role, else a user
    turn holding `<tool_response>` + its images + its text + `</tool_response>` (DeepEyes' form)."""
    parts = [{"type": "image", "image": image} for image in images]
    if text:
        parts.append({"type": "text", "text": text})
    if has_tool_role(processor):
        return [{"role": "tool", "content": parts}]
    return [{"role": "user", "content": [{"type": "text", "text": "<tool_response>\n"}, *parts,
                                         {"type": "text", "text": "\n</tool_response>"}]}]


def render_observation(family, text: str, images: list) -> str:
    """The text that follows a model segment ending in a tool call: the end of the assistant's turn, the
    observation's turn and the next generation prompt, each as the family's chat template writes them."""
    marker = "GPGVLSEGMENTMARKER"
    before = [{"role": "user", "content": [{"type": "text", "text": "q"}]},
              {"role": "assistant", "content": [{"type": "text", "text": marker}]}]
    extra = {} if family.enable_thinking else {"enable_thinking": False}
    processor = family.processor
    closed = processor.apply_chat_template(before, tokenize=False, add_generation_prompt=False, **extra)
    full = processor.apply_chat_template(before + observation_messages(processor, text, images), tokenize=False,
                                         add_generation_prompt=True, **extra)
    if not full.startswith(closed) or marker not in closed:
        raise UserError(f"the {family.name} family's chat template renders earlier turns differently once a "
                        "tool's observation follows, so a trajectory cannot continue its tokens; keep "
                        "rollout.max_turns=1 for this model.")
    return closed[closed.index(marker) + len(marker):] + full[len(closed):]


def encode_observation(family, text: str, images: list) -> tuple[list[int], dict[str, Tensor]]:
    """(token ids to append after a segment, the processor's image inputs for its new images, e.g.
    pixel values and grid): the observation through the processor, images resized as `family.fit_image` does."""
    images = [family.fit_image(image) for image in images]
    rendered = family.render_observation(text, images)
    kwargs = {"images": images} if images else {}
    inputs = dict(family.processor(text=[rendered], return_tensors="pt", add_special_tokens=False, **kwargs,
                                   **family.processor_kwargs))
    ids = inputs.pop("input_ids")[0].tolist()
    inputs.pop("attention_mask", None)
    return ids, {key: value for key, value in inputs.items() if isinstance(value, Tensor)}


def multi_turn_unsupported(family) -> str | None:
    """Why `family` cannot carry images in a later turn (rollout.max_turns > 1), or None when it can."""
    if family.prompt_style != "chat":
        return "model.prompt_style=raw has no turns to put a tool's observation in; use the chat style"
    try:
        family.render_observation("probe", [])
    except UserError as error:
        return str(error)
    return None
