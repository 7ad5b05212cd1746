"""The `zoom` task (tasks/zoom.py): its rows, its rewards, that the named symbol is a speck at the experiment's
pixel budget but most of a patch in the crop of its cell, the cold-start demonstrations of scripts/build_tiny.py
--zoom, and that the cold-start model shipped in gpg_vl/assets sometimes zooms on the named cell."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from gpg_vl.cli import train_main
from gpg_vl.config.compose import load_config
from gpg_vl.data.task import get_task
from gpg_vl.errors import UserError
from gpg_vl.models.load import ASSETS, load_policy
from gpg_vl.rollout.engine import Sampling, build_engine, encode_prompts
from gpg_vl.rollout.multiturn.trajectory import pad_trajectories

ROOT = Path(__file__).resolve().parents[2]
PATCH = 14  # the tiny Qwen2.5-VL's vision patch, in the pixels it sees
MAX_PIXELS = 112 * 112  # configs/experiment/zoom-tiny.yaml's model.max_pixels


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def task():
    return get_task("zoom", train_size=50, test_size=30)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load_policy("embedded:tiny-qwen2.5-vl", dtype="float32", min_pixels=3136, max_pixels=MAX_PIXELS)


def test_rows_are_seeded_and_every_cell_holds_a_symbol_the_named_one_of_the_answer_colour(task):
    from gpg_vl_tasks.zoom import COLORS

    rows = task.load("train")
    assert rows[3]["question"] == get_task("zoom", train_size=50).load("train")[3]["question"]
    for row in rows[:20]:
        x1, y1, x2, y2 = row["cell"]
        s = row["symbol"]
        assert x1 < s["x"] - s["r"] and s["x"] + s["r"] < x2 and y1 < s["y"] - s["r"] and s["y"] + s["r"] < y2
        r, c = (int(v) for v in row["question"].split("row ")[1].rstrip("?").split(", column "))
        assert (x1, y1) == ((c - 1) * 256, (r - 1) * 256)
        assert row["image"].getpixel((int(s["x"]), int(s["y"]) + int(s["r"] // 2))) == COLORS[row["answer"]]
        pixels = np.asarray(row["image"], dtype=np.int16)
        coloured = (pixels.max(axis=2) - pixels.min(axis=2) > 100).reshape(4, 256, 4, 256)
        assert coloured.any(axis=(1, 3)).all()  # a symbol in every cell (the grid lines are grey)
    with pytest.raises(UserError, match="no split 'dev'"):
        task.load("dev")
    with pytest.raises(UserError, match="cells under 32 pixels"):
        get_task("zoom", image_size=100, grid=4)


def test_the_symbol_is_a_speck_at_the_pixel_budget_and_most_of_a_patch_in_its_crop(task, tiny):
    """qwen-vl-utils' resize (Family.fit_image) of the whole image and of the named cell's crop."""
    family = tiny.family
    full_sizes, crop_sizes = [], []
    for row in task.load("test"):
        full, crop = family.fit_image(row["image"]), family.fit_image(row["image"].crop(row["cell"]))
        diameter = 2 * row["symbol"]["r"]
        full_sizes.append(diameter * full.width / row["image"].width)
        crop_sizes.append(diameter * crop.width / (row["cell"][2] - row["cell"][0]))
    assert max(full_sizes) < PATCH / 4, full_sizes  # under a quarter of a patch across in the full view
    assert min(crop_sizes) > PATCH / 2, crop_sizes  # more than half a patch across in the crop


def test_the_answers_colours_are_balanced_so_a_constant_answer_scores_a_quarter():
    rows = get_task("zoom", test_size=100).load("test")
    answers = [row["answer"] for row in rows]
    assert {answers.count(color) for color in set(answers)} == {25}


def test_rewards_and_metrics_by_hand(task):
    row = task.load("test")[0]
    right, wrong = row["answer"], next(c for c in ("red", "green", "blue", "yellow") if c != row["answer"])
    call = '<tool_call>{"name": "zoom_in", "arguments": {"bbox_2d": [0, 0, 56, 56]}}</tool_call>'
    zoomed = f"{call}user\n<tool_response>\n\n</tool_response>assistant\n<answer> {right} </answer>"
    assert task.reward_components(zoomed, row) == {"accuracy": 1.0, "format": 1.0}
    assert task.reward_components(f"<answer> {wrong} </answer>", row) == {"accuracy": 0.0, "format": 1.0}
    assert task.reward_components(f"<tool_call>{{<answer> {right} </answer>", row)["format"] == 0.0  # unclosed
    assert task.reward_components(f"<answer> {right} </answer> more", row)["format"] == 0.0
    assert task.reward_components(call, row) == {"accuracy": 0.0, "format": 0.0}  # a call, no answer
    metrics = task.metrics([row] * 4, [zoomed, f"<answer> {wrong} </answer>", call, f"<answer> {right} </answer>"])
    assert metrics["tool_call_rate"] == 0.5
    assert metrics["accuracy/with_tool"] == 0.5 and metrics["accuracy/without_tool"] == 0.5
    assert metrics["accuracy"] == 0.5


def test_a_call_counts_as_on_the_named_cell_when_its_box_covers_it(task):
    """zoom_on_cell_rate reads the first call's box in original pixels (the task has uses_boxes: the engine's
    texts reach metrics with boxes mapped out of the model's frame); intersection over union at least 0.5."""
    row = task.load("test")[0]
    x1, y1, x2, y2 = row["cell"]

    def zoom(box):
        return ('<tool_call>{"name": "zoom_in", "arguments": {"bbox_2d": ' + str(list(box)) + '}}</tool_call>'
                "user\n<tool_response>\n\n</tool_response>assistant\n<answer> red </answer>")

    shifted = (x1 + 40, y1 + 40, x2 + 40, y2 + 40)  # IoU 216^2 / (2 * 256^2 - 216^2) = 0.55
    far = (x1 + 128, y1, x2 + 128, y2)  # IoU 1/3
    texts = [zoom(row["cell"]), zoom(shifted), zoom(far), "<answer> red </answer>", zoom((x1, y1, x2))]
    assert task.metrics([row] * 5, texts)["zoom_on_cell_rate"] == 2 / 5
    assert task.uses_boxes


