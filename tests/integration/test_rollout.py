"""Grouped rollouts and the update's log-probs on the real Qwen2.5-VL class (tiny weights, CPU)."""

import pytest
import torch
from helpers.scoring import token_logps

from gpg_vl.config.schema import RolloutSettings, TrainerSettings
from gpg_vl.data.stream import PromptStream
from gpg_vl.rollout.engine import Sampling, build_engine
from gpg_vl.rollout.hf import generate
from gpg_vl.rollout.types import completion_mask_from_eos
from gpg_vl.train.step.sample import sample_attempt


def encode(policy, task, rows):
    return policy.family.encode([task.messages(r) for r in rows], ids=[r["id"] for r in rows])


def test_completion_mask_ends_at_first_eos():
    ids = torch.tensor([[5, 6, 9, 7, 9], [5, 5, 5, 5, 5], [9, 1, 1, 1, 1]])
    mask = completion_mask_from_eos(ids, [9])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert completion_mask_from_eos(ids, [9], ignore_eos=True).all()


def test_group_rollout_shapes_and_masks(policy, shapes):
    rows = shapes.load("train")[:3]
    result = generate(policy, encode(policy, shapes, rows), group_size=4, sampling=Sampling(max_new_tokens=12))
    assert result.completion_ids.shape[0] == 12 and len(result.texts) == 12
    eos = torch.tensor(policy.family.eos_ids)
    for ids, mask in zip(result.completion_ids, result.completion_mask, strict=True):
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any()
        assert not torch.isin(ids[: n - 1], eos).any()  # the only EOS is the last kept token


def push_vision_tokens(policy):
    """Make the model strongly prefer <|image_pad|> and friends, so suppression is really tested."""
    suppressed = torch.tensor(policy.family.suppressed_ids)

    def hook(module, inputs, output):
        output = output.clone()
        output[..., suppressed] += 50.0
        return output

    return policy.model.lm_head.register_forward_hook(hook)


