"""The python tool's trajectories as users see them: rollouts.html shows each code cell as code, what it printed and
the images it showed, turn by turn, and a headless chromium opens the page without a console error and draws them.
Trajectories come from the HF engine's multi-turn decoding on the tiny Qwen2.5-VL, steered by scripted segments
that run real code in the sandbox."""

from __future__ import annotations

import json
import os
import re
import shutil
from types import SimpleNamespace

import pytest
import torch
from helpers.browser import CHROMIUM, image_tiles, open_in_chromium, root_tag
from helpers.sandbox import needs_bwrap
from PIL import Image

from gpg_vl.models.load import load_policy
from gpg_vl.models.tiny import EMBEDDED_TINY
from gpg_vl.observe.rollout_log import log_rollouts, read_steps
from gpg_vl.observe.viewer import write_rollouts_html
from gpg_vl.rollout.engine import EnginePrompts, Sampling
from gpg_vl.rollout.multiturn.decoding import generate_trajectories
from gpg_vl.rollout.multiturn.trajectory import MultiTurnSettings
from gpg_vl.rollout.settings import PythonToolSettings
from gpg_vl.train.step.sample import Attempt

pytestmark = needs_bwrap
CELLS = {0: "<code>\n```python\nprint('size', image_1.size)\nshow(image_1.crop((30, 30, 100, 100)).resize((140, 140)))"
            "\n```\n</code>",
         3: '<tool_call>{"name": "python", "arguments": {"code": "print(1 / 0)"}}</tool_call>'}


class LookTask:
    name, uses_boxes, group_columns = "look", False, ()
    reward_functions = {"accuracy": None}
    reward_weights = {}

    def messages(self, row):
        image = Image.new("RGB", (200, 150), (30, 90 + 60 * row["id"], 30))
        image.paste((220, 30, 30), (40, 40, 90, 90))
        return [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": "Which colour is the square?"}]}]

    def target(self, row):
        return "red"


@pytest.fixture(scope="module")
def sampled():
    torch.manual_seed(0)
    policy = load_policy(str(EMBEDDED_TINY), family="auto", dtype="float32", min_pixels=3136, max_pixels=50176)
    task, rows = LookTask(), [{"id": 0}, {"id": 1}]
    messages = [task.messages(row) for row in rows]
    prompts = EnginePrompts(policy.family.encode(messages), messages)
    tokenizer = policy.family.tokenizer
    segments = {row: tokenizer(text, add_special_tokens=False)["input_ids"] for row, text in CELLS.items()}
    settings = MultiTurnSettings(max_turns=2, tool_seconds=30.0, tools={"python": PythonToolSettings(pool=0)})
    rollout = generate_trajectories(policy, prompts, group_size=2, sampling=Sampling(max_new_tokens=110, greedy=True),
                                    settings=settings, tools=("python",),
                                    scripted=lambda row, turn: segments.get(row) if turn == 0 else None)
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    attempt = Attempt(rows=rows, prompts=prompts.batch, rollout=rollout, rewards=rewards,
                      components={"accuracy": rewards}, advantages=rewards - rewards.mean(1, keepdim=True),
                      valid=torch.tensor([True, True]))
    return SimpleNamespace(policy=policy, task=task, rollout=rollout, attempt=attempt)


def test_rollouts_html_shows_each_code_cell_its_output_and_its_images(sampled, tmp_path):
    shown, _, _, failed = sampled.rollout.trajectories
    assert shown.calls[0].text == "size (200, 150)\n" and shown.calls[0].images == 1
    assert failed.calls[0].error and "ZeroDivisionError" in failed.calls[0].text
    log_rollouts(1, [sampled.attempt], policy=sampled.policy, task=sampled.task, output_dir=tmp_path, every=1,
                 groups=2)
    (record,) = read_steps(tmp_path)
    first = record["groups"][0]["completions"][0]["turns"][0]["call"]
    assert json.loads(first["arguments"])["code"].startswith("print('size', image_1.size)")
    assert first["crops"][0]["source"] == -1 and first["crops"][0]["image"]  # an image the code made, kept
    page = write_rollouts_html(tmp_path).read_text()
    assert page.count("<pre class='cell'>") == 2 and "print(&#x27;size&#x27;, image_1.size)\nshow(" in page
    assert "<div class='out-head'>output</div><pre class='observation'>size (200, 150)\n</pre>" in page
    assert page.count("<img alt='crop'") == 1
    assert re.search(r"<div class='out-head'>output</div><pre class='observation error'>Traceback[^<]*"
                     r"ZeroDivisionError", page)


def test_predictions_keep_the_images_the_code_showed(sampled, tmp_path):
    from gpg_vl.observe.viewer import write_predictions_html
    from gpg_vl.train.eval.evaluate import Decoded, prediction_records

    decoded = [Decoded(index=i, completion=text, prompt="look", row={"id": i // 2}, rewards={"accuracy": 0.0},
                       trajectory=trajectory)
               for i, (text, trajectory) in enumerate(zip(sampled.rollout.texts, sampled.rollout.trajectories,
                                                          strict=True))]
    records = prediction_records(sampled.task, decoded, "test", tokenizer=sampled.policy.family.tokenizer)
    (made,) = records[0]["turns"][0]["call"]["crops"]
    assert made["source"] == -1 and made["jpeg"]  # an image the code made: kept in the record, a small JPEG
    json.dumps(records)
    page = write_predictions_html(tmp_path / "predictions.html", sampled.task, records,
                                  [{"id": i // 2} for i in range(4)], {"accuracy": 0.0}).read_text()
    assert page.count("<img alt='crop'") == 1 and page.count("<pre class='cell'>") == 2


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_chromium_draws_the_code_cells_without_errors(sampled, tmp_path):
    log_rollouts(1, [sampled.attempt], policy=sampled.policy, task=sampled.task, output_dir=tmp_path, every=1,
                 groups=2)
    screenshot = tmp_path / "rollouts.png"
    dom, console = open_in_chromium(write_rollouts_html(tmp_path), screenshot)
    assert console == []
    assert "data-js-error=" not in root_tag(dom) and 'data-ready="1"' in root_tag(dom)
    assert len(re.findall(r'<pre class="cell">', dom)) == 2
    assert len(re.findall(r'<img alt="crop" class="crop" src="data:image/jpeg', dom)) == 1
    assert image_tiles(screenshot, (0, 0, 1400, 1500)) >= 4  # the prompts' pictures and the shown image
    if os.environ.get("GPG_VL_KEEP_SCREENSHOT"):  # to look at it: GPG_VL_KEEP_SCREENSHOT=/tmp/shot.png
        shutil.copy(screenshot, os.environ["GPG_VL_KEEP_SCREENSHOT"])
