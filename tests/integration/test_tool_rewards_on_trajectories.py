"""The tool-use rewards read crops off the trajectory (its call records) or, text alone, off the decoded trajectory
text (gpg_vl/reward/tooluse.py). Here the trajectories and texts come
from real multi-turn rollouts of each family that can take tools (scripted segments: a crop, free text, a refused
box, a crop), so the rule is checked against what the engine writes, not against a hand-made string."""

from __future__ import annotations

import pytest
from helpers.runs import tiny_family_policy

from gpg_vl.reward.tooluse import crops_used, final_segment, tool_bonus, tool_format_reward

FAMILIES = ["qwen2_5_vl", "qwen3_vl", "qwen3_5", "glm4v", "internvl"]


@pytest.fixture(scope="module", params=FAMILIES)
def family_policy(request, tmp_path_factory):
    return tiny_family_policy(request.param, tmp_path_factory)


def test_crops_counted_from_the_decoded_text_match_the_trajectories(family_policy):
    from helpers.scripted_turns import sample  # the scripted rollouts of the multi-turn tests

    _, rollout = sample(family_policy, "incremental")
    for text, trajectory in zip(rollout.texts, rollout.trajectories, strict=True):
        received = sum(not call.error and call.images > 0 for call in trajectory.calls)
        assert crops_used(text) == received, text
        assert tool_bonus(text, 1.0) == float(received > 0) and tool_bonus(text, 0.0) == 0.0
        assert "<tool_response>" not in final_segment(text)
    assert [crops_used(text) for text in rollout.texts] == [1, 0, 0, 1]  # crop, free text, refused box, crop
    # the engine closes each call it runs: the scripted call adds no unbalanced tag to the text before the crop
    assert tool_format_reward(rollout.texts[0][:rollout.texts[0].index("<tool_response>")]) == 0.0


@pytest.mark.parametrize("workers", [1, 3])
def test_rewards_receive_the_trajectory_and_the_tool_bonus_reads_its_calls(family_policy, workers):
    """The texts are stripped of their observations, so only the trajectories can tell which received a crop."""
    from helpers.scripted_turns import sample

    from gpg_vl.data.task import Task
    from gpg_vl.reward.pool import score_completions
    from gpg_vl.reward.tooluse import TOOL_REWARDS, crops_received

    class Judged(Task):
        name = "judged"

        def __init__(self):
            super().__init__()
            self.reward_functions, self.reward_weights = TOOL_REWARDS.get("deepeyes")(
                lambda completion, row: 1.0, {"accuracy": 0.8, "format": 0.2, "tool": 1.2})
            self.reward_functions["turns"] = lambda completion, row, trajectory=None: float(trajectory.turns)
            self.reward_functions["plain"] = lambda completion, row: float(len(completion) >= 0)

    _, rollout = sample(family_policy, "incremental")
    texts = [final_segment(text) for text in rollout.texts]  # no <tool_response> left to search
    task = Judged()
    scores, late, errors, *_ = score_completions(task, texts, [{}] * len(texts), workers=workers,
                                                 trajectories=rollout.trajectories)
    assert late == errors == 0
    assert [s["tool"] for s in scores] == [1.0, 0.0, 0.0, 1.0]  # crop, free text, refused box, crop
    assert [crops_received(t) for t in rollout.trajectories] == [1, 0, 0, 1]
    assert [s["turns"] for s in scores] == [float(t.turns) for t in rollout.trajectories]
    assert all(s["plain"] == 1.0 for s in scores) and not getattr(task, "reward_errors", {})
    assert [tool_bonus(text, 1.0) for text in rollout.texts] == [1.0, 0.0, 0.0, 1.0]  # text alone: the search
