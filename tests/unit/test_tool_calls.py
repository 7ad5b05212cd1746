"""Tool-call parsing per family (Hermes JSON, Qwen3.5's XML): hand-written segments, malformed ones included."""

from __future__ import annotations

import pytest
from helpers.tool_context import context

from gpg_vl.models.family import FAMILIES
from gpg_vl.models.tool_calls import ToolCall, parse_hermes_call, parse_xml_call
from gpg_vl.rollout.multiturn.tools import answer_call

HERMES = ('<think>the sign is small</think>\n<tool_call>\n{"name": "zoom_in", "arguments": '
          '{"bbox_2d": [10, 20, 300, 400]}}\n</tool_call>')
XML = ("<think>look closer</think>\n<tool_call>\n<function=zoom_in>\n<parameter=bbox_2d>\n[10, 20, 300, 400]\n"
       "</parameter>\n<parameter=label>\nthe red sign\n</parameter>\n</function>\n</tool_call>")


def test_each_family_declares_its_format_and_stop_string():
    formats = {name: FAMILIES.get(name).tool_call_format for name in ("qwen2_5_vl", "qwen3_vl", "qwen3_5", "generic")}
    assert formats == {"qwen2_5_vl": "hermes", "qwen3_vl": "hermes", "qwen3_5": "xml", "generic": "hermes"}
    assert all(FAMILIES.get(name).tool_stop_strings == ("</tool_call>",) for name in formats)


def test_hermes_calls():
    assert parse_hermes_call(HERMES) == ToolCall("zoom_in", {"bbox_2d": [10, 20, 300, 400]})
    assert parse_hermes_call("<answer>A</answer>") is None
    # arguments written as a JSON string, and no arguments at all
    assert parse_hermes_call('<tool_call>{"name": "zoom_in", "arguments": "{\\"bbox_2d\\": [1, 2, 3, 4]}"}'
                             '</tool_call>') == ToolCall("zoom_in", {"bbox_2d": [1, 2, 3, 4]})
    assert parse_hermes_call('<tool_call>{"name": "now"}</tool_call>') == ToolCall("now", {})


def test_only_the_last_call_of_a_segment_runs():
    two = ('<tool_call>{"name": "a", "arguments": {}}</tool_call> then '
           '<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>')
    assert parse_hermes_call(two) == ToolCall("b", {"x": 1})
    assert parse_xml_call("<tool_call><function=a></function></tool_call>"
                          "<tool_call><function=b><parameter=x>1</parameter></function></tool_call>") == ToolCall(
        "b", {"x": 1})


def test_xml_calls():
    assert parse_xml_call(XML) == ToolCall("zoom_in", {"bbox_2d": [10, 20, 300, 400], "label": "the red sign"})
    assert parse_xml_call("no call here") is None
    assert parse_xml_call("<tool_call><function=now>\n</function></tool_call>") == ToolCall("now", {})


@pytest.mark.parametrize(("parser", "text", "says"), [
    (parse_hermes_call, '<tool_call>{"name": "zoom_in", "arguments": {"bbox_2d": [1, 2</tool_call>', "not valid JSON"),
    (parse_hermes_call, '<tool_call>{"name": "zoom_in", "arguments": {"bbox_2d": [1, 2, 3, 4]}}', "not closed"),
    (parse_hermes_call, '<tool_call>["zoom_in"]</tool_call>', "JSON object"),
    (parse_hermes_call, '<tool_call>{"name": "zoom_in", "arguments": [1, 2]}</tool_call>', "arguments must be"),
    (parse_xml_call, "<tool_call>zoom_in(1, 2)</tool_call>", "<function=NAME>"),
    (parse_xml_call, "<tool_call><function=zoom_in><parameter=bbox_2d>[1,2,3,4]</parameter>", "not closed"),
    (parse_xml_call, "<tool_call><function=zoom_in>stray<parameter=x>1</parameter></function></tool_call>",
     "outside its <parameter"),
])
def test_malformed_calls_carry_a_sentence(parser, text, says):
    call = parser(text)
    assert call.error is not None and says in call.error


def test_a_malformed_call_an_unknown_tool_and_bad_arguments_are_tool_errors():
    ctx = context("resized-pixels")
    for call in (parse_hermes_call("<tool_call>{oops}</tool_call>"),
                 parse_hermes_call('<tool_call>{"name": "teleport", "arguments": {}}</tool_call>'),
                 parse_xml_call("<tool_call><function=zoom_in><parameter=bbox_2d>[1, 2]</parameter></function>"
                                "</tool_call>")):
        result = answer_call(call, ctx, allowed=("zoom_in",))
        assert result.error and result.text.startswith("Error: ")
    good = answer_call(parse_xml_call(XML.replace("[10, 20, 300, 400]", "[0, 0, 300, 400]")), ctx)
    assert not good.error and len(good.images) == 1
