"""Multi-turn rollouts on the HF engine steered by scripted segments (two prompts x G = 2: a crop, free text, a
refused call, a crop), and the scored attempt they make: shared by the multi-turn, packing and tool-reward tests."""

from __future__ import annotations

import torch
from PIL import Image

from gpg_vl.rollout.engine import EnginePrompts, Sampling
from gpg_vl.rollout.multiturn.decoding import generate_trajectories
from gpg_vl.rollout.multiturn.trajectory import MultiTurnSettings
from gpg_vl.train.step.sample import Attempt
from helpers.tool_engine import call_text

MAX_NEW = 100  # per segment: a scripted call is about 85 tokens of the tiny byte-level BPE


def prompts(policy) -> EnginePrompts:
    """Two prompts of different lengths, one image each (different sizes)."""
    messages = [[{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", size, color)},
                                              {"type": "text", "text": text}]}]
                for size, color, text in (((200, 150), (0, 90, 0), "What is it?"),
                                          ((160, 240), (90, 0, 0), "Which shape is red? Look closely."))]
    return EnginePrompts(policy.family.encode(messages), messages)


def call_tokens(policy, box) -> list[int]:
    family = policy.family
    ids = family.tokenizer(call_text(family, box), add_special_tokens=False)["input_ids"]
    assert len(ids) < MAX_NEW
    return ids


def script(policy, batch):
    """Row 0: a good crop then free text; row 1: free text; row 2: a box too small (an error); row 3: a crop."""
    family = policy.family

    def box(prompt, region):
        return "[" + ", ".join(str(round(v)) for v in family.to_model_frame(region, batch.image_sizes[prompt][0])) + "]"

    segments = {(0, 0): call_tokens(policy, box(0, (10, 10, 150, 120))),
                (2, 0): call_tokens(policy, box(1, (0, 0, 20, 20))),
                (3, 0): call_tokens(policy, box(1, (20, 40, 140, 200)))}
    return lambda row, turn: segments.get((row, turn))


def sample(policy, mode: str, **settings):
    batch = prompts(policy)
    settings = MultiTurnSettings(**{"max_turns": 2, "hf_multiturn": mode, **settings})
    sampling = Sampling(max_new_tokens=MAX_NEW, greedy=True)
    return batch, generate_trajectories(policy, batch, group_size=2, sampling=sampling, settings=settings,
                                        tools=("zoom_in",), scripted=script(policy, batch.batch))


def trajectory_attempt(batch, rollout, rewards=((1.0, 0.0), (0.2, 0.9))) -> Attempt:
    """The scripted rollout (2 prompts x G=2: a crop, free text, a refused call, a crop) as a scored attempt."""
    rewards = torch.tensor(rewards)  # [B, G]
    return Attempt(rows=[{}, {}], prompts=batch.batch, rollout=rollout, rewards=rewards, components={},
                   advantages=rewards - rewards.mean(dim=1, keepdim=True), valid=torch.tensor([True, True]))
