"""Threshold resampling and the prompt stream, without a model."""

import pytest

from gpg_vl.config.compose import load_config
from gpg_vl.config.schema import TrainerSettings
from gpg_vl.data.stream import PromptStream
from gpg_vl.errors import UserError
from gpg_vl.train.step.sample import budget_spent, collect_valid_groups, tokens_left


def scripted(valid_counts, batch_size=10, tokens=0):
    """Attempts whose global valid-group counts follow a script (each sampling `tokens` tokens); records how many
    were drawn."""
    drawn = []

    def sample():
        drawn.append(valid_counts[len(drawn)])
        return drawn[-1]

    return sample, (lambda attempt: (batch_size, attempt, tokens)), drawn


def test_enough_valid_groups_first_time_updates_at_once():
    sample, count, drawn = scripted([4, 9, 9])
    collected = collect_valid_groups(sample, count, beta_th=0.4, batch_size=10, max_attempts=8)
    assert drawn == [4]
    assert (collected.groups_sampled, collected.groups_valid) == (10, 4)
    assert collected.valid_fractions == [0.4]


def test_resampling_accumulates_until_threshold():
    sample, count, drawn = scripted([1, 0, 2, 3, 9])
    collected = collect_valid_groups(sample, count, beta_th=0.6, batch_size=10, max_attempts=8)
    assert drawn == [1, 0, 2, 3]  # 1 + 0 + 2 + 3 = 6 >= 0.6 * 10
    assert collected.groups_valid == 6 and collected.groups_sampled == 40
    assert collected.valid_fractions == [0.1, 0.0, 0.2, 0.3]
    assert collected.attempts == [1, 0, 2, 3]  # every valid group kept, none dropped


def test_max_attempts_bounds_the_loop_and_zero_valid_is_reported():
    sample, count, drawn = scripted([0] * 10)
    collected = collect_valid_groups(sample, count, beta_th=0.4, batch_size=10, max_attempts=3)
    assert len(drawn) == 3 and collected.groups_valid == 0


def test_beta_zero_never_resamples():
    sample, count, drawn = scripted([0, 5])
    collected = collect_valid_groups(sample, count, beta_th=0.0, batch_size=10, max_attempts=8)
    assert drawn == [0] and collected.groups_valid == 0


def test_no_resampling_starts_once_the_token_budget_is_spent():
    sample, count, drawn = scripted([0] * 10, tokens=30)
    collected = collect_valid_groups(sample, count, beta_th=0.4, batch_size=10, max_attempts=8, tokens_left=70)
    assert len(drawn) == 3 and collected.tokens_sampled == 90  # 30 and 60 are under 70: a third attempt starts
    sample, count, drawn = scripted([0] * 10, tokens=30)
    collected = collect_valid_groups(sample, count, beta_th=0.4, batch_size=10, max_attempts=8, tokens_left=60)
    assert len(drawn) == 2 and collected.tokens_sampled == 60  # reached exactly: no third
    sample, count, drawn = scripted([0] * 10, tokens=30)
    collected = collect_valid_groups(sample, count, beta_th=0.4, batch_size=10, max_attempts=8, tokens_left=-5)
    assert len(drawn) == 1  # the first attempt always runs (the trainer stops before a step past its budget)
    sample, count, drawn = scripted([0] * 10, tokens=30)
    assert collect_valid_groups(sample, count, beta_th=0.4, batch_size=10, max_attempts=4).tokens_sampled == 120


def test_either_budget_stops_the_run_the_first_reached():
    both = TrainerSettings(max_completions=64, max_sampled_tokens=1000)
    assert not budget_spent(both, {"completions_sampled": 63, "tokens_sampled": 999})
    assert budget_spent(both, {"completions_sampled": 64, "tokens_sampled": 10}) == \
        "its budget of sampled completions is spent (64 sampled, trainer.max_completions=64)"
    assert budget_spent(both, {"completions_sampled": 8, "tokens_sampled": 1000}) == \
        "its budget of sampled tokens is spent (1000 sampled, trainer.max_sampled_tokens=1000)"
    assert not budget_spent(TrainerSettings(), {"completions_sampled": 10**9, "tokens_sampled": 10**9})
    assert budget_spent(TrainerSettings(max_sampled_tokens=5), {"completions_sampled": 0, "tokens_sampled": 7})
    assert (tokens_left(both, 400), tokens_left(TrainerSettings(), 400)) == (600, None)
    with pytest.raises(UserError, match=r"trainer.max_sampled_tokens=0, allowed: an integer >= 1 or null"):
        load_config("train", ["trainer.max_sampled_tokens=0"])


def test_max_attempts_must_be_positive():
    sample, count, _ = scripted([1])
    with pytest.raises(ValueError):
        collect_valid_groups(sample, count, beta_th=0.4, batch_size=10, max_attempts=0)


def test_stream_covers_an_epoch_without_repeats_and_shards_across_processes():
    rows = list(range(23))
    single = PromptStream(rows, seed=3)
    epoch = single.next_indices(23)
    assert sorted(epoch) == rows
    shards = [PromptStream(rows, seed=3, rank=r, world_size=2) for r in range(2)]
    union = [i for s in shards for i, _ in s.next_local(10)]
    assert sorted(union) == sorted(epoch[:10])
    assert not set(i for i, _ in shards[0].next_local(4)) & set(i for i, _ in shards[1].next_local(4))


def test_stream_state_resumes_exactly_and_crosses_epochs():
    rows = list(range(7))
    stream = PromptStream(rows, seed=1)
    stream.next_indices(5)
    state = stream.state_dict()
    expected = stream.next_indices(12)
    resumed = PromptStream(rows, seed=1)
    resumed.load_state_dict(state)
    assert resumed.next_indices(12) == expected
    assert stream.epoch == 2


def test_dapo_overlong_shaping_counts_a_trajectorys_generated_tokens_only_against_its_own_limit():
    import torch

    from gpg_vl.config.schema import RolloutSettings
    from gpg_vl.rollout.multiturn.trajectory import Trajectory
    from gpg_vl.rollout.types import Rollout
    from gpg_vl.train.step.sample import overlong_lengths

    rollout = RolloutSettings(max_new_tokens=6, max_total_tokens=40)
    long_tool = Trajectory()
    long_tool.add_segment([1] * 5)
    long_tool.add_observation([9] * 30, [])  # a crop's 30 tokens: the tool's, not the model's
    long_tool.add_segment([2] * 4)
    short = Trajectory()
    short.add_segment([3] * 2)
    multi = Rollout(torch.ones(2, 39, dtype=torch.bool), torch.ones(2, 39, dtype=torch.bool), ["", ""], 2,
                    trajectories=[long_tool, short])
    lengths, limit = overlong_lengths(multi, rollout)
    assert lengths.tolist() == [9, 2] and limit == 40
    mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3]).bool()
    single = Rollout(torch.zeros(2, 6, dtype=torch.long), mask, ["", ""], 2)
    lengths, limit = overlong_lengths(single, rollout)
    assert lengths.tolist() == [6, 3] and limit == 6
