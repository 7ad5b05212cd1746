"""Multi-turn rollouts as users see them: the rollout log and rollouts.html show each trajectory turn by turn (each
segment's text, the tool call, the observation, the crop it returned and that crop's box on the original image,
the limit that ended it, reward and advantage), predictions.html likewise; disk use stays bounded; a headless
chromium opens both pages without a console error and shows the crops. Trajectories come from the HF engine's
multi-turn decoding on the tiny Qwen2.5-VL, steered by scripted segments (as tests/integration/test_multiturn.py)."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers.browser import CHROMIUM, image_tiles, open_in_chromium, root_tag
from PIL import Image

from gpg_vl.models.load import load_policy
from gpg_vl.models.tiny import EMBEDDED_TINY
from gpg_vl.observe.rollout_log import MAX_CROPS, MAX_THUMB_BYTES, log_rollouts, read_steps, step_bytes_bound
from gpg_vl.observe.viewer import write_predictions_html, write_rollouts_html
from gpg_vl.rollout.engine import EnginePrompts, Sampling
from gpg_vl.rollout.multiturn.decoding import generate_trajectories
from gpg_vl.rollout.multiturn.trajectory import MultiTurnSettings
from gpg_vl.train.eval.evaluate import Decoded, prediction_records
from gpg_vl.train.step.sample import Attempt

CROPS = {0: (10, 20, 150, 120), 3: (60, 100, 150, 230)}  # trajectory -> the region (original pixels) it zooms into
SIZES = ((200, 150), (160, 240))


class LookTask:
    """Two rows, one picture each (a red square on a different background)."""

    name, uses_boxes, group_columns = "look", False, ()
    reward_functions = {"accuracy": None}
    reward_weights = {}

    def messages(self, row):
        image = Image.new("RGB", SIZES[row["id"]], (30, 90 + 60 * row["id"], 30))
        image.paste((220, 30, 30), (40, 40, 90, 90))
        return [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": f"Where is the red square? <row {row['id']}>"}]}]

    def target(self, row):
        return "top left"


@pytest.fixture(scope="module")
def sampled():
    torch.manual_seed(0)
    policy = load_policy(str(EMBEDDED_TINY), family="auto", dtype="float32", min_pixels=3136, max_pixels=50176)
    family, task = policy.family, LookTask()
    rows = [{"id": 0}, {"id": 1}]
    messages = [task.messages(row) for row in rows]
    prompts = EnginePrompts(family.encode(messages), messages)

    def call(row):
        region = family.to_model_frame(CROPS[row], prompts.batch.image_sizes[row // 2][0])
        box = "[" + ", ".join(str(round(v)) for v in region) + "]"
        text = f'<b>look</b> <tool_call>\n{{"name": "zoom_in", "arguments": {{"bbox_2d": {box}}}}}\n</tool_call>'
        return family.tokenizer(text, add_special_tokens=False)["input_ids"]

    segments = {(0, 0): call(0), (3, 0): call(3), (2, 0): family.tokenizer('<tool_call>{"name": "nope"}</tool_call>',
                                                                           add_special_tokens=False)["input_ids"]}
    rollout = generate_trajectories(policy, prompts, group_size=2, sampling=Sampling(max_new_tokens=110, greedy=True),
                                    settings=MultiTurnSettings(max_turns=2), tools=("zoom_in",),
                                    scripted=lambda row, turn: segments.get((row, turn)))
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    attempt = Attempt(rows=rows, prompts=prompts.batch, rollout=rollout, rewards=rewards,
                      components={"accuracy": rewards}, advantages=rewards - rewards.mean(1, keepdim=True),
                      valid=torch.tensor([True, True]))
    return SimpleNamespace(policy=policy, task=task, rows=rows, rollout=rollout, attempt=attempt)


def test_the_rollout_log_holds_each_trajectory_turn_by_turn(sampled, tmp_path):
    trajectories = sampled.rollout.trajectories
    assert [t.turns for t in trajectories] == [2, 1, 2, 2] and trajectories[2].calls[0].error
    log_rollouts(1, [sampled.attempt], policy=sampled.policy, task=sampled.task, output_dir=tmp_path, every=1,
                 groups=2)
    (record,) = read_steps(tmp_path)
    completions = [c for group in record["groups"] for c in group["completions"]]
    crop, free, error, crop_again = completions
    assert [len(c["turns"]) for c in completions] == [2, 1, 2, 2] and not record["turns_left_out"]
    first = crop["turns"][0]
    assert first["text"].startswith("<b>look</b> <tool_call>") and first["call"]["name"] == "zoom_in"
    assert json.loads(first["call"]["arguments"])["bbox_2d"] == trajectories[0].calls[0].arguments["bbox_2d"]
    (shown,) = first["call"]["crops"]
    assert shown["source"] == 0 and shown["box"] == pytest.approx(CROPS[0], abs=2)  # back in original pixels
    assert (tmp_path / "rollouts" / "images" / shown["image"]).is_file()
    assert crop["turns"][1]["call"] is None and crop["limit"] == "none" and crop["advantage"] == 0.5
    assert crop["generated"] == sum(len(range(*segment)) for segment in trajectories[0].segments) < crop["tokens"]
    assert free["turns"][0]["call"] is None and free["tool_errors"] == 0
    assert error["tool_errors"] == 1 and error["turns"][0]["call"]["error"]
    assert error["turns"][0]["call"]["text"].startswith("Error:") and error["turns"][0]["call"]["crops"] == []
    assert crop_again["turns"][0]["call"]["crops"][0]["box"] == pytest.approx(CROPS[3], abs=2)


def test_rollouts_html_shows_turns_crops_and_their_boxes_escaped(sampled, tmp_path):
    log_rollouts(1, [sampled.attempt], policy=sampled.policy, task=sampled.task, output_dir=tmp_path, every=1,
                 groups=2)
    page = write_rollouts_html(tmp_path).read_text()
    assert page.count("<div class='turn' ") == 7 and page.count("<img alt='crop'") == 2
    assert "&lt;b&gt;look&lt;/b&gt;" in page and "<b>look</b>" not in page  # model text is escaped
    x1, y1, x2, y2 = (round(v) for v in read_steps(tmp_path)[0]["groups"][0]["completions"][0]["turns"][0]["call"][
        "crops"][0]["box"])
    assert re.search(rf"<rect class='crop' id='s1g0c0t0' x='{x1}' y='{y1}' width='{x2 - x1}' height='{y2 - y1}'/>",
                     page)
    assert "viewBox='0 0 200 150'" in page and "id='s1g1c1t0'" in page  # each group's image in its own pixels
    assert page.count("<pre class='observation error'>") == 1 and "no tool &#x27;nope&#x27;" in page


def test_a_logged_step_stays_within_its_bound_with_many_crops(sampled, tmp_path):
    attempt = sampled.attempt
    trajectory = attempt.rollout.trajectories[0]
    crops = [Image.new("RGB", (300, 300), (k, 255 - k, 7 * k % 255)) for k in range(20)]
    trajectory = replace(trajectory, images=crops, crop_boxes=[(0, (0, 0, 9, 9))] * 20,
                         calls=[replace(trajectory.calls[0], images=20)])
    many = replace(attempt.rollout, trajectories=[trajectory] * 4)  # 20 crops a trajectory
    log_rollouts(1, [replace(attempt, rollout=many)], policy=sampled.policy, task=sampled.task, output_dir=tmp_path,
                 every=1, groups=2)
    images = list((tmp_path / "rollouts" / "images").iterdir())
    assert len(images) == 2 + MAX_CROPS  # the prompts' thumbnails, then MAX_CROPS crops of the group, once each
    assert all(image.stat().st_size <= MAX_THUMB_BYTES for image in images)
    total = sum(p.stat().st_size for p in (tmp_path / "rollouts").rglob("*") if p.is_file())
    assert total <= step_bytes_bound(2)
    kept = [crop["image"] for c in read_steps(tmp_path)[0]["groups"][0]["completions"]
            for turn in c["turns"] if turn["call"] for crop in turn["call"]["crops"]]
    assert len(kept) == 40 and sum(name is not None for name in kept) == MAX_CROPS  # group 0: 2 x 20 crops


def predictions_page(sampled, path):
    decoded = [Decoded(index=i, completion=text, prompt="look", row=sampled.rows[i // 2] | {"id": i},
                       rewards={"accuracy": float(i % 2)}, trajectory=trajectory)
               for i, (text, trajectory) in enumerate(zip(sampled.rollout.texts, sampled.rollout.trajectories,
                                                          strict=True))]
    records = prediction_records(sampled.task, decoded, "test", tokenizer=sampled.policy.family.tokenizer)
    json.dumps(records)  # JSON lines as written
    rows = [sampled.rows[i // 2] for i in range(4)]
    return records, write_predictions_html(path, sampled.task, records, rows, {"accuracy": 0.5})


def test_predictions_hold_and_show_the_turns(sampled, tmp_path):
    records, page = predictions_page(sampled, tmp_path / "predictions.html")
    assert [len(r["turns"]) for r in records] == [2, 1, 2, 2] and records[2]["tool_errors"] == 1
    assert records[0]["turns"][0]["call"]["crops"][0]["image"] is None  # crops are cut again from the row's image
    html = page.read_text()
    assert html.count("<img alt='crop'") == 2 and html.count("<rect class='crop'") == 2
    assert "box [" in html and "of image 0" in html
    assert prediction_records(sampled.task, [], "test") == []


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_chromium_shows_the_turns_and_crops_without_errors(sampled, tmp_path):
    log_rollouts(1, [sampled.attempt], policy=sampled.policy, task=sampled.task, output_dir=tmp_path, every=1,
                 groups=2)
    pages = {"rollouts": write_rollouts_html(tmp_path),
             "predictions": predictions_page(sampled, tmp_path / "p.html")[1]}
    for name, page in pages.items():
        screenshot = tmp_path / f"{name}.png"
        dom, console = open_in_chromium(page, screenshot)
        assert console == [], (name, console)
        assert "data-js-error=" not in root_tag(dom) and 'data-ready="1"' in root_tag(dom), name
        assert len(re.findall(r'<img alt="crop" class="crop" src="data:image/jpeg', dom)) == 2, name
        assert image_tiles(screenshot, (0, 0, 1400, 1500)) >= 6, name  # the pictures and crops are drawn


@pytest.mark.slow
def test_a_cli_multi_turn_run_logs_and_shows_its_trajectories(tmp_path):
    """One step through the command line: the out-of-tree shapes task offering zoom_in, rollout.max_turns=3, the
    HF engine scripted to call zoom_in in every other trajectory (tests/helpers/tool_engine.py); scripts/view.py."""
    import runpy

    from helpers.runs import train_run

    root = Path(__file__).resolve().parents[2]
    train_run(tmp_path, "task.name=tests/helpers/tool_engine.py:ShapesWithZoom",
              "rollout.engine=tests/helpers/tool_engine.py:ScriptedToolEngine", "rollout.max_turns=3",
              "rollout.max_new_tokens=100", "trainer.max_steps=1", "trainer.batch_size=2", "trainer.group_size=2",
              "trainer.save_every=0", "trainer.log_rollouts_every=1")
    (record,) = read_steps(tmp_path)
    completions = [c for group in record["groups"] for c in group["completions"]]
    calls = [turn["call"] for c in completions for turn in c["turns"] if turn["call"]]
    assert calls and all(call["name"] == "zoom_in" and not call["error"] for call in calls)
    assert all(len(call["crops"]) == 1 and call["crops"][0]["image"] for call in calls)
    assert runpy.run_path(str(root / "scripts" / "view.py"))["main"]([str(tmp_path)]) == 0
    assert (tmp_path / "rollouts.html").read_text().count("<img alt='crop'") == len(calls)
