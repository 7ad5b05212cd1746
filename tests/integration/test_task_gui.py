"""GUI grounding end to end on the embedded tiny model: the synthetic screens, the family's frame moved into pixels
before the rewards read a click, the one-sentence errors of bad data before any model loads, the ScreenSpot
evaluations' summary and printout, GUI-G²'s recipe composing, and both pages drawing the click and the target."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from gpg_vl.cli import eval_main, train_main
from gpg_vl.config.compose import load_config, run_cli
from gpg_vl.data.task import get_task
from gpg_vl.models.load import ASSETS, load_policy

ROOT = Path(__file__).resolve().parents[2]
VIEW_PIXELS = 224 * 168  # the tiny experiment's model.max_pixels: a 448 x 336 screen seen at half size


def test_synthetic_screens_are_seeded_and_name_one_element_inside_the_window():
    task = get_task("gui", test_size=40)
    rows, again = task.load("test"), get_task("gui", test_size=40).load("test")
    assert rows[3]["instruction"] == again[3]["instruction"]
    assert rows[3]["image"].tobytes() == again[3]["image"].tobytes()
    assert task.load("train")[3]["bbox"] != rows[3]["bbox"]  # each split its own seed
    for row in rows:
        x1, y1, x2, y2 = row["box"]
        assert 0 <= x1 < x2 <= 448 and 0 <= y1 < y2 <= 336 and row["image"].size == (448, 336)
        target = [e for e in row["elements"] if tuple(e["bbox"]) == tuple(row["box"])]
        assert len(target) == 1 and target[0]["color"] in row["instruction"] and target[0]["kind"] in \
            row["instruction"].replace("text field", "field")
        assert len({e["color"] for e in row["elements"]}) == len(row["elements"]) >= 2  # the colour names it
        boxes = [e["bbox"] for e in row["elements"]]
        for a in range(len(boxes)):  # no two elements overlap
            for b in range(a + 1, len(boxes)):
                p, q = boxes[a], boxes[b]
                assert p[2] <= q[0] or q[2] <= p[0] or p[3] <= q[1] or q[3] <= p[1]
        # the element's pixels are drawn where its box says: its colour fills the box's middle row somewhere
        middle = [row["image"].getpixel((x, (y1 + y2) // 2)) for x in range(x1, x2)]
        assert len(set(middle)) > 1
    assert {row["data_type"] for row in rows} == {"text", "icon"}


def test_instruction_first_puts_the_question_before_the_screenshot():
    """task.options.instruction_first: the same question and screenshot, the question first (read left to right,
    every image token can then know which element is named); off by default, as ScreenSpot's prompts are."""
    row = get_task("gui", test_size=2).load("test")[1]
    plain = get_task("gui", test_size=2).messages(row)[0]["content"]
    first = get_task("gui", test_size=2, instruction_first=True).messages(row)[0]["content"]
    assert [part["type"] for part in plain] == ["image", "text"]
    assert [part["type"] for part in first] == ["text", "image"]
    assert first[0]["text"] == plain[1]["text"] and first[1]["image"] is plain[0]["image"]
    assert first[0]["text"].startswith(row["instruction"])


def test_the_family_moves_the_models_click_into_pixels_before_the_rewards():
    """Qwen2.5-VL writes pixels of the image it saw (224 x 168 for a 448 x 336 screen): (56, 42) there is (112, 84)
    on the screen, which the task scores, and the predictions hold."""
    from gpg_vl.rollout.types import in_task_frame

    small = load_policy("embedded:tiny-qwen2.5-vl", dtype="float32", min_pixels=3136, max_pixels=VIEW_PIXELS)
    task = get_task("gui", test_size=8)
    row = task.load("test")[0]
    prompts = small.family.encode([task.messages(row)])
    assert prompts.image_sizes == [[(448, 336, 224, 168)]]
    x1, y1, x2, y2 = small.family.to_model_frame(row["box"], prompts.image_sizes[0][0])
    inside = f"<think> it </think><answer>({(x1 + x2) / 2:.0f}, {(y1 + y2) / 2:.0f})</answer>"
    frame = in_task_frame(small, task, [inside, "<think> it </think><answer>(224, 0)</answer>"], prompts, 2)
    assert frame[1] == "<think> it </think><answer>(448, 0)</answer>"  # the screen's top right corner
    assert task.reward_components(frame[0], row) == {"point_in_box": 1.0, "format": 1.0, "accuracy": 1.0}
    assert task.reward_components(inside, row)["accuracy"] == 0.0  # read without the family: the wrong place


