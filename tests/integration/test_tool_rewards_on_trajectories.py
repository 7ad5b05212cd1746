"""The tool-use rewards read crops off the decoded trajectory text (gpg_vl/reward/tooluse.py). Here the text comes
from real multi-turn rollouts of each family that can take tools (scripted segments: a crop, free text, a refused
box, a crop), so the rule is checked against what the engine writes, not against a hand-made string."""

from __future__ import annotations

import pytest
from helpers.runs import tiny_family_policy

from gpg_vl.reward.tooluse import crops_used, final_segment, tool_bonus, tool_format_reward

FAMILIES = ["qwen2_5_vl", "qwen3_vl", "qwen3_5", "glm4v", "internvl"]


@pytest.fixture(scope="module", params=FAMILIES)
def policy(request, tmp_path_factory):
    return tiny_family_policy(request.param, tmp_path_factory)


def test_crops_counted_from_the_decoded_text_match_the_trajectories(policy):
    from test_multiturn import sample  # the scripted rollouts of the multi-turn tests

    _, rollout = sample(policy, "incremental")
    for text, trajectory in zip(rollout.texts, rollout.trajectories, strict=True):
        received = sum(not call.error and call.images > 0 for call in trajectory.calls)
        assert crops_used(text) == received, text
        assert tool_bonus(text, 1.0) == float(received > 0) and tool_bonus(text, 0.0) == 0.0
        assert "<tool_response>" not in final_segment(text)
    assert [crops_used(text) for text in rollout.texts] == [1, 0, 0, 1]  # crop, free text, refused box, crop
    # the engine closes each call it runs: the scripted call adds no unbalanced tag to the text before the crop
    assert tool_format_reward(rollout.texts[0][:rollout.texts[0].index("<tool_response>")]) == 0.0
