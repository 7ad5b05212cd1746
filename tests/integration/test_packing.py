"""Packed (padding-free) scoring equals the padded update, per family that packs (gpg_vl/models/packing.py).

- the log-probs of a micro-batch, packed (each prompt once per group, or each sequence whole) and padded;
- one update's gradient, packed and padded, with token-budget micro-batches that split groups: single-turn
  prompts of different lengths (one with two images), 2-turn trajectories with crops (the loss on generated
  tokens only), video prompts, and LoRA adapters;
- a family that cannot pack keeps the padded path under `auto` and refuses `on` in one sentence naming why;
- with packing on, token-budget micro-batches count real tokens.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers.gradients import FAMILIES, lora_policy, mixed_attempt, one_update_gradient
from helpers.runs import tiny_family_policy
from helpers.scripted_turns import sample, trajectory_attempt
from helpers.video_attempts import video_attempt

from gpg_vl.config.schema import TrainerSettings
from gpg_vl.errors import UserError
from gpg_vl.models.scoring import AUTO_MIN_PADDING, ScoringPath, choose_scoring_path, token_logps
from gpg_vl.train.step.micro_batch import micro_batch_cost, update_chunks

# what the docs (docs/packing.md) say about each tiny family: packs, or the padded path and why
CANNOT_PACK = {"qwen3_5": "linear_attention", "qwen3_5_moe": "linear_attention", "gemma3": "sliding_attention",
               "gemma4": "sliding_attention"}


@pytest.fixture(scope="module", params=FAMILIES)
def family_policy(request, tmp_path_factory):
    """(the family's name, its float32 tiny model)."""
    return request.param, tiny_family_policy(request.param, tmp_path_factory)


def assert_packed_update_equals_padded(policy, attempt, *, splits: bool = True) -> None:
    """One update's gradient, packed against padded (same scoring path otherwise), each prompt once per group
    and each sequence whole, in token-budget micro-batches that split groups (`splits`)."""
    lengths = attempt.prompts.inputs["attention_mask"].sum(dim=1)[attempt.valid]
    budget = int(lengths.max()) + int(attempt.rollout.completion_mask.sum(dim=1).max())  # a prompt and a completion
    for share_prompt in (True, False):
        padded = TrainerSettings(max_grad_norm=1e9, group_size=attempt.rollout.group_size, share_prompt=share_prompt,
                                 logits_chunk_tokens=3, micro_batch_tokens=budget, packing="off")
        if splits:
            chunks = list(update_chunks([attempt], 0, budget, share_prompt=share_prompt, packed=True))
            split = [chunk.prompt_index for chunk in chunks]
            assert any(set(a) & set(b) for a, b in zip(split, split[1:], strict=False)), split  # a group split
        reference = one_update_gradient(policy, attempt, padded)
        packed = one_update_gradient(policy, attempt, replace(padded, packing="on"))
        torch.testing.assert_close(packed, reference, rtol=1e-4, atol=2e-5 * float(reference.abs().max()))


def test_packed_log_probs_and_update_gradient_equal_the_padded_ones(family_policy, shapes):
    name, policy = family_policy
    family, model = policy.family, policy.model
    if name in CANNOT_PACK:
        assert CANNOT_PACK[name] in family.packing_unsupported(model)
        assert not choose_scoring_path(family, model, share_prompt=True, share_vision=True, packing="auto").packed
        with pytest.raises(UserError, match="trainer.packing=on cannot pack this model"):
            choose_scoring_path(family, model, share_prompt=True, share_vision=True, packing="on")
        return
    attempt = mixed_attempt(policy, shapes)
    for share_prompt in (True, False):
        padded = choose_scoring_path(family, model, share_prompt=share_prompt, share_vision=True)
        packed = choose_scoring_path(family, model, share_prompt=share_prompt, share_vision=True, packing="auto")
        assert packed.packed and not padded.packed
        for chunk in update_chunks([attempt], 4):  # 4 sequences a micro-batch: a group split, prompts shared
            args = (model, chunk.prompts, chunk.prompt_index, chunk.completion_ids, chunk.completion_mask)
            expected = token_logps(family, *args, path=padded, logits_chunk_tokens=3)
            got = token_logps(family, *args, path=packed, logits_chunk_tokens=3)
            torch.testing.assert_close(got[chunk.completion_mask], expected[chunk.completion_mask], rtol=1e-4,
                                       atol=1e-5)
    assert_packed_update_equals_padded(policy, attempt)


def test_packed_lora_update_equals_the_padded_one(policy, shapes):
    wrapped = lora_policy(policy)
    assert_packed_update_equals_padded(wrapped, mixed_attempt(wrapped, shapes))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "glm4v", "internvl"])
def test_packed_update_equals_the_padded_one_on_trajectories_with_crops(family, tmp_path_factory):
    """2-turn trajectories (a crop, free text, a refused call, a crop; ragged lengths): the observations' tokens
    and images go in the packed row where the forward meets them, the loss counts generated tokens only."""
    policy = tiny_family_policy(family, tmp_path_factory)
    batch, rollout = sample(policy, "incremental")
    assert sum(len(t.images) for t in rollout.trajectories) == 2
    assert bool((rollout.loss_mask.bool() != rollout.completion_mask.bool()).any())  # observations not counted
    assert_packed_update_equals_padded(policy, trajectory_attempt(batch, rollout), splits=False)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "glm4v", "internvl"])
def test_packed_update_equals_the_padded_one_on_video(family, tmp_path_factory):
    policy = tiny_family_policy(family, tmp_path_factory)
    policy.family.video_pixels = {"min_pixels": 32 * 32, "max_pixels": 64 * 64}
    assert_packed_update_equals_padded(policy, video_attempt(policy))


def test_token_budget_counts_real_tokens_when_packing():
    # prompts of 10 and 4 tokens; completions 3, 5, 2: packed, each distinct prompt once plus the real tokens
    assert micro_batch_cost([10, 10, 4], [0, 0, 1], [3, 5, 2], share_prompt=True, packed=True) == 10 + 4 + 10
    assert micro_batch_cost([10, 10, 4], [0, 0, 1], [3, 5, 2], share_prompt=False, packed=True) == 24 + 10
    assert micro_batch_cost([10, 10, 4], [0, 0, 1], [3, 5, 2], share_prompt=True) == 2 * 10 + 3 * 5


def test_auto_packs_the_micro_batches_that_have_padding_to_remove():
    from gpg_vl.train.step.micro_batch import forward_cost

    auto = ScoringPath(prompt_once=True, packed=True, min_padding=AUTO_MIN_PADDING)
    on = ScoringPath(prompt_once=True, packed=True)
    # one prompt of 10 tokens, two completions: equal lengths (5, 5) have no padding to remove: auto runs padded
    assert forward_cost(auto, [10, 10], [0, 0], [5, 5]) == (20, False)
    assert forward_cost(on, [10, 10], [0, 0], [5, 5]) == (20, True)
    # (8, 2): padded 10 + 2 * 8 = 26 tokens against 20 real ones, 30% more: packed
    assert forward_cost(auto, [10, 10], [0, 0], [8, 2]) == (20, True)
    # (8, 7): 26 against 25: packed only when on
    assert forward_cost(auto, [10, 10], [0, 0], [8, 7]) == (26, False)
    assert forward_cost(ScoringPath(prompt_once=True), [10, 10], [0, 0], [8, 2]) == (26, False)