def write_screens(folder: Path, rows: list[dict], sizes: dict[str, tuple[int, int]]) -> Path:
    for name, size in sizes.items():
        Image.new("RGB", size, (240, 240, 240)).save(folder / name)
    data = folder / "rows.json"
    data.write_text(json.dumps(rows))
    return data


@pytest.mark.parametrize("bbox, image, message, command", [
    ([10, 10, 30, 20], "gone.png", r"image file '.*gone\.png' does not exist; check data\.image_root=", "train"),
    ([90, 10, 120, 20], "a.png", r"outside its 100x80 image", "eval"),
    ([30, 10, 20, 20], "a.png", r"of negative width or height", "train"),
    ([30, 10, 30, 20], "a.png", r"of zero width or height", "eval"),
    ([30, 10, 40], "a.png", r"not four finite numbers", "train"),
])
def test_bad_rows_are_one_sentence_before_the_model_loads(tmp_path, monkeypatch, capsys, bbox, image, message,
                                                         command):
    from gpg_vl.train import build

    monkeypatch.setattr(build, "build_policy", lambda *args, **kwargs: pytest.fail("the model loaded"))
    good = {"img_filename": "a.png", "bbox": [10, 10, 30, 20], "instruction": "Click OK."}
    data = write_screens(tmp_path, [good, good, {**good, "img_filename": image, "bbox": bbox}], {"a.png": (100, 80)})
    main = {"train": train_main, "eval": eval_main}[command]
    code = run_cli(command, main, ["task=gui", f"data.path={data}", f"output_dir={tmp_path / command}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "Traceback" not in err, err
    assert re.search(message, err) and "rows.json, row 2:" in err and "(1 bad row(s)" in err, err


def test_an_unknown_reward_is_one_sentence_before_the_model_loads(tmp_path, monkeypatch, capsys):
    from gpg_vl.train import build

    monkeypatch.setattr(build, "build_policy", lambda *args, **kwargs: pytest.fail("the model loaded"))
    code = run_cli("train", train_main, ["task=gui", "task.options.rewards=[iou]", f"output_dir={tmp_path / 'r'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "unknown task.options.rewards 'iou'" in err


@pytest.mark.skipif(not (ASSETS / "tiny-qwen2.5-vl-gui").exists(), reason="the gui warm start is not built")
def test_the_warm_start_writes_a_click_on_the_screen_for_every_held_out_row():
    """`embedded:tiny-qwen2.5-vl-gui` (scripts/build_tiny.py --gui) at the experiment's pixel budget: greedy, every
    answer has GUI-R1's shape and one click on the screen once its family moves it into pixels (what reinforcement
    learning starts from, docs/results/gui.md); the clicks are not all one point."""
    from gpg_vl.config.schema import RolloutSettings
    from gpg_vl.rollout.engine import build_engine
    from gpg_vl.train.eval.evaluate import evaluate

    cfg = load_config("train", ["+experiment=gui-tiny"])
    assert cfg.model.name_or_path == "embedded:tiny-qwen2.5-vl-gui" and cfg.model.max_pixels == VIEW_PIXELS
    policy = load_policy("embedded:tiny-qwen2.5-vl-gui", dtype="float32", min_pixels=3136, max_pixels=VIEW_PIXELS)
    task = get_task("gui", **{**cfg.task.options, "test_size": 8})  # the experiment's screens
    engine = build_engine(RolloutSettings(max_new_tokens=64), policy)
    metrics, decoded = evaluate(policy, task, task.load("test"), engine=engine, batch_size=8, max_new_tokens=64)
    assert metrics["wrong_format"] == 0.0 and metrics["reward/format"] == 1.0, metrics
    clicks = [task.click(d.completion, d.row) for d in decoded]
    assert None not in clicks and len({tuple(c.point) for c in clicks}) > 1


def test_gui_g2_recipe_composes(tmp_path):
    cfg = load_config("train", ["+experiment=gui-g2-7b"])
    assert cfg.model.name_or_path == "Qwen/Qwen2.5-VL-7B-Instruct" and cfg.model.max_pixels == 12845056
    assert list(cfg.task.options.rewards) == ["gaussian_point", "gaussian_coverage"]
    assert cfg.task.options.answer == "box"
    assert (cfg.trainer.group_size, cfg.trainer.batch_size, cfg.trainer.lr, cfg.trainer.epochs) == (8, 8, 1e-6, 1)
    printed = subprocess.run([sys.executable, "scripts/train.py", "+experiment=gui-g2-7b", "--cfg", "job"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr
    assert "name: gui" in printed.stdout and "- gaussian_coverage" in printed.stdout
    task = get_task("gui", **{key: value for key, value in cfg.task.options.items() if key != "rewards"},
                    rewards=list(cfg.task.options.rewards))
    assert task.reward_weights == {"gaussian_point": 1.0, "gaussian_coverage": 1.0, "format": 1.0, "accuracy": 0.0}
    assert task.messages(task.load("test")[0])[0]["content"][1]["text"].startswith(
        "Outline the position corresponding to the instruction: Click the")


def test_screenspot_evaluation_prints_and_saves_seeclicks_breakdown(tmp_path, capsys):
    """scripts/eval.py on ScreenSpot-v2 rows (json files per platform) with the tiny model: metrics.json and the
    printout hold every platform's numbers; predictions.html draws each row's target box."""
    images = tmp_path / "imgs"
    images.mkdir()
    for platform, size in (("mobile", (112, 224)), ("desktop", (224, 112))):
        Image.new("RGB", size, (250, 250, 250)).save(images / f"{platform}.png")
        rows = [{"img_filename": f"{platform}.png", "bbox": [10, 20, 30, 40], "instruction": f"open item {k}",
                 "data_type": ("text", "icon")[k % 2], "data_source": "android" if platform == "mobile" else "macos"}
                for k in range(2)]
        (tmp_path / f"screenspot_{platform}_v2.json").write_text(json.dumps(rows))
    out = tmp_path / "out"
    code = run_cli("eval", eval_main, ["task=screenspot", f"data.path={tmp_path}", f"data.image_root={images}",
                                       "eval.max_new_tokens=8", f"output_dir={out}"])
    printed = capsys.readouterr().out
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    for key in ("accuracy", "text_acc", "icon_acc", "wrong_format_num", "num_total", "mobile/text_acc",
                "mobile/icon_acc", "desktop/text_acc", "desktop/icon_acc", "desktop/action_acc"):
        assert key in metrics and re.search(rf"\n  {re.escape(key)} +{metrics[key]:.4f}\n", printed), key
    assert metrics["num_total"] == 4 and metrics["mobile/num_total"] == 2
    html = (out / "predictions.html").read_text()
    assert html.count("<rect class='truth' x='10' y='20' width='30' height='40'/>") == 4


def test_pages_draw_the_click_and_the_target_box(tmp_path):
    """predictions.html of hand-written answers: the click as a ring at its pixels, the box answer and its centre,
    the target box; right and wrong by ScreenSpot's check."""
    from gpg_vl.observe.viewer import write_predictions_html

    task = get_task("gui", test_size=4)
    rows = task.load("test")
    x1, y1, x2, y2 = rows[0]["box"]
    answers = [f"({(x1 + x2) // 2}, {(y1 + y2) // 2})", "(5, 5)", f"[{x1}, {y1}, {x2}, {y2}]", "nowhere"]
    records = [{"index": i, "id": rows[i]["id"], "completion": f"<think> x </think><answer>{a}</answer>",
                "answer": a, "rewards": {}} for i, a in enumerate(answers)]
    records[2]["index"] = 0  # the box answer on row 0 too
    page = write_predictions_html(tmp_path / "p.html", task, records, rows, {"accuracy": 0.5})
    html = page.read_text()
    assert f"<g class='click' id='p0'><circle cx='{(x1 + x2) // 2}' cy='{(y1 + y2) // 2}'" in html
    assert "<g class='click' id='p1'><circle cx='5' cy='5'" in html
    assert f"<rect class='pred' id='p0' x='{x1}' y='{y1}'" in html  # the box answer, its centre a ring without id
    assert html.count("<rect class='truth'") == 4 and "4 predictions of 3 rows, 2 right" in html
    assert "ScreenSpot&#x27;s check" in html


def test_rollout_viewer_draws_each_click_in_original_pixels_and_chromium_shows_it(tmp_path):
    """One logged step of hand-made completions in the MODEL's frame (a 448 x 336 screen seen at 224 x 168): the
    log holds each click in the screen's pixels, rollouts.html draws it beside the target box, and a headless
    chromium opens the page without an error."""
    import torch
    from helpers.browser import CHROMIUM, image_tiles, open_in_chromium, root_tag

    from gpg_vl.observe.rollout_log import log_rollouts, read_steps
    from gpg_vl.observe.viewer import write_rollouts_html
    from gpg_vl.rollout.types import Rollout, in_task_frame
    from gpg_vl.train.step.sample import Attempt

    small = load_policy("embedded:tiny-qwen2.5-vl", dtype="float32", min_pixels=3136, max_pixels=VIEW_PIXELS)
    task = get_task("gui", test_size=4)
    row = task.load("test")[0]
    prompts = small.family.encode([task.messages(row)], ids=[row["id"]])
    x1, y1, x2, y2 = row["box"]
    texts = [f"<think> it </think><answer>({(x1 + x2) / 4:g}, {(y1 + y2) / 4:g})</answer>",  # the centre, halved
             "<think> it </think><answer>(10, 20)</answer>",
             f"<think> it </think><answer>[{x1 / 2:g}, {y1 / 2:g}, {x2 / 2:g}, {y2 / 2:g}]</answer>", "no click"]
    tokens = small.family.tokenizer(texts, padding=True, return_tensors="pt").input_ids
    ids = torch.cat([tokens, torch.full((4, 1), small.family.eos_ids[0])], dim=1)
    scored = in_task_frame(small, task, texts, prompts, 4)
    scores = [task.reward_components(text, row) for text in scored]
    rewards = torch.tensor([[task.total(s) for s in scores]])
    attempt = Attempt([row], prompts, Rollout(ids, torch.ones_like(ids, dtype=torch.bool), texts, 4), rewards,
                      {n: torch.tensor([[s[n] for s in scores]]) for n in task.reward_functions},
                      rewards - rewards.mean(), torch.tensor([True]))
    log_rollouts(1, [attempt], policy=small, task=task, output_dir=tmp_path, every=10, groups=8)
    page = write_rollouts_html(tmp_path)
    group = read_steps(tmp_path)[0]["groups"][0]
    assert group["target_box"] == list(row["box"]) and group["image_sizes"] == [[448, 336]]
    clicks = [c["point"] for c in group["completions"]]
    assert clicks[0] == pytest.approx([(x1 + x2) / 2, (y1 + y2) / 2], abs=0.02) and clicks[1] == [20, 40]
    assert clicks[3] is None and group["completions"][2]["box"] == pytest.approx(list(row["box"]), abs=0.02)
    assert [s["accuracy"] for s in scores] == [1.0, 0.0, 1.0, 0.0]
    html = page.read_text()
    assert "<g class='click' id='s1g0c1'><circle cx='20' cy='40'" in html and html.count("<g class='click'") == 3
    assert f"<rect class='truth' x='{x1}' y='{y1}' width='{x2 - x1}' height='{y2 - y1}'/>" in html
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium): the page was checked as text only")
    dom, console = open_in_chromium(page, tmp_path / "rollouts.png")
    assert 'data-ready="1"' in root_tag(dom) and "data-js-error" not in root_tag(dom) and not console
    assert image_tiles(tmp_path / "rollouts.png", (0, 0, 1400, 1500)) > 0
