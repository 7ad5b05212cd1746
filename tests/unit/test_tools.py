"""Tools (gpg_vl/rollout/multiturn/tools.py): the registry, the schema check, the time budget, and zoom_in's rules."""

from __future__ import annotations

import time

import pytest
from helpers.tool_context import StubFamily, context, gradient
from PIL import Image

from gpg_vl.errors import UserError
from gpg_vl.rollout.multiturn.tools import TOOLS, ToolContext, ToolError, register_tool, run_tool, tool_schema
from gpg_vl.rollout.multiturn.trajectory import MultiTurnSettings
from gpg_vl.rollout.settings import ZoomInSettings


def test_zoom_in_reads_the_model_frame_through_the_family_and_crops_the_original():
    ctx = context("relative-1000", (1000, 500))
    result = run_tool("zoom_in", {"bbox_2d": [100, 100, 500, 600]}, ctx)  # 0-1000 relative
    assert not result.error, result.text
    (view,) = result.views
    assert view.box == (100, 50, 500, 300)  # original pixels
    assert view.size == (400, 250, 200, 125)  # cut 400 x 250, seen at half size (the family's resize)
    assert result.images[0].size == (200, 125)
    # resized-pixels (Qwen2.5-VL): the prompt image was seen at 500 x 250
    result = run_tool("zoom_in", {"bbox_2d": [50, 25, 250, 150]}, context("resized-pixels", (1000, 500), (500, 250)))
    assert result.views[0].box == (100, 50, 500, 300)


def test_a_crop_of_a_crop_is_cut_again_from_the_original():
    ctx = context("relative-1000", (1000, 500))
    first = run_tool("zoom_in", {"bbox_2d": [100, 100, 500, 600]}, ctx)
    ctx.views.extend(first.views)
    # the right half of the first crop, named as Mini-o3 does and by index
    for source in ("observation_1", 1):
        second = run_tool("zoom_in", {"bbox_2d": [500, 0, 1000, 1000], "source": source}, ctx)
        assert not second.error, second.text
        assert second.views[0].box == (300, 50, 500, 300)
        assert second.views[0].original == 0
    direct = ctx.originals[0].crop((300, 50, 500, 300))
    assert second.images[0].tobytes() == direct.resize((100, 125)).tobytes()  # from the original, one resize
    bad = run_tool("zoom_in", {"bbox_2d": [0, 0, 500, 500], "source": "observation_7"}, ctx)
    assert bad.error and "observation_7" in bad.text


def test_a_box_is_clamped_to_the_image():
    result = run_tool("zoom_in", {"bbox_2d": [-200, -50, 1500, 700]}, context("relative-1000", (1000, 500)))
    assert result.views[0].box == (0, 0, 1000, 350)
    swapped = run_tool("zoom_in", {"bbox_2d": [500, 600, 100, 100]}, context("relative-1000", (1000, 500)))
    assert swapped.views[0].box == (100, 50, 500, 300)


@pytest.mark.parametrize(("side", "refused"), [(30, True), (31, False)])
def test_a_box_whose_short_side_is_at_most_the_minimum_is_refused(side, refused):
    result = run_tool("zoom_in", {"bbox_2d": [0, 0, 200, side]}, context("resized-pixels", (1000, 1000)))
    assert result.error is refused
    if refused:
        assert "short side" in result.text and "30" in result.text


def test_the_minimum_side_and_the_aspect_ratio_are_configurable():
    strict, lenient = ({"zoom_in": ZoomInSettings(min_side=side)} for side in (50, 10))  # rollout.tools.zoom_in
    assert run_tool("zoom_in", {"bbox_2d": [0, 0, 200, 40]}, context("resized-pixels", tools=strict)).error
    assert not run_tool("zoom_in", {"bbox_2d": [0, 0, 200, 40]}, context("resized-pixels", tools=lenient)).error
    wide = context("resized-pixels", (4000, 100))
    result = run_tool("zoom_in", {"bbox_2d": [0, 0, 3200, 31]}, wide)  # ratio 103 > 100
    assert result.error and "aspect ratio" in result.text
    assert not run_tool("zoom_in", {"bbox_2d": [0, 0, 3000, 31]}, wide).error  # ratio 96.8
    assert not run_tool("zoom_in", {"bbox_2d": [0, 0, 3200, 31]},
                        context("resized-pixels", (4000, 100),
                                tools={"zoom_in": ZoomInSettings(max_aspect_ratio=200)})).error


def test_a_family_without_a_box_frame_gets_an_error_observation():
    result = run_tool("zoom_in", {"bbox_2d": [0, 0, 100, 100]}, context("none"))
    assert result.error and "box frame" in result.text