def test_vision_tokens_are_never_sampled_and_logps_use_the_same_suppression(policy, shapes):
    rows = shapes.load("train")[:2]
    prompts = encode(policy, shapes, rows)
    handle = push_vision_tokens(policy)
    try:
        result = generate(policy, prompts, group_size=4, sampling=Sampling(max_new_tokens=10))
        kept = result.completion_ids[result.completion_mask]
        assert not torch.isin(kept, torch.tensor(policy.family.suppressed_ids)).any()
        logps = token_logps(policy.family, policy.model, prompts, [i // 4 for i in range(8)],
                                           result.completion_ids, result.completion_mask)
    finally:
        handle.remove()
    # Under suppression the boosted tokens carry no mass, so sampled tokens keep ordinary log-probs.
    assert torch.isfinite(logps[result.completion_mask]).all()
    assert logps[result.completion_mask].mean() > -20


def test_stale_rope_deltas_after_generate_do_not_leak_into_training_forward(policy, shapes):
    rows = shapes.load("train")[:5]
    prompts = encode(policy, shapes, rows)
    index = [0, 1, 2, 3, 4]
    completion = torch.full((5, 4), policy.family.tokenizer.convert_tokens_to_ids("<think>") or 3)
    completion = torch.randint(20, 200, (5, 4), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(completion, dtype=torch.bool)
    with torch.no_grad():
        fresh = token_logps(policy.family, policy.model, prompts, index, completion, mask)
        generate(policy, prompts.select([0, 1, 2]), group_size=1, sampling=Sampling(max_new_tokens=6))  # batch size 3
        # gpg-vl's decoding passes its positions explicitly, so the model keeps no deltas of its own; transformers'
        # `generate` left them for a batch of 3, as planted here: the training forward must not read them
        policy.model.model.rope_deltas = torch.full((3, 1), 7, dtype=torch.long)
        after = token_logps(policy.family, policy.model, prompts, index, completion, mask)  # batch size 5
    torch.testing.assert_close(after, fresh)


def test_shared_vision_matches_per_sequence_vision_in_value_and_gradient(policy, shapes):
    rows = shapes.load("train")[:3]
    prompts = encode(policy, shapes, rows)
    index = [0, 0, 1, 1, 2, 2]
    completion = torch.randint(20, 200, (6, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(completion, dtype=torch.bool)
    mask[1, 3:] = False
    grads, values = [], []
    for share in (True, False):
        policy.model.zero_grad()
        logps = token_logps(policy.family, policy.model, prompts, index, completion, mask, share_vision=share)
        (logps * mask).sum().backward()
        values.append(logps.detach())
        grads.append(torch.cat([p.grad.flatten() for p in policy.model.parameters() if p.grad is not None]))
    torch.testing.assert_close(values[0], values[1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-3, atol=1e-5)


def test_prompt_over_the_limit_is_skipped_with_a_sentence_naming_it(policy, shapes):
    warnings = []
    stream = PromptStream(shapes.load("train"), seed=0)
    rollout = RolloutSettings(max_new_tokens=4, max_prompt_tokens=10)
    attempt = sample_attempt(policy, shapes, stream, engine=build_engine(rollout, policy), rollout=rollout,
                             trainer=TrainerSettings(batch_size=2, group_size=2, reward_workers=1),
                             warn=warnings.append)
    assert attempt.rows == [] and attempt.valid.numel() == 0
    assert len(warnings) == 2 and "shapes-0-" in warnings[0] and "max_prompt_tokens=10" in warnings[0]


def test_prompts_with_several_images_keep_their_images_when_selected_and_shared(policy, shapes):
    rows = shapes.load("train")[:3]
    two_images = [{"role": "user", "content": [
        {"type": "image", "image": rows[0]["image"]}, {"type": "image", "image": rows[1]["image"]},
        {"type": "text", "text": "Which image has more shapes?"}]}]
    prompts = policy.family.encode([two_images, shapes.messages(rows[2])])
    assert prompts.images_per_prompt == [2, 1]
    reordered = prompts.select([1, 0, 0])
    assert reordered.images_per_prompt == [1, 2, 2] and reordered.inputs["image_grid_thw"].shape[0] == 5
    result = generate(policy, prompts, group_size=2, sampling=Sampling(max_new_tokens=6))
    index = [0, 0, 1, 1]
    shared = token_logps(policy.family, policy.model, prompts, index, result.completion_ids, result.completion_mask)
    repeated = token_logps(policy.family, policy.model, prompts, index, result.completion_ids,
                                          result.completion_mask, share_vision=False)
    torch.testing.assert_close(shared, repeated, rtol=1e-4, atol=1e-5)


def test_box_frames_round_trip_and_completions_are_rewritten_into_original_pixels(policy, shapes):
    from gpg_vl.models.qwen import Qwen2VLFamily, QwenVLFamily

    size = (640, 480, 644, 476)  # original W, H; resized w, h
    box = (100.0, 50.0, 300.0, 200.0)
    for family_class, expected in ((QwenVLFamily, (100.625, 49.5833, 301.875, 198.3333)),
                                    (Qwen2VLFamily, (156.25, 104.1667, 468.75, 416.6667))):
        family = family_class.__new__(family_class)  # the frame maths needs no processor
        model_box = family.to_model_frame(box, size)
        assert model_box == pytest.approx(expected, abs=1e-3)
        assert family.to_original_frame(model_box, size) == pytest.approx(box, abs=1e-9)
        text = f"<answer>[{model_box[0]:.4f}, {model_box[1]:.4f}, {model_box[2]:.4f}, {model_box[3]:.4f}]</answer>"
        assert family.completion_to_original(text, [size]) == "<answer>[100, 50, 300, 200]</answer>"
    qwen2 = Qwen2VLFamily.__new__(Qwen2VLFamily)
    assert qwen2.completion_to_original("(500,500),(1000,1000)", [size]) == "(320,240),(640,480)"
    # the sizes recorded at encoding time: original image size, then the size the processor fed the model
    rows = shapes.load("train")[:1]
    prompts = policy.family.encode([shapes.messages(rows[0])])
    assert prompts.image_sizes == [[(112, 112, 112, 112)]]