def test_demonstrations_zoom_on_the_cell_and_train_on_generated_tokens_only(task, tiny):
    build = load_script("build_tiny")
    family, rows = tiny.family, task.load("train")[:2]
    batch = family.encode([task.messages(r) for r in rows])
    zoomed = build.zoom_demonstration(family, rows[0], batch.image_sizes[0][0], True)
    direct = build.zoom_demonstration(family, rows[1], batch.image_sizes[1][0], False)
    assert zoomed.turns == 2 and len(zoomed.images) == 1 and direct.turns == 1 and direct.images == []
    crop = zoomed.images[0]
    assert crop.size == family.fit_image(rows[0]["image"].crop(rows[0]["cell"])).size  # the named cell, resized
    start, end = zoomed.observations[0]
    assert zoomed.loss_mask[start:end] == [0] * (end - start) and sum(zoomed.loss_mask) == len(zoomed.token_ids) - (
        end - start)
    text = family.tokenizer.decode(zoomed.token_ids, skip_special_tokens=True)
    assert task.reward_components(text, rows[0]) == {"accuracy": 1.0, "format": 1.0}
    ids, attention, loss_mask = pad_trajectories([zoomed, direct], family.pad_id)
    from gpg_vl.models.scoring import choose_scoring_path, token_logps

    path = choose_scoring_path(family, tiny.model, share_prompt=False, share_vision=True)
    logps = token_logps(family, tiny.model, batch, [0, 1], ids, attention, observations=[zoomed, direct], path=path)
    assert torch.isfinite(logps[loss_mask > 0]).all()


@pytest.mark.skipif(not (ASSETS / "tiny-qwen2.5-vl-zoom").exists(), reason="the zoom cold-start model is not built")
def test_the_cold_start_model_sometimes_zooms_on_the_named_cell(task):
    """Sampled through the HF engine (rollout.max_turns=2): some trajectories call zoom_in with a call the tool
    accepts, on the named cell's box in the model's 112 px frame, and go on to a second segment after the crop;
    greedy decoding does not call (docs/results/zoom.md: what reinforcement learning starts from)."""
    from gpg_vl.config.schema import RolloutSettings

    torch.manual_seed(0)
    policy = load_policy("embedded:tiny-qwen2.5-vl-zoom", dtype="float32", min_pixels=3136, max_pixels=MAX_PIXELS)
    engine = build_engine(RolloutSettings(max_turns=2, max_new_tokens=100, max_total_tokens=400), policy,
                          tools=task.tools)
    rows = task.load("test")[:8]
    prompts = encode_prompts(policy, [task.messages(r) for r in rows], tools=engine.prompt_tools(task))
    rollout = engine.generate(prompts, 4, Sampling(max_new_tokens=100))
    accepted = [(t, rows[k // 4]) for k, t in enumerate(rollout.trajectories) if t.calls and not t.calls[-1].error]
    on_cell = [t for t, row in accepted
               if t.calls[-1].arguments["bbox_2d"] == [round(v * 112 / 1024) for v in row["cell"]]]
    assert on_cell  # the cold start names the cell's box, some of the time
    for trajectory, _ in accepted:
        assert trajectory.turns == 2 and len(trajectory.images) == 1
        width, height = trajectory.images[0].size  # a crop resized within the pixel budget, whole merged patches
        assert width * height <= MAX_PIXELS and width % 28 == 0 and height % 28 == 0
    greedy = engine.generate(prompts, 1, Sampling(max_new_tokens=100, greedy=True))
    assert not any(t.calls for t in greedy.trajectories)


# the rise after 8 steps, first 40 held-out rows, seeds 0-2: 0.45, 0.475, 0.40 (0.70, 0.725, 0.65); after 7 steps,
# seed 0 (trainer.eval_every=1): 0.45, the same 0.70 as at 8 steps (0.25 up to step 5, 0.60 at step 6)
ZOOM_MARGIN = 0.25


@pytest.mark.slow
def test_zoom_tiny_learns_to_zoom_on_the_named_cell(tmp_path):
    """`+experiment=zoom-tiny` for 7 steps: before training greedy decoding never calls zoom_in and scores a
    constant answer's 1/4 on the balanced held-out rows; after, it zooms on the named cell (measured: on every
    row) and reads most colours (docs/results/zoom.md). The no-tool baseline stays at 1/4 on this budget and far
    beyond (measured there)."""
    summary = train_main(load_config("train", ["+experiment=zoom-tiny", "trainer.max_steps=7", "eval.limit=40",
                                               f"output_dir={tmp_path}"]))
    before, after = summary["eval_before"], summary["eval_after"]
    assert before["tool_call_rate"] == 0.0, before
    assert after["tool_call_rate"] >= 0.5 and after["zoom_on_cell_rate"] >= 0.5, after
    assert after["accuracy"] - before["accuracy"] >= ZOOM_MARGIN, summary
