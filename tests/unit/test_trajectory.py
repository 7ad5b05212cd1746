"""Trajectories (gpg_vl/rollout/multiturn/trajectory.py): the loss mask over segments and observations, limits,
settings."""

from __future__ import annotations

import pytest
import torch

from gpg_vl.errors import UserError
from gpg_vl.rollout.multiturn.trajectory import MultiTurnSettings, Trajectory, pad_trajectories, sequence_inputs


def two_turns(limit: str = "none") -> Trajectory:
    trajectory = Trajectory()
    trajectory.add_segment([5, 6, 7])
    trajectory.add_observation([8, 9, 9, 10], ["crop"], {"pixel_values": torch.ones(2, 3),
                                                         "mm_token_type_ids": torch.tensor([[0, 1, 1, 0]])})
    trajectory.add_segment([11, 12])
    trajectory.limit = limit
    return trajectory


def test_the_loss_mask_is_one_on_generated_tokens_and_zero_on_observations():
    trajectory = two_turns()
    assert trajectory.loss_mask == [1, 1, 1, 0, 0, 0, 0, 1, 1]
    assert trajectory.segments == [(0, 3), (7, 9)] and trajectory.observations == [(3, 7)]
    assert (trajectory.turns, trajectory.images) == (2, ["crop"])


@pytest.mark.parametrize("on_limit", ["score", "mask"])
def test_a_trajectory_cut_by_a_limit_is_scored_or_masked(on_limit):
    short = Trajectory()
    short.add_segment([3])
    ids, attention, loss = pad_trajectories([two_turns(), two_turns("turn"), short], pad_id=0, on_limit=on_limit)
    assert ids.tolist()[2] == [3] + [0] * 8
    assert attention.sum(dim=1).tolist() == [9, 9, 1]  # observations are attended to
    assert loss[0].tolist() == [1, 1, 1, 0, 0, 0, 0, 1, 1]
    assert loss[1].tolist() == ([0] * 9 if on_limit == "mask" else loss[0].tolist())
    assert loss[2].tolist() == [1] + [0] * 8


def test_sequence_inputs_interleave_token_types_and_append_image_inputs():
    prompt = {"input_ids": torch.tensor([[1, 2, 2]]), "attention_mask": torch.ones(1, 3, dtype=torch.long),
              "mm_token_type_ids": torch.tensor([[0, 1, 1]]), "pixel_values": torch.zeros(4, 3)}
    full = sequence_inputs(prompt, two_turns())
    assert full["input_ids"].tolist() == [[1, 2, 2, 5, 6, 7, 8, 9, 9, 10, 11, 12]]
    assert full["mm_token_type_ids"].tolist() == [[0, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0]]
    assert full["attention_mask"].tolist() == [[1] * 12]
    assert full["pixel_values"].shape == (6, 3) and full["pixel_values"][4:].eq(1).all()


def test_settings_fail_in_one_sentence():
    assert not MultiTurnSettings().multi_turn and MultiTurnSettings(max_turns=3).multi_turn
    for bad, says in (({"max_turns": 0}, "rollout.max_turns=0"), ({"on_limit": "drop"}, "rollout.on_limit"),
                      ({"hf_multiturn": "fast"}, "rollout.hf.multiturn")):
        with pytest.raises(UserError, match=says):
            MultiTurnSettings(**bad)


def test_metrics_count_turns_calls_errors_images_limits_and_tokens():
    from gpg_vl.rollout.multiturn.trajectory import ToolCallRecord, trajectory_metrics

    good, cut, short = two_turns(), two_turns("token"), Trajectory()
    good.calls.append(ToolCallRecord(0, "zoom_in", {"bbox_2d": [0, 0, 9, 9]}, "", images=1))
    cut.calls.append(ToolCallRecord(0, "zoom_in", {}, "Error: needs bbox_2d", error=True))
    short.add_segment([1, 2])
    metrics = trajectory_metrics([good, cut, short])
    assert metrics == {"turns_mean": 5 / 3, "tool_calls_mean": 2 / 3, "tool_errors": 1.0,
                       "images_per_trajectory_mean": 2 / 3, "generated_tokens": 12.0, "observation_tokens": 8.0,
                       "limit_hits_turn": 0.0, "limit_hits_image": 0.0, "limit_hits_token": 1.0}
