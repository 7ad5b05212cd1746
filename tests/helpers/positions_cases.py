"""The position cases of issue 58, built by each family's own processor (tiny models), and what vLLM needs to place
them: each sequence's token ids and its multimodal items (vLLM's `MultiModalFeatureSpec`: modality, placeholder
range, grid, seconds per temporal patch), with gpg-vl's positions (`Family.position_ids`) and transformers' own
(`get_rope_index`) beside them. tests/helpers/vllm_positions.py places the same sequences with vLLM's function in
the vLLM environment and compares.

Cases: text only; one image; several images; a video of 1, 2 and 8 temporal patches at 1, 2, 3 and 4 frames per
second (3 fps: 2/3 s per patch, a fractional step); an image then a video; a video then an image; a multi-turn tool
trajectory with an observation image (rollout/multiturn's `sequence_inputs`); a left-padded batch (each row); a
packed row (models/packing.py's layout, prompt once per group).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from PIL import Image

from gpg_vl.models.positions import IMAGE, VIDEO, model_rope_index, runs
from helpers.video_clips import clip_frames

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "glm4v")


def _image(side: tuple[int, int], shade: int = 90) -> Image.Image:
    return Image.new("RGB", side, (shade, 140, 200))


def _video(frames: int, fps: float, size: tuple[int, int] = (64, 64)) -> dict:
    return {"type": "video", "video": clip_frames(frames, size), "fps": fps}


def _user(*parts) -> list[dict]:
    content = [{"type": "text", "text": part} if isinstance(part, str) else
               ({"type": "image", "image": part} if isinstance(part, Image.Image) else part) for part in parts]
    return [{"role": "user", "content": content}]


def prompts() -> dict[str, list[dict]]:
    """name -> messages of one prompt."""
    cases = {"text only": _user("no picture here, just words"),
             "one image": _user(_image((112, 84)), "what colour?"),
             "several images": _user(_image((56, 56)), "and", _image((112, 56), 30), "which is wider?")}
    for frames in (2, 4, 16):
        for fps in (1.0, 2.0, 3.0, 4.0):
            cases[f"video {frames // 2} patches at {fps:g} fps"] = _user("watch", _video(frames, fps), "what moved?")
    cases["wide video"] = _user(_video(4, 2.0, (112, 56)), "which way?")
    cases["image then video"] = _user(_image((84, 84)), "then", _video(4, 2.0), "same?")
    cases["video then image"] = _user(_video(6, 3.0), "then", _image((56, 112)), "same?")
    return cases


def _features(token_types: list[int], grids: dict[int, list], seconds: list, merge: int,
              frames_apart: bool) -> list[dict]:
    """vLLM's items of one unpadded sequence: per image its run; per video its runs (one for a video whose
    temporal patches stand together, one per patch where text stands between them: `frames_apart`, Qwen3-VL,
    GLM-4.1V), with its placeholder range (offset, length, and which tokens take the features) and grid."""
    features, pending = [], [r for r in runs(token_types) if r[0] != 0]
    images, videos = iter(grids.get(IMAGE, [])), iter(grids.get(VIDEO, []))
    seconds = iter(seconds)
    while pending:
        kind, first, end = pending.pop(0)
        grid = next(images if kind == IMAGE else videos)
        tokens = grid[0] * grid[1] * grid[2] // merge ** 2
        parts = [(first, end)]
        while sum(e - f for f, e in parts) < tokens:  # a video split per temporal patch: take its other runs
            _, first_more, end_more = pending.pop(0)
            parts.append((first_more, end_more))
        offset, stop = parts[0][0], parts[-1][1]
        if kind == VIDEO and frames_apart:
            offset -= 1  # the first frame's opening token: vLLM finds each frame from it (Qwen3-VL)
        embed = [any(f <= at < e for f, e in parts) for at in range(offset, stop)]
        feature = {"modality": "image" if kind == IMAGE else "video", "offset": offset, "length": stop - offset,
                   "is_embed": None if all(embed) else embed, "grid": list(grid)}
        if kind == VIDEO:
            feature["second_per_grid_ts"] = next(seconds, None)
        features.append(feature)
    return features


def sequences(family, model, inputs: dict, name: str) -> list[dict]:
    """Each row of a batch as vLLM would get it (padding dropped), with gpg-vl's and transformers' positions."""
    ours = family.position_ids(model, inputs)  # [3, N, L]
    theirs = model_rope_index(model, inputs) if "mm_token_type_ids" in inputs and (
        "image_grid_thw" in inputs or "video_grid_thw" in inputs) else ours
    merge = model.config.vision_config.spatial_merge_size
    grids = {kind: iter(inputs[key].tolist()) for kind, key in ((IMAGE, "image_grid_thw"), (VIDEO, "video_grid_thw"))
             if key in inputs}
    seconds = iter(inputs["second_per_grid_ts"].tolist()) if "second_per_grid_ts" in inputs else iter(())
    out = []
    for row in range(inputs["input_ids"].shape[0]):
        kept = inputs["attention_mask"][row].bool()
        types = inputs["mm_token_type_ids"][row][kept].tolist()
        kinds = [kind for kind, _, _ in runs(types) if kind]
        row_grids = {IMAGE: [next(grids[IMAGE]) for _ in range(kinds.count(IMAGE))] if IMAGE in grids else [],
                     VIDEO: []}
        videos, covered = [], 0  # a split video's runs count once per temporal patch
        for kind, first, end in runs(types):
            if kind == VIDEO:
                if covered == 0:
                    videos.append(next(grids[VIDEO]))
                    covered = videos[-1][0] * videos[-1][1] * videos[-1][2] // merge ** 2
                covered -= end - first
        row_grids[VIDEO] = videos
        row_seconds = [next(seconds) for _ in videos] if "second_per_grid_ts" in inputs else []
        row_inputs = {key: inputs[key][row][kept][None].tolist() for key in ("input_ids", "mm_token_type_ids")}
        row_inputs["attention_mask"] = [[1] * len(row_inputs["input_ids"][0])]
        for kind, key in ((IMAGE, "image_grid_thw"), (VIDEO, "video_grid_thw")):
            if row_grids[kind]:
                row_inputs[key] = row_grids[kind]
        if row_seconds:
            row_inputs["second_per_grid_ts"] = row_seconds
        out.append({"name": name if inputs["input_ids"].shape[0] == 1 else f"{name}, row {row}", "inputs": row_inputs,
                    "token_ids": inputs["input_ids"][row][kept].tolist(),
                    "features": _features(types, row_grids, row_seconds, merge, model.config.model_type not in
                                          ("qwen2_vl", "qwen2_5_vl")),
                    "positions": {"gpg-vl": ours[:, row][:, kept].tolist(),
                                  "transformers": theirs[:, row][:, kept].tolist()}})
    return out


def trajectory_sequence(policy) -> list[dict]:
    """A tool trajectory: a prompt with an image, a model segment (a tool call), an observation holding an image, a
    second segment (the answer), as the multi-turn rollout assembles it (`sequence_inputs`)."""
    from gpg_vl.rollout.multiturn.trajectory import Trajectory, sequence_inputs

    family = policy.family
    prompt = family.encode([_user(_image((112, 112)), "zoom into the top left cell, then answer")]).inputs
    trajectory = Trajectory()
    call = '<tool_call>\n{"name": "zoom_in", "arguments": {"box": [0, 0, 56, 56]}}\n</tool_call>'
    trajectory.add_segment(family.tokenizer(call, add_special_tokens=False)["input_ids"])
    ids, extra = family.encode_observation("the crop", [family.fit_image(_image((56, 56), 200))])
    trajectory.add_observation(ids, [], extra)
    trajectory.add_segment(family.tokenizer("<answer> red </answer>", add_special_tokens=False)["input_ids"])
    return sequences(family, policy.model, sequence_inputs(prompt, trajectory), "tool trajectory")


def packed_sequences(policy) -> list[dict]:
    """Two prompts (an image, a video) with two completions each, scored as one packed row (prompt once per group):
    each sequence's positions read back from the row are the ones its prompt and completion get there."""
    from gpg_vl.models.batch import extend_per_token, trim_left_padding
    from gpg_vl.models.packing import pack_layout, pack_tokens

    family, model = policy.family, policy.model
    batch = family.encode([_user(_image((56, 84)), "colour?"), _user(_video(4, 2.0), "moving?")])
    prompt_index = [0, 0, 1, 1]
    completions = torch.tensor([family.tokenizer(text, add_special_tokens=False)["input_ids"][:4]
                                for text in ("red one here", "blue two there", "left it goes", "right it was")])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    selected = trim_left_padding(batch.select(prompt_index).inputs)
    full = extend_per_token(selected, completions, mask)
    full.update({key: value for key, value in batch.select(prompt_index).inputs.items() if key not in full})
    positions = family.position_ids(model, full)  # [3, N, L]
    layout = pack_layout(selected["attention_mask"], prompt_index, mask, prompt_once=True)
    row = pack_tokens(positions, layout)[:, 0]  # [3, T]
    ids = pack_tokens(full["input_ids"], layout)[0]  # [T]
    described = sequences(family, model, full, "packed")
    completion_segments = [segment for segment in layout.segments if segment[2] < segment[3]]
    members = [n for _, group in layout.groups for n in group if mask[n].any()]
    out = []
    for n, (first, end, prefix_start, prefix_end) in zip(members, completion_segments, strict=True):
        where = list(range(prefix_start, prefix_end)) + list(range(first, end))  # its prompt, then its completion
        sequence = {key: value for key, value in described[n].items() if key != "inputs"}  # as the padded rows
        out.append({**sequence, "name": f"packed row, sequence {n}", "token_ids": ids[where].tolist(),
                    "positions": {"gpg-vl": row[:, where].tolist()}})
    return out


