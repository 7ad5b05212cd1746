"""Out-of-tree pieces for multi-turn runs through the command line: `ShapesWithZoom`, the shapes task offering
`zoom_in`, and `ScriptedToolEngine`, the HF engine whose first segment of every other trajectory is a `zoom_in`
call on the middle of the image (forced, still scored by the model; later segments sampled), so that a tiny
random model's rollouts hold tool calls and crops. Loaded as `task.name=tests/helpers/tool_engine.py:ShapesWithZoom` and
`rollout.engine=tests/helpers/tool_engine.py:ScriptedToolEngine`."""

from __future__ import annotations

from gpg_vl_tasks.shapes import Shapes

from gpg_vl.rollout.hf import HFEngine
from gpg_vl.rollout.multiturn.decoding import generate_trajectories


class ShapesWithZoom(Shapes):
    """Shapes with the zoom_in tool, and a reward for a trajectory that received a crop (so that the groups of a
    tiny random model, scripted to call the tool in every other trajectory, carry signal)."""

    name = "shapes_with_zoom"
    tools = ("zoom_in",)

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.reward_functions["cropped"] = lambda completion, row: float("<tool_response>" in completion)


def call_text(family, box: str) -> str:
    """A zoom_in call on `box` (already in the model's frame) in the family's tool-call format."""
    if family.tool_call_format == "xml":
        return f"<tool_call>\n<function=zoom_in>\n<parameter=bbox_2d>\n{box}\n</parameter>\n</function>\n</tool_call>"
    return f'<tool_call>\n{{"name": "zoom_in", "arguments": {{"bbox_2d": {box}}}}}\n</tool_call>'


def centre_call(family, size: tuple) -> list[int]:
    """Token ids of a zoom_in call on the middle half of an image of `size` (original w, h, resized w, h)."""
    width, height = size[0], size[1]
    region = (width * 0.25, height * 0.25, width * 0.75, height * 0.75)
    box = "[" + ", ".join(str(round(v)) for v in family.to_model_frame(region, size)) + "]"
    return family.tokenizer(call_text(family, box), add_special_tokens=False)["input_ids"]


class ScriptedToolEngine(HFEngine):
    name = "scripted_tools"

    def generate(self, prompts, group_size, sampling):
        if not self.multiturn.multi_turn:
            return super().generate(prompts, group_size, sampling)
        family, sizes = self.policy.family, prompts.batch.image_sizes

        def scripted(row: int, turn: int):
            return centre_call(family, sizes[row // group_size][0]) if turn == 0 and row % 2 == 0 else None

        return generate_trajectories(self.policy, prompts, group_size=group_size, sampling=sampling,
                                     settings=self.multiturn, tools=self.tools, scripted=scripted)
