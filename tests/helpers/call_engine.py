"""An out-of-tree rollout engine with a setting of its own, in this one file (docs/extending.md, "Engines"):
`ScriptedCallEngine`, the HF engine whose first segment of every `every`-th trajectory is a call of the task's
first tool, with no arguments (forced, still scored by the model; later segments sampled). Its setting is
`rollout.scripted_call.every`, declared here and nowhere else: the config types, checks and lists it from
`ScriptedCallSettings`.

    python scripts/train.py rollout.engine=tests/helpers/call_engine.py:ScriptedCallEngine \
        rollout.scripted_call.every=1 rollout.max_turns=2 task.name=tests/helpers/stamp_tool.py:ShapesWithStamp
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpg_vl.config.keys import meta
from gpg_vl.rollout.hf import HFEngine
from gpg_vl.rollout.multiturn.decoding import generate_trajectories


@dataclass
class ScriptedCallSettings:
    """`rollout.scripted_call.*`."""

    every: int = field(default=2, metadata=meta(
        "the first segment of every this-many-th trajectory calls the task's first tool", low=1))


class ScriptedCallEngine(HFEngine):
    name = "scripted_call"
    settings_class = ScriptedCallSettings

    def __init__(self, policy, rollout, *, accelerator=None) -> None:
        super().__init__(policy, rollout, accelerator=accelerator)  # rollout.hf.* as the HF engine reads them
        self.every = self.settings_in(rollout).every

    def generate(self, prompts, group_size, sampling):
        if not self.multiturn.multi_turn:
            return super().generate(prompts, group_size, sampling)
        family = self.policy.family
        call = family.tokenizer(f'<tool_call>\n{{"name": "{self.tools[0]}", "arguments": {{}}}}\n</tool_call>',
                                add_special_tokens=False)["input_ids"]

        def scripted(row: int, turn: int):
            return call if turn == 0 and row % self.every == 0 else None

        return generate_trajectories(self.policy, prompts, group_size=group_size, sampling=sampling,
                                     settings=self.multiturn, tools=self.tools, scripted=scripted)