@pytest.mark.parametrize(("arguments", "says"), [
    ({}, "needs the argument(s) bbox_2d"),
    ({"bbox_2d": [0, 0, 100, 100], "zoom": 2}, "takes no argument(s) zoom"),
    ({"bbox_2d": "0, 0, 100, 100"}, "must be of type array"),
    ({"bbox_2d": [0, 0, 100]}, "four numbers"),
    ({"bbox_2d": [0, 0, "a", 100]}, "four numbers"),
    ([0, 0, 100, 100], "must be an object"),
])
def test_bad_arguments_are_error_observations(arguments, says):
    result = run_tool("zoom_in", arguments, context("resized-pixels"))
    assert result.error and says in result.text


def test_unknown_and_not_offered_tools_are_error_observations():
    assert run_tool("teleport", {}, context()).error
    result = run_tool("zoom_in", {"bbox_2d": [0, 0, 100, 100]}, context(), allowed=("search",))
    assert result.error and "search" in result.text


@pytest.fixture
def registered():
    names = []

    def add(name, function, **schema):
        names.append(name)
        return register_tool(name, description=f"test tool {name}",
                             parameters=schema or {"type": "object", "properties": {}})(function)

    yield add
    for name in names:
        TOOLS.unregister(name)


def test_a_tool_that_raises_or_hangs_costs_an_error_observation_not_the_run(registered):
    def broken(context):
        raise RuntimeError("disk on fire")

    def hanging(context):
        time.sleep(30)

    registered("broken", broken)
    registered("hanging", hanging)
    result = run_tool("broken", {}, context())
    assert result.error and "RuntimeError: disk on fire" in result.text
    started = time.monotonic()
    result = run_tool("hanging", {}, context(), seconds=0.2)
    assert time.monotonic() - started < 5
    assert result.error and "longer than 0.2 s" in result.text
    result = run_tool("hanging", {}, context(tool_seconds=0.1))  # the settings' budget
    assert result.error and "longer than 0.1 s" in result.text


