"""An out-of-tree tool with a setting of its own, in this one file (docs/extending.md, "Tools"): `stamp` answers
every call with the text `rollout.tools.stamp.text`, declared here and nowhere else (`StampSettings`); and
`ShapesWithStamp`, the shapes task offering it, with a reward for a trajectory whose observation holds that
text. Loaded as `task.name=tests/helpers/stamp_tool.py:ShapesWithStamp`."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpg_vl_tasks.shapes import Shapes

from gpg_vl.config.keys import meta
from gpg_vl.rollout.multiturn.tools import register_tool


@dataclass
class StampSettings:
    """`rollout.tools.stamp.*`."""

    text: str = field(default="stamped", metadata=meta("what every stamp call answers", nonempty=True))


@register_tool("stamp", description="Stamp the picture: answers with a fixed text.",
               parameters={"type": "object", "properties": {}}, settings=StampSettings)
def stamp(context) -> str:
    return context.settings.tool("stamp", StampSettings).text


class ShapesWithStamp(Shapes):
    """Shapes with the stamp tool; a trajectory that received a stamp is rewarded (so the groups carry signal)."""

    name = "shapes_with_stamp"
    tools = ("stamp",)

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.reward_functions["stamped"] = lambda completion, row: float("<tool_response>" in completion)
