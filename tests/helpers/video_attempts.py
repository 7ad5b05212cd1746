"""Video prompts on the tiny models and a scored attempt on them (ragged completions): shared by the video and
packing tests."""

from __future__ import annotations

import torch

from gpg_vl.rollout.types import Rollout
from gpg_vl.train.step.sample import Attempt
from helpers.video_clips import clip_frames


def video_messages(video, question: str, **sampling) -> list[dict]:
    return [{"role": "user", "content": [{"type": "video", "video": video, **sampling},
                                         {"type": "text", "text": question}]}]


def two_video_prompts(policy):
    """Two prompts of different lengths: an 8-frame clip and a 4-frame clip with a longer question."""
    prompts = policy.family.encode([
        video_messages(clip_frames(8), "Where does the dot go?"),
        video_messages(clip_frames(4, (48, 64)), "Where does the dot go? Think, then answer with one word.")])
    assert prompts.videos_per_prompt == [1, 1] and not prompts.has_images
    assert len(set(prompts.inputs["attention_mask"].sum(dim=1).tolist())) == 2
    return prompts


def video_attempt(policy) -> Attempt:
    prompts = two_video_prompts(policy)
    group_size, width = 2, 6
    ids = torch.randint(20, 300, (2 * group_size, width), generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([6, 2, 4, 5])  # ragged completions
    mask = torch.arange(width)[None, :] < lengths[:, None]  # [B * G, C]
    rewards = torch.tensor([[1.0, 0.0], [0.2, 0.9]])
    return Attempt(rows=[{}] * 2, prompts=prompts,
                   rollout=Rollout(ids.masked_fill(~mask, policy.family.pad_id), mask, [""] * 4, group_size),
                   rewards=rewards, components={}, advantages=rewards - rewards.mean(dim=1, keepdim=True),
                   valid=torch.tensor([True, True]))