def test_a_tool_returns_text_images_or_both_and_its_schema_is_a_function_schema(registered):
    def echo(context, word: str):
        return [f"you said {word}", context.originals[0]]

    registered("echo", echo, type="object", properties={"word": {"type": "string"}}, required=["word"])
    result = run_tool("echo", {"word": "hi"}, context())
    assert (result.text, len(result.images), result.error) == ("you said hi", 1, False)
    assert tool_schema(TOOLS.get("echo")) == {"type": "function", "function": {
        "name": "echo", "description": "test tool echo",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}
    assert tool_schema(TOOLS.get("zoom_in"))["function"]["parameters"]["required"] == ["bbox_2d"]
    with pytest.raises(UserError, match="already registered"):
        registered("echo", lambda context: "again")


def test_out_of_tree_tools_load_from_a_file_or_a_module(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(
        "from gpg_vl.rollout.multiturn.tools import register_tool\n"
        "@register_tool('shout', description='upper case', parameters={'type': 'object', 'properties': "
        "{'text': {'type': 'string'}}})\n"
        "def shout(context, text=''):\n    return text.upper()\n")
    try:
        tool = TOOLS.get(f"{path}:shout")
        assert tool.name == "shout" and run_tool("shout", {"text": "hey"}, context()).text == "HEY"
        assert TOOLS.get("gpg_vl.rollout.multiturn.tools:zoom_in") is TOOLS.get("zoom_in")
        with pytest.raises(UserError, match="is not a tool"):
            TOOLS.get("gpg_vl.rollout.multiturn.tools:run_tool")
    finally:
        TOOLS.unregister("shout")


def test_a_refusal_raised_as_tool_error_reads_as_its_sentence(registered):
    def picky(context):
        raise ToolError("only on Tuesdays.")

    registered("picky", picky)
    assert run_tool("picky", {}, context()).text == "Error: only on Tuesdays."


def test_max_turns_above_one_is_refused_before_any_sampling_without_an_engine_a_task_or_a_tool_that_can():
    from gpg_vl.config.schema import RolloutSettings
    from gpg_vl.rollout.engine import ENGINES, Engine, build_engine

    class SingleTurn(Engine):
        name = "single_turn_only"

        def __init__(self, policy, rollout, *, accelerator=None) -> None:
            self.policy = policy

    ENGINES.add("single_turn_only", SingleTurn)
    try:
        cases = [(RolloutSettings(max_turns=2, engine="single_turn_only"), ("zoom_in",),
                  "rollout.engine=single_turn_only cannot roll out trajectories with tools"),
                 (RolloutSettings(max_turns=2), (), "needs a task that offers tools"),
                 (RolloutSettings(max_turns=2), ("no_such_tool",), "no_such_tool")]
        for rollout, tools, says in cases:
            with pytest.raises(UserError, match=says):
                build_engine(rollout, None, tools=tools)  # refused before the engine (or a model) is touched
        engine = build_engine(RolloutSettings(engine="single_turn_only"), None, tools=("zoom_in",))
        assert not engine.multiturn.multi_turn and engine.prompt_tools(None) is None  # max_turns=1: as before
        engine.take_tools(MultiTurnSettings(max_turns=3), ("zoom_in",))
        assert engine.prompt_tools(type("OwnPrompt", (), {"describe_tools": False})()) is None
        assert [t["function"]["name"] for t in engine.prompt_tools(None)] == ["zoom_in"]
    finally:
        ENGINES.unregister("single_turn_only")


class EncodingFamily(StubFamily):
    """A stub family that encodes an observation one token per character (vocabulary entries of at most 3
    characters), with the processor's 200:1 aspect-ratio limit; `delay` seconds per encoding."""

    max_aspect_ratio = 200.0

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__("relative-1000")
        self.delay, self.encoded = delay, []

        class Tokenizer:
            def get_vocab(self):
                return {"a": 0, "ab": 1, "abc": 2}

        self.tokenizer = Tokenizer()

    def encode_observation(self, text, images):
        time.sleep(self.delay)
        self.encoded.append((len(text), [image.size for image in images]))
        return list(range(len(text) + len(images))), {}


@pytest.mark.parametrize("size, says", [((0, 0), "0 x 0 pixels, which has nothing to show"),
                                        ((1, 5000), "1 x 5000 pixels, whose aspect ratio 5000:1 is above the 200:1")])
def test_an_image_a_tool_returns_that_cannot_be_used_is_a_tool_error_not_a_crash(registered, size, says):
    registered("odd", lambda context: ["look", Image.new("RGB", size)])
    family = EncodingFamily()
    ctx = ToolContext.for_prompt([gradient(40, 40)], [(40, 40, 40, 40)], family, MultiTurnSettings())
    result = run_tool("odd", {}, ctx, room=100)
    assert result.error and says in result.text and not result.images and result.encoded is None
    assert family.encoded == []  # nothing reached the processor


def test_an_image_a_tool_makes_is_fitted_inside_the_guard_with_a_view_as_the_model_sees_it(registered):
    registered("picture", lambda context: Image.new("RGB", (64, 32)))
    family = EncodingFamily()
    ctx = ToolContext.for_prompt([gradient(40, 40)], [(40, 40, 40, 40)], family, MultiTurnSettings())
    result = run_tool("picture", {}, ctx, room=100)
    assert not result.error and [image.size for image in result.images] == [(32, 16)]  # StubFamily halves
    assert [(v.original, v.box, v.size) for v in result.views] == [(-1, (0.0, 0.0, 32.0, 16.0), (32, 16, 32, 16))]
    assert family.encoded == [(0, [(32, 16)])] and result.encoded == ([0], {})


def test_tool_text_is_cut_to_what_could_fit_before_it_is_encoded_within_the_time_budget(registered):
    registered("chatty", lambda context: "x" * 1_000_000)
    family = EncodingFamily()
    ctx = ToolContext.for_prompt([gradient(40, 40)], [(40, 40, 40, 40)], family, MultiTurnSettings())
    result = run_tool("chatty", {}, ctx, room=50)
    # 50 tokens of at most 3 characters hold at most 150 characters: 151 cannot fit, whatever the cut
    assert family.encoded == [(151, [])] and len(result.text) == 151 and len(result.encoded[0]) > 50
    slow = EncodingFamily(delay=30)
    ctx = ToolContext.for_prompt([gradient(40, 40)], [(40, 40, 40, 40)], slow, MultiTurnSettings(tool_seconds=0.2))
    result = run_tool("chatty", {}, ctx, room=50)  # the encoding counts against tool_seconds
    assert result.error and "longer than 0.2 s" in result.text


@pytest.mark.parametrize("error, says", [(SystemExit(3), "exited (SystemExit: 3)"),
                                         (KeyboardInterrupt(), "exited (KeyboardInterrupt)")])
def test_a_tool_that_exits_is_reported_with_its_true_reason_at_once_and_no_thread_traceback(registered, capfd,
                                                                                           error, says):
    def leaving(context):
        raise error

    registered("leaving", leaving)
    result = run_tool("leaving", {}, context(), seconds=30)
    assert result.error and result.text == f"Error: leaving {says}."
    assert "Traceback" not in capfd.readouterr().err
