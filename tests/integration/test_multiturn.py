"""Multi-turn rollouts on the HF engine (gpg_vl/rollout/multiturn/decoding.py), on tiny models steered by scripted
segments: a trajectory with a crop, incremental == naive re-prefill, and the log-probs recorded while sampling equal
those of the whole interleaved sequence in one forward (float32)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers.gradients import assert_fast_paths_give_the_plain_gradient, one_update_gradient
from helpers.runs import tiny_family_policy
from helpers.scripted_turns import sample, trajectory_attempt

from gpg_vl.config.schema import TrainerSettings
from gpg_vl.models.batch import trim_left_padding
from gpg_vl.models.scoring import ScoringPath, token_logps
from gpg_vl.rollout.multiturn.trajectory import sequence_inputs

FAMILIES = ["qwen2_5_vl", "qwen3_vl", "qwen3_5", "glm4v", "internvl"]  # generic: GLM-4.1V, InternVL


@pytest.fixture(scope="module", params=FAMILIES)
def family_policy(request, tmp_path_factory):
    return tiny_family_policy(request.param, tmp_path_factory)


def test_a_two_turn_trajectory_with_a_crop_and_its_masks(family_policy):
    _, rollout = sample(family_policy, "incremental")
    first, free, refused, crop = rollout.trajectories
    assert first.turns == 2 and len(first.images) == 1 and not first.calls[0].error
    assert first.loss_mask[slice(*first.observations[0])] == [0] * (first.observations[0][1] - first.observations[0][0])
    assert all(first.loss_mask[i] == 1 for s, e in first.segments for i in range(s, e))
    assert free.turns == 1 and free.calls == []
    assert refused.calls[0].error and "short side" in refused.calls[0].text and refused.images == []
    assert crop.turns == 2 and len(crop.images) == 1 and crop.calls[0].images == 1
    ids, attention, loss = rollout.completion_ids, rollout.completion_mask, rollout.loss_mask
    for row, trajectory in enumerate(rollout.trajectories):
        n = len(trajectory.token_ids)
        assert ids[row, :n].tolist() == trajectory.token_ids and attention[row].sum() == n
        assert loss[row, :n].tolist() == trajectory.loss_mask
    # limits: no room for an image, or for a second turn; under on_limit=mask a cut trajectory has no loss
    _, cut = sample(family_policy, "incremental", on_limit="mask", max_images=0)
    assert cut.trajectories[0].limit == "image" and cut.loss_mask[0].sum() == 0
    assert cut.trajectories[1].limit == "none" and cut.loss_mask[1].sum() > 0
    _, cut = sample(family_policy, "incremental", max_turns=1)  # the call is not run: the turn limit ends it, scored
    assert (cut.trajectories[0].limit, cut.trajectories[0].turns, cut.trajectories[0].calls) == ("turn", 1, [])
    assert cut.loss_mask[0].sum() == len(cut.trajectories[0].token_ids)


def test_greedy_incremental_equals_naive_re_prefill(family_policy):
    _, incremental = sample(family_policy, "incremental")
    _, naive = sample(family_policy, "naive")
    assert [t.token_ids for t in incremental.trajectories] == [t.token_ids for t in naive.trajectories]
    for a, b in zip(incremental.trajectories, naive.trajectories, strict=True):
        assert torch.allclose(torch.tensor(a.logps), torch.tensor(b.logps), atol=1e-5)


def test_sampling_logps_equal_the_whole_sequence_in_one_forward(family_policy):
    batch, rollout = sample(family_policy, "incremental")
    family, bare = family_policy.family, family_policy.model
    for row, trajectory in enumerate(rollout.trajectories):
        prompt = trim_left_padding(batch.batch.select([row // 2]).inputs)
        full = sequence_inputs(prompt, trajectory)
        positions = family.position_ids(bare, full)
        with torch.no_grad():
            logits = bare(**full, position_ids=positions).logits.float()  # [1, P + T, V]
        width = prompt["input_ids"].shape[1]
        ids = torch.tensor([trajectory.token_ids])
        logps = family.logps_from_logits(logits[:, width - 1:-1], ids)[0]  # [T]
        generated = torch.tensor(trajectory.loss_mask, dtype=torch.bool)
        assert torch.allclose(logps[generated], torch.tensor(trajectory.logps)[generated], atol=1e-5), row


def test_the_update_scores_trajectories_exactly_prompt_once_and_plain(family_policy):
    """The update's log-probs of 2-turn trajectories: prompt-once (the prompt once per group, completions with
    their observations on its forked cache) equals the plain whole-sequence path, in value and gradient, and
    both equal what the sampler recorded."""

    batch, rollout = sample(family_policy, "incremental")
    family, model = family_policy.family, family_policy.model
    index = [row // 2 for row in range(len(rollout.trajectories))]
    loss_mask = rollout.loss_mask.bool()
    recorded = torch.zeros_like(rollout.loss_mask)
    for row, trajectory in enumerate(rollout.trajectories):
        recorded[row, :len(trajectory.logps)] = torch.tensor(trajectory.logps)
    results = {}
    for name, path in (("plain", ScoringPath()), ("prompt_once", ScoringPath(prompt_once=True)),
                       ("chunked", ScoringPath(prompt_once=True))):
        model.zero_grad()
        logps = token_logps(family, model, batch.batch, index, rollout.completion_ids, rollout.completion_mask,
                            observations=rollout.trajectories, path=path,
                            logits_chunk_tokens=7 if name == "chunked" else 0)
        (logps * loss_mask).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results[name] = (logps.detach(), grads)
        assert torch.allclose(logps.detach()[loss_mask], recorded[loss_mask], atol=1e-5), name
    for name in ("prompt_once", "chunked"):
        assert torch.allclose(results[name][0][loss_mask], results["plain"][0][loss_mask], atol=1e-5)
        assert torch.allclose(results[name][1], results["plain"][1], atol=1e-4, rtol=1e-4), name
    model.zero_grad()


def test_one_update_gradient_with_every_fast_path_equals_the_plain_update_on_trajectories(family_policy):
    """Prompt-once, chunked log-softmax and token-budget micro-batches that split each group, on 2-turn
    trajectories with crops and ragged lengths: the update's gradient equals the plain path's."""
    batch, rollout = sample(family_policy, "incremental")
    lengths = rollout.completion_mask.sum(dim=1).tolist()
    assert len(set(lengths)) > 1 and sum(len(t.images) for t in rollout.trajectories) == 2
    assert_fast_paths_give_the_plain_gradient(family_policy, trajectory_attempt(batch, rollout))


@pytest.fixture(scope="module")
def qwen2_5_vl(tmp_path_factory):
    return tiny_family_policy("qwen2_5_vl", tmp_path_factory)


def test_the_loss_counts_generated_tokens_only_and_on_limit_mask_keeps_the_trajectory_in_the_mean(qwen2_5_vl):
    """The update's gradient on trajectories equals the gradient of the loss written out by hand over generated
    tokens (seq_mean_token_mean: each trajectory's mean over its generated tokens, summed over trajectories and
    divided by their number). With on_limit=mask, a trajectory cut by a limit carries no gradient but still
    counts in the normalizer: the gradient equals the one with its advantage set to zero."""
    from gpg_vl.rollout.multiturn.trajectory import pad_trajectories

    family_policy = qwen2_5_vl  # the loss's arithmetic: one family shows it
    batch, rollout = sample(family_policy, "incremental")
    attempt = trajectory_attempt(batch, rollout)
    settings = TrainerSettings(max_grad_norm=1e9, group_size=2, share_prompt=False, share_vision=False)
    gradient = one_update_gradient(family_policy, attempt, settings)
    family, model = family_policy.family, family_policy.model
    model.zero_grad()
    logps = token_logps(family, model, batch.batch, [0, 0, 1, 1], rollout.completion_ids, rollout.completion_mask,
                        observations=rollout.trajectories, path=ScoringPath(), temperature=0.7)  # [4, C]
    generated = rollout.loss_mask  # [4, C] 1 on generated tokens only
    per_sequence = (logps * generated).sum(dim=1) / generated.sum(dim=1)  # [4]
    (-(per_sequence * attempt.advantages.flatten()).sum() / 4).backward()
    by_hand = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad and p.grad is not None])
    model.zero_grad()
    scale = float(by_hand.abs().max())
    torch.testing.assert_close(gradient[gradient != 0], by_hand[by_hand != 0], rtol=1e-4, atol=2e-5 * scale)
    # on_limit=mask: the refused-call trajectory (row 2) is marked as cut by a limit
    rollout.trajectories[2].limit = "token"
    _, _, masked = pad_trajectories(rollout.trajectories, family.pad_id, on_limit="mask")
    assert masked[2].sum() == 0 and masked[0].sum() == rollout.loss_mask[0].sum()
    with_mask = one_update_gradient(family_policy, trajectory_attempt(batch, replace(rollout, loss_mask=masked)),
                                    settings)
    zeroed = trajectory_attempt(batch, rollout)
    zeroed.advantages[1, 0] = 0.0
    without_it = one_update_gradient(family_policy, zeroed, settings)
    torch.testing.assert_close(with_mask, without_it, rtol=1e-5, atol=1e-6 * scale)
    assert not torch.allclose(with_mask, gradient, rtol=1e-3, atol=1e-3 * scale)
