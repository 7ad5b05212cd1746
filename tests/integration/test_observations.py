"""Observations rendered by each family: after every turn of a trajectory, the image placeholder tokens of the
whole sequence match the features of its images (none dropped or doubled), and the model runs on it."""

from __future__ import annotations

import pytest
import torch
from helpers.runs import tiny_family_policy
from PIL import Image

from gpg_vl.models.batch import trim_left_padding
from gpg_vl.rollout.multiturn.trajectory import Trajectory, sequence_inputs

FAMILIES = ["qwen2_5_vl", "qwen3_vl", "qwen3_5", "glm4v", "gemma3", "gemma4", "smolvlm", "llava_onevision",
            "internvl"]
REFUSED = {"llava_onevision": "cannot take images in a later turn"}  # families that refuse max_turns > 1


@pytest.fixture(scope="module", params=FAMILIES)
def family_policy(request, tmp_path_factory):
    return tiny_family_policy(request.param, tmp_path_factory)


def image_token_id(family_policy) -> int:
    config = family_policy.model.config
    for key in ("image_token_id", "image_token_index"):
        if isinstance(getattr(config, key, None), int):
            return getattr(config, key)
    return family_policy.family._image_token_id()


def count_features(encoded) -> int:
    pooled = getattr(encoded, "pooler_output", encoded)
    pooled = pooled if isinstance(pooled, list | tuple) else [pooled]
    return sum(part.reshape(-1, part.shape[-1]).shape[0] for part in pooled)


def test_every_turns_images_match_their_placeholder_tokens(family_policy):
    family, bare = family_policy.family, family_policy.model
    if family.config.model_type in REFUSED:
        assert REFUSED[family.config.model_type] in family.multi_turn_unsupported()
        return
    assert family.multi_turn_unsupported() is None
    messages = [{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (96, 64), (0, 90, 0))},
                                             {"type": "text", "text": "What is in the image?"}]}]
    prompt = trim_left_padding(family.encode([messages]).inputs)
    features: list[int] = []
    encoder = bare.model.get_image_features

    def recording(*args, **kwargs):
        encoded = encoder(*args, **kwargs)
        features.append(count_features(encoded))
        return encoded

    bare.model.get_image_features = recording
    try:
        trajectory = Trajectory()
        pad = image_token_id(family_policy)
        for turn, size in enumerate([(120, 90), (64, 160)]):
            call = f'<tool_call>{{"name": "zoom_in", "arguments": {{"bbox_2d": [0, 0, {turn + 5}0, 50]}}}}</tool_call>'
            trajectory.add_segment(family.tokenizer(call, add_special_tokens=False)["input_ids"])
            ids, inputs = family.encode_observation("", [Image.new("RGB", size, (200, 0, turn * 90))])
            trajectory.add_observation(ids, [None], inputs)
            full = sequence_inputs(prompt, trajectory)
            features.clear()
            with torch.no_grad():
                bare(**full, **({"position_ids": p} if (p := family.position_ids(bare, full)) is not None else {}))
            placeholders = int((full["input_ids"] == pad).sum())
            assert sum(features) == placeholders, (turn, features, placeholders)
            assert int((torch.tensor(ids) == pad).sum()) > 0  # the observation holds its image
        assert trajectory.loss_mask == [1 if any(s <= i < e for s, e in trajectory.segments) else 0
                                        for i in range(len(trajectory.token_ids))]
    finally:
        bare.model.get_image_features = encoder


def test_every_prompt_lists_the_tools_it_offers_once(family_policy):
    """The chat template's own tool list (tools=) where it has one, else a Hermes system message; a system message
    of the task keeps its text, the tool list after it."""
    from gpg_vl.rollout.multiturn.tools import TOOLS, tool_schema

    family = family_policy.family
    tools = [tool_schema(TOOLS.get("zoom_in"))]
    question = [{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (64, 64))},
                                             {"type": "text", "text": "What is it?"}]}]
    plain, listed = family.render(question), family.render(question, tools)
    assert "zoom_in" not in plain and listed.count('"zoom_in"') + listed.count("<name>zoom_in") == 1, listed
    system = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, *question]
    with_system = family.render(system, tools)
    assert "Be brief." in with_system and "zoom_in" in with_system
    assert family.encode([question], tools=tools).texts == [listed]
