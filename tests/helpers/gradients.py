"""The update's gradient as the fast-path tests compare it: one update's gradient on an attempt (`one_update_gradient`,
recorded by `RecordingSGD`), the plain path against every fast path (`assert_fast_paths_give_the_plain_gradient`), a
mixed attempt of prompts of different lengths, and a LoRA policy whose adapters carry a gradient."""

from __future__ import annotations

import torch

from gpg_vl.config.schema import TrainerSettings
from gpg_vl.models.batch import PromptBatch
from gpg_vl.rollout.types import Rollout
from gpg_vl.train.step.micro_batch import update_chunks
from gpg_vl.train.step.sample import Attempt
from gpg_vl.train.step.update import update
from helpers.learners import learner_for

# the families whose tiny models the fast-path tests run: the Qwen families, then the generic family's classes
FAMILIES = ["qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe",  # the Qwen families
            "llava_onevision", "gemma3", "gemma4", "smolvlm", "internvl", "glm4v"]  # generic-family classes



class RecordingSGD(torch.optim.SGD):
    """Keeps a copy of the gradient each step() sees (update() zeroes it afterwards)."""

    def step(self, closure=None):
        self.seen = torch.cat([p.grad.flatten().clone() for g in self.param_groups for p in g["params"]
                               if p.grad is not None])
        return super().step(closure)


def one_update_gradient(policy, attempt: Attempt, settings: TrainerSettings) -> torch.Tensor:
    model = policy.model
    model.train()
    optimizer = RecordingSGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    result = update(learner_for(policy, settings, optimizer=optimizer, temperature=0.7), [attempt])
    assert result["skipped"] == 0.0
    return optimizer.seen


def mixed_prompts(policy, shapes) -> PromptBatch:
    """Three prompts of different lengths (so left padding differs), the last one with two images."""
    rows = shapes.load("train")[:3]
    longer = shapes.messages(rows[1])
    longer[0]["content"][-1]["text"] += " Think step by step, then answer with one word."
    two_images = [{"role": "user", "content": [
        {"type": "image", "image": rows[0]["image"]}, {"type": "image", "image": rows[2]["image"]},
        {"type": "text", "text": "Which image has more shapes?"}]}]
    prompts = policy.family.encode([shapes.messages(rows[0]), longer, two_images])
    assert len(set(prompts.inputs["attention_mask"].sum(dim=1).tolist())) == 3
    assert prompts.images_per_prompt == [1, 1, 2]
    return prompts


def mixed_attempt(policy, shapes) -> Attempt:
    """Three groups of G=3 (prompts of different lengths, one with two images), completions of different
    lengths; the last group is invalid."""
    prompts = mixed_prompts(policy, shapes)
    group_size, width = 3, 7
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(20, 300, (3 * group_size, width), generator=generator)  # [B * G, C]
    lengths = torch.tensor([7, 3, 5, 1, 7, 6, 2, 7, 4])
    mask = torch.arange(width)[None, :] < lengths[:, None]  # [B * G, C]
    rewards = torch.tensor([[1.0, 0.0, 0.5], [0.2, 0.9, 0.4], [1.0, 1.0, 1.0]])
    advantages = rewards - rewards.mean(dim=1, keepdim=True)
    return Attempt(rows=[{}] * 3, prompts=prompts,
                   rollout=Rollout(ids.masked_fill(~mask, policy.family.pad_id), mask, [""] * 9, group_size),
                   rewards=rewards, components={}, advantages=advantages, valid=torch.tensor([True, True, False]))


def assert_fast_paths_give_the_plain_gradient(policy, attempt: Attempt) -> None:
    common = {"max_grad_norm": 1e9, "group_size": attempt.rollout.group_size}
    plain = TrainerSettings(**common, share_vision=False, share_prompt=False, logits_chunk_tokens=0,
                            micro_batch_tokens=0, micro_batch_size=100)
    lengths = attempt.prompts.inputs["attention_mask"].sum(dim=1)[attempt.valid]  # the valid groups' prompts
    budget = int(lengths.max()) + 14  # a prompt and two completions
    fast = TrainerSettings(**common, share_vision=True, share_prompt=True, logits_chunk_tokens=3,
                           micro_batch_tokens=budget)  # several micro-batches, some splitting a group
    assert len(list(update_chunks([attempt], 0, budget, share_prompt=True))) > 2
    reference = one_update_gradient(policy, attempt, plain)
    scale = float(reference.abs().max())
    assert scale > 0
    for settings_ in (fast, TrainerSettings(**common, share_prompt=False, logits_chunk_tokens=5)):
        gradient = one_update_gradient(policy, attempt, settings_)
        # float32 summation order: an embedding row summed over many positions (Gemma 4's newline row) can
        # differ by ~1.4e-5 of the largest gradient; in float64 Gemma 3 and 4 agree to 3e-7 of it
        torch.testing.assert_close(gradient, reference, rtol=1e-4, atol=2e-5 * scale)


def lora_policy(policy):
    from gpg_vl.models.load import Policy
    from gpg_vl.models.lora import apply_lora

    lora = apply_lora(policy.model, r=4, alpha=8.0, vision_modules=policy.family.vision_modules(policy.model))
    for name, parameter in lora.named_parameters():
        if "lora_B" in name:  # B starts at zero, which would make the base path's gradient the only one
            torch.nn.init.normal_(parameter, std=0.05, generator=torch.Generator().manual_seed(len(name)))
    return Policy(lora, policy.processor, policy.family, policy.name_or_path)
