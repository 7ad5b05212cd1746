"""The `python` tool: the model's code run on the trajectory's images in a sandboxed interpreter (DeepEyesV2, Thyme,
PyVision: code as the visual tool).

A call is the family's tool-call format (`{"name": "python", "arguments": {"code": "..."}}` in Hermes JSON, or
Qwen3.5's `<function=python><parameter=code>...</parameter></function>`), or, as DeepEyesV2 and Thyme write it, a
fenced block at the end of a segment (`PYTHON_TEXT_CALL`; the segment stops at `</code>`):

    <code>
    ```python
    show(image_1.crop((0, 0, 256, 256)))
    ```
    </code>

The code runs as a notebook cell in the trajectory's own interpreter (gpg_vl/rollout/multiturn/sandbox.py: one
process per trajectory, from a warm pool, its variables kept across the trajectory's calls): `image_1`, `image_2`,
... are the prompt's images (PIL, original pixels), `images` their list; what it prints comes back as the
observation's text, and every image it shows (`show(image)`, `image.show()`, a numpy array, a cell whose last
expression is an image) or saves in its folder comes back as an image of the observation (resized by the family,
as every tool image is). A cell's last expression that is not an image is printed, as a notebook does. Its
exception (the traceback), a limit it hit (time, CPU, memory, output, image size) or a cell that prints nothing and
shows nothing is an error observation; the trajectory goes on, and after a kill the next call starts a new
interpreter. The settings: `rollout.tools.python.*` (PythonToolSettings).
"""

from __future__ import annotations

import re
import sys

from gpg_vl.errors import UserError
from gpg_vl.rollout.multiturn.sandbox import SandboxSpec, Session, Unsandboxed, pool_for, sandbox_problem
from gpg_vl.rollout.multiturn.tools import TextCall, ToolError, ToolResult, register_tool
from gpg_vl.rollout.multiturn.trajectory import MultiTurnSettings
from gpg_vl.rollout.settings import PythonToolSettings

CODE_OPEN, CODE_CLOSE = "<code>", "</code>"
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n?(.*?)```", re.DOTALL)
PARAMETERS = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "description": "Python to run; image_1, image_2, ... are the images (PIL)."},
    },
    "required": ["code"],
}
DESCRIPTION = ("Run Python code on the images: image_1, image_2, ... are the images as PIL images in their original "
               "pixels; print() what you find and show(image) to see an image (PIL and numpy are available, the "
               "variables are kept between calls).")


def parse_code_block(text: str) -> dict | None:
    """{"code": ...} when the segment ends with `<code> ```python ... ``` </code>` (the fence optional), else None."""
    end = text.rfind(CODE_CLOSE)
    if end < 0 or text[end + len(CODE_CLOSE):].strip():
        return None
    start = text.rfind(CODE_OPEN, 0, end)
    if start < 0:
        return None
    inner = text[start + len(CODE_OPEN):end]
    fenced = _FENCE.search(inner)
    return {"code": (fenced.group(1) if fenced else inner).strip("\n")}


PYTHON_TEXT_CALL = TextCall(stop=CODE_CLOSE, parse=parse_code_block)


def spec_of(chosen: PythonToolSettings, settings: MultiTurnSettings) -> SandboxSpec:
    return SandboxSpec.from_settings(chosen, settings.max_turns)


def prepare_python(settings: MultiTurnSettings) -> None:
    """Before the model loads: the settings agree, the sandbox starts here (one interpreter, started and checked),
    and the warm pool begins to fill; otherwise one sentence."""
    chosen = settings.tool("python", PythonToolSettings)
    if chosen.seconds >= settings.tool_seconds:
        raise UserError(f"rollout.tools.python.seconds={chosen.seconds:g} must be below rollout.tool_seconds="
                        f"{settings.tool_seconds:g}, which also covers encoding the observation; lower the first or "
                        "raise the second.")
    if chosen.sandbox == Unsandboxed.name:
        print(Unsandboxed.warning, file=sys.stderr, flush=True)
    spec = spec_of(chosen, settings)
    problem = sandbox_problem(spec)
    if problem is not None:
        raise UserError(f"the python tool's sandbox (rollout.tools.python.sandbox={chosen.sandbox}) cannot start "
                        f"here: {problem}; fix that, or set rollout.tools.python.sandbox=unsandboxed to run the "
                        "model's code without isolation.")
    pool_for(spec, chosen.pool)


@register_tool("python", description=DESCRIPTION, parameters=PARAMETERS, settings=PythonToolSettings,
               text_call=PYTHON_TEXT_CALL, prepare=prepare_python)
def python(context, code) -> ToolResult:
    if not code.strip():
        raise ToolError("the code is empty; write the Python to run.")
    chosen = context.settings.tool("python", PythonToolSettings)
    session = context.sessions.get("python")
    if session is None:
        session = context.sessions["python"] = Session(pool_for(spec_of(chosen, context.settings), chosen.pool),
                                                       context.originals)
    outcome = session.run(code, seconds=min(chosen.seconds, context.settings.tool_seconds),
                          cpu_seconds=chosen.cpu_seconds)
    return ToolResult(outcome.text, outcome.images, error=outcome.error)