def docstring_sequence(policy) -> dict:
    """The Qwen2.5-VL docstring's example (transformers PR 35569): a video of three temporal patches of 2 x 2 merged
    tokens 50 positions apart (here 4 tokens per second x 12.5 s per patch), then text: temporal 0, 50, 100, text
    from 101 (by hand, under the label `hand-worked`)."""
    family, model = policy.family, policy.model
    video, text = family.tokenizer.convert_tokens_to_ids("<|video_pad|>"), family.tokenizer("abc")["input_ids"][:3]
    ids = [video] * 12 + text
    inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, 15, dtype=torch.long),
              "mm_token_type_ids": torch.tensor([[VIDEO] * 12 + [0] * 3]), "video_grid_thw": torch.tensor([[3, 4, 4]]),
              "second_per_grid_ts": torch.tensor([50 / model.config.vision_config.tokens_per_second])}
    (sequence,) = sequences(family, model, inputs, "the docstring's video")
    sequence["positions"]["hand-worked"] = [[0] * 4 + [50] * 4 + [100] * 4 + [101, 102, 103],
                                            [0, 0, 1, 1] * 3 + [101, 102, 103], [0, 1, 0, 1] * 3 + [101, 102, 103]]
    return sequence


def build(family_name: str) -> dict:
    """Every case of one family: its tiny model's folder and the sequences."""
    from gpg_vl.models.load import load_policy
    from gpg_vl.models.tiny import tiny_model_path

    policy = load_policy(f"tiny:{family_name}")
    family, model = policy.family, policy.model
    out = []
    for name, messages in prompts().items():
        out += sequences(family, model, family.encode([messages]).inputs, name)
    batch = prompts()
    out += sequences(family, model, family.encode([batch["one image"], batch["video 2 patches at 3 fps"]]).inputs,
                     "left padding")
    out += trajectory_sequence(policy)
    out += packed_sequences(policy)
    if family_name == "qwen2_5_vl":
        out.append(docstring_sequence(policy))
    return {"family": family_name, "path": str(tiny_model_path(family_name)), "sequences": out}


def docs_script() -> tuple[str, str]:
    """docs/models.md's Positions script and the output the page says it prints."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text()
    section = page[page.index("## Positions"):]
    return (re.search(r"```python\n(.*?)```", section, re.S).group(1),
            re.search(r"```text\n(.*?)```", section, re.S).group(1))
