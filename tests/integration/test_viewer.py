"""The rollout viewer and the predictions page: what is logged is what the trainer used, disk use is bounded,
text is escaped, boxes are in original pixels, the trackers get text and images, and a headless browser opens
the pages without a console error and shows their images."""

import json
import re
import runpy
from pathlib import Path
from types import SimpleNamespace

import datasets
import numpy as np
import pytest
import torch
from helpers.browser import CHROMIUM, image_tiles, open_in_chromium, root_tag
from PIL import Image

import gpg_vl.train.loop
import gpg_vl.train.step.pipeline
from gpg_vl import get_task
from gpg_vl.cli import eval_main
from gpg_vl.config.compose import load_config, run_cli
from gpg_vl.config.schema import RolloutSettings, TrainerSettings
from gpg_vl.observe.rollout_log import (
    MAX_EDGE,
    MAX_STEP_BYTES,
    MAX_THUMB_BYTES,
    due,
    log_rollouts,
    read_steps,
    step_bytes_bound,
)
from gpg_vl.observe.viewer import write_rollouts_html
from gpg_vl.rollout.types import Rollout
from gpg_vl.train.loop import RunSettings, setup_policy, train
from gpg_vl.train.step.sample import Attempt

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "<script>alert('x')</script>"
try:
    import wandb
except ImportError:
    wandb = None


# ---------------------------------------------------------------- a 3-step run, everything it used captured

@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """3 steps of shapes on the tiny model (resampling on), every step logged, the trackers on; the Collected
    attempts of each step as the trainer got them from collect_valid_groups, and those update() received."""
    from accelerate import Accelerator

    from gpg_vl.models.load import load_policy

    output = tmp_path_factory.mktemp("run")
    collected, updated = [], []
    original_collect, original_update = gpg_vl.train.step.pipeline.collect_valid_groups, gpg_vl.train.loop.update

    def collect(*args, **kwargs):
        collected.append(original_collect(*args, **kwargs))
        return collected[-1]

    def update(learner, attempts, **kwargs):
        updated.append((len(collected), list(attempts)))
        return original_update(learner, attempts, **kwargs)

    trackers = ["tensorboard"] + (["wandb"] if wandb is not None else [])
    tables = []  # (step, wandb.Table) as the wandb run got them
    with pytest.MonkeyPatch.context() as patch:
        if wandb is not None:
            original_log = wandb.Run.log

            def log(self, data, *args, **kwargs):
                if "rollouts" in data:
                    tables.append((kwargs.get("step"), data["rollouts"]))
                return original_log(self, data, *args, **kwargs)

            patch.setattr(wandb.Run, "log", log)
        patch.setattr(gpg_vl.train.step.pipeline, "collect_valid_groups", collect)  # the sampling stage
        patch.setattr(gpg_vl.train.loop, "update", update)
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("WANDB_DIR", str(output))
        patch.setenv("WANDB_SILENT", "true")
        torch.manual_seed(0)
        policy = load_policy("embedded:tiny-qwen2.5-vl", dtype="float32", min_pixels=3136, max_pixels=50176)
        task = get_task("shapes", train_size=2000, test_size=40)
        accelerator = Accelerator(log_with=trackers, project_dir=str(output))
        trainer = TrainerSettings(max_steps=3, group_size=4, batch_size=4, micro_batch_tokens=0, lr=1e-5,
                                  eval_before=False, eval_after=False, beta_th=0.9, max_attempts=2,
                                  report_to="tensorboard", log_rollouts_every=1, log_rollouts_groups=6)
        train(setup_policy(policy, task, RunSettings(trainer, RolloutSettings(max_new_tokens=24), output_dir=output),
                           accelerator=accelerator))
    return SimpleNamespace(output=output, collected=collected, updated=updated, policy=policy, task=task,
                           tables=tables)


def test_logged_rollouts_hold_the_rewards_and_advantages_the_trainer_used(run):
    steps = read_steps(run.output)
    assert [s["step"] for s in steps] == [1, 2, 3] and len(run.collected) == 3
    for (index, attempts) in run.updated:  # update() trained on the very attempts that were collected
        assert all(a is b for a, b in zip(attempts, run.collected[index - 1].attempts, strict=True))
    resampled = 0
    for record, collected in zip(steps, run.collected, strict=True):
        attempts = collected.attempts
        assert record["attempts"] == len(attempts) and record["groups_per_attempt"] == [4] * len(attempts)
        assert record["valid_per_attempt"] == [int(a.valid.sum()) for a in attempts]
        assert len(record["groups"]) == min(6, 4 * len(attempts))
        for group in record["groups"]:
            attempt, b = attempts[group["attempt"]], group["group"]
            resampled += group["attempt"] > 0
            assert group["id"] == attempt.rows[b]["id"] and group["valid"] == bool(attempt.valid[b])
            assert group["target"] == attempt.rows[b]["answer"] and len(group["completions"]) == 4
            for g, completion in enumerate(group["completions"]):
                sequence = b * 4 + g
                assert completion["reward"] == float(attempt.rewards[b, g])
                assert completion["advantage"] == float(attempt.advantages[b, g])
                assert completion["components"] == {n: float(v[b, g]) for n, v in attempt.components.items()}
                assert completion["text"] == attempt.rollout.texts[sequence]  # shapes has no boxes to move
                assert completion["tokens"] == int(attempt.rollout.completion_mask[sequence].sum())
                kept = attempt.rollout.completion_ids[sequence, :completion["tokens"]].tolist()
                assert completion["end"] == ("eos" if set(kept) & set(run.policy.family.eos_ids) else "cut")
    assert resampled > 0  # groups of resampled attempts are shown, not only the first rollout's
    # the same numbers as metrics.jsonl's step means (all of this process's completions)
    lines = [json.loads(x) for x in (run.output / "metrics.jsonl").read_text().splitlines()]
    for line, collected in zip(lines, run.collected, strict=True):
        rewards = torch.cat([a.rewards.flatten() for a in collected.attempts])
        assert line["reward_mean"] == pytest.approx(float(rewards.mean()))


def test_the_page_shows_exactly_those_rewards_and_advantages(run):
    page = write_rollouts_html(run.output).read_text()
    sections = re.findall(r"<section class='step' data-step='(\d+)'>(.*?)</section>", page, re.S)
    assert [int(s) for s, _ in sections] == [1, 2, 3]
    for (_, section), record, collected in zip(sections, read_steps(run.output), run.collected, strict=True):
        shown = re.findall(r"<b>#(\d+)</b> reward <b>([^<]+)</b> = (.*?)<br>advantage <b>([^<]+)</b>", section)
        expected = [(str(g), f"{float(a.rewards[group['group'], g]):.4g}",
                     " + ".join(f"{n} {float(a.components[n][group['group'], g]):.4g}" for n in a.components),
                     f"{float(a.advantages[group['group'], g]):.4g}")
                    for group in record["groups"] for a in [collected.attempts[group["attempt"]]] for g in range(4)]
        assert shown == expected
    # the curves: one polyline per metric, over the three steps
    assert page.count("<polyline") == 3 and "mean reward" in page and "alpha" in page
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page


def test_tensorboard_gets_each_group_as_text_and_image(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list(run.output.rglob("events.out.tfevents.*"))
    accumulator = EventAccumulator(str(events[0].parent), size_guidance={"images": 0, "tensors": 0})
    accumulator.Reload()
    tags = accumulator.Tags()
    assert {f"rollouts/group_{i}" for i in range(6)} <= set(tags["images"])
    assert {f"rollouts/group_{i}/text_summary" for i in range(6)} <= set(tags["tensors"])
    first = accumulator.Tensors("rollouts/group_0/text_summary")
    assert [e.step for e in first] == [1, 2, 3]
    text = first[0].tensor_proto.string_val[0].decode()
    group = read_steps(run.output)[0]["groups"][0]
    assert group["id"] in text and group["completions"][0]["text"] in text
    image = accumulator.Images("rollouts/group_0")[0]
    assert image.width == 112 and image.height == 112  # the shapes image, its thumbnail


@pytest.mark.skipif(wandb is None, reason="wandb is not installed (pip install -e '.[wandb]')")
def test_wandb_gets_a_table_with_image_columns_offline(run):
    assert [step for step, _ in run.tables] == [1, 2, 3]  # through accelerate's wandb tracker, at each step
    files = sorted(run.output.rglob("media/table/rollouts_*.table.json"))
    assert len(files) == 3  # the offline run wrote each step's table
    records = read_steps(run.output)
    for (_, table), record in zip(run.tables, records, strict=True):
        assert table.columns[:6] == ["step", "group", "id", "attempt", "valid", "image"]
        assert len(table.data) == 6 * 4  # a row per completion
        rewards = [row[table.columns.index("reward")] for row in table.data]
        assert rewards == [c["reward"] for g in record["groups"] for c in g["completions"]]
        image = table.data[0][table.columns.index("image")]
        assert isinstance(image, wandb.Image) and image.image.size == (112, 112)


# ---------------------------------------------------------------- bounds and escaping, without a model

class NoiseTask:
    """Huge noise images and nothing else: the worst case for the thumbnails."""

    name, uses_boxes = "noise", False
    reward_functions = {"a": None, "b": None}
    reward_weights = {}

    def __init__(self, size=1500, images=6):
        self.size, self.images = size, images

    def messages(self, row):
        rng = np.random.default_rng(row["id"])
        pictures = [Image.fromarray(rng.integers(0, 256, (self.size, self.size + 7, 3), dtype=np.uint8))
                    for _ in range(self.images)]
        return [{"role": "user", "content": [*({"type": "image", "image": p} for p in pictures),
                                             {"type": "text", "text": "q" * 50_000}]}]

    def target(self, row):
        return "t" * 50_000


def fake_attempt(texts, groups, group_size, ids=None, eos=2):
    length = 5
    ids_tensor = torch.full((groups * group_size, length), 7)
    ids_tensor[::2, 3] = eos  # even sequences end at EOS, odd ones are cut off
    mask = torch.ones_like(ids_tensor, dtype=torch.bool)
    mask[::2, 4] = False
    rewards = torch.arange(groups * group_size, dtype=torch.float32).view(groups, group_size)
    rewards[0, 0] = float("nan")
    return Attempt(rows=[{"id": i} for i in (ids or range(groups))], prompts=SimpleNamespace(image_sizes=[], texts=[]),
                   rollout=Rollout(ids_tensor, mask, texts, group_size), rewards=rewards,
                   components={"a": rewards, "b": rewards * 0}, advantages=rewards - rewards.mean(1, keepdim=True),
                   valid=torch.ones(groups, dtype=torch.bool))


def test_disk_use_is_bounded_whatever_the_model_writes(tmp_path):
    groups, group_size = 8, 80  # 8 x 80 completions of 2000 characters are over MAX_STEP_BYTES: texts are cut more
    policy = SimpleNamespace(family=SimpleNamespace(eos_ids=[2]))
    attempt = fake_attempt([SCRIPT + "x" * 200_000] * (groups * group_size), groups, group_size)
    path = log_rollouts(10, [attempt], policy=policy, task=NoiseTask(), output_dir=tmp_path, every=5, groups=groups)
    images = list((tmp_path / "rollouts" / "images").iterdir())
    step_file = path.stat().st_size
    assert step_file <= MAX_STEP_BYTES
    assert len(images) == groups * 4  # MAX_IMAGES a prompt
    for image in images:
        assert image.stat().st_size <= MAX_THUMB_BYTES
        with Image.open(image) as opened:
            assert opened.format == "JPEG" and max(opened.size) <= MAX_EDGE
    assert step_file + sum(i.stat().st_size for i in images) <= step_bytes_bound(groups)
    record = json.loads(path.read_text())
    assert record["text_chars"] < 2000
    completion = record["groups"][0]["completions"][0]
    assert completion["truncated"] and completion["chars"] == len(SCRIPT) + 200_000
    assert completion["reward"] == "nan" and record["groups"][0]["completions"][1]["reward"] == 1.0
    assert [c["end"] for c in record["groups"][0]["completions"][:2]] == ["eos", "cut"]
    assert [c["tokens"] for c in record["groups"][0]["completions"][:2]] == [4, 5]
    # the same prompts again at a later step: no image is stored twice
    log_rollouts(15, [attempt], policy=policy, task=NoiseTask(), output_dir=tmp_path, every=5, groups=groups)
    assert len(list((tmp_path / "rollouts" / "images").iterdir())) == groups * 4
    # steps that are not due write nothing; 0 switches logging off
    assert log_rollouts(12, [attempt], policy=policy, task=NoiseTask(), output_dir=tmp_path, every=5,
                        groups=groups) is None
    assert [due(s, 10) for s in (1, 2, 9, 10, 11, 20)] == [True, False, False, True, False, True]
    assert not any(due(s, 0) for s in (1, 10))


def test_completion_text_is_escaped_on_the_page(tmp_path):
    policy = SimpleNamespace(family=SimpleNamespace(eos_ids=[2]))
    texts = [SCRIPT, "<b>bold</b> & <img src=x onerror=alert(1)>"]
    log_rollouts(1, [fake_attempt(texts, 1, 2)], policy=policy, task=NoiseTask(size=64, images=1),
                 output_dir=tmp_path, every=10, groups=8)
    page = write_rollouts_html(tmp_path).read_text()
    assert page.count("<script") == 1  # the viewer's own script, nothing from a completion
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page
    assert "&lt;img src=x onerror=alert(1)&gt;" in page and "<img src=x" not in page


def test_a_resumed_run_shows_no_step_past_its_last_metrics_line(tmp_path):
    policy = SimpleNamespace(family=SimpleNamespace(eos_ids=[2]))
    for step in (1, 10, 20):  # step 20 was logged by a continuation that a resume from step 10 abandoned
        log_rollouts(step, [fake_attempt(["a", "b"], 1, 2)], policy=policy, task=NoiseTask(size=32, images=1),
                     output_dir=tmp_path, every=10, groups=8)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward_mean": 0.5, "valid_fraction": 1.0,
                                                                "alpha": 1.0}) + "\n" for s in range(1, 13)))
    page = write_rollouts_html(tmp_path).read_text()
    assert re.findall(r"<section class='step' data-step='(\d+)'>", page) == ["1", "10"]


def test_view_script_writes_the_page_or_names_a_folder_without_rollouts_in_one_sentence(tmp_path, capsys):
    view = runpy.run_path(str(ROOT / "scripts" / "view.py"))["main"]  # the script's own entry point, in-process
    assert view([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "log_rollouts_every" in err and err.count("\n") == 1
    log_rollouts(1, [fake_attempt(["a", "b"], 1, 2)], policy=SimpleNamespace(family=SimpleNamespace(eos_ids=[2])),
                 task=NoiseTask(size=32, images=1), output_dir=tmp_path, every=10, groups=8)
    assert view([str(tmp_path)]) == 0 and (tmp_path / "rollouts.html").is_file()


@pytest.mark.parametrize("damage", ["truncated", "empty", "list", "step_not_int", "bad_group"])
def test_a_damaged_step_file_is_skipped_with_a_warning_naming_it(tmp_path, capsys, damage):
    view = runpy.run_path(str(ROOT / "scripts" / "view.py"))["main"]
    policy = SimpleNamespace(family=SimpleNamespace(eos_ids=[2]))
    for step in (1, 10):
        log_rollouts(step, [fake_attempt(["a", "b"], 1, 2)], policy=policy, task=NoiseTask(size=32, images=1),
                     output_dir=tmp_path, every=10, groups=8)
    damaged = tmp_path / "rollouts" / "step-10.json"
    record = json.loads(damaged.read_text())
    damaged.write_text({"truncated": damaged.read_text()[:40], "empty": "", "list": "[1, 2]",
                        "step_not_int": json.dumps({**record, "step": "one"}),
                        "bad_group": json.dumps({**record, "groups": [{"completions": 3}]})}[damage])
    assert view([str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert err.count("warning: skipped") == 1 and "step-10.json" in err and "Traceback" not in err
    page = (tmp_path / "rollouts.html").read_text()
    assert re.findall(r"<section class='step' data-step='(\d+)'>", page) == ["1"]
    damaged.write_text("")  # with every step file damaged: one sentence, exit 2
    (tmp_path / "rollouts" / "step-1.json").write_text("[]")
    assert view([str(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith("error: ")


# ---------------------------------------------------------------- grounding: boxes in original pixels

@pytest.fixture()
def reasonseg(tmp_path, monkeypatch):
    """Two ReasonSeg rows (Hub schema), 320 x 240 images that the tiny model's processor resizes."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    masks, images = [], []
    for x1, y1, x2, y2 in ((40, 30, 200, 150), (180, 100, 300, 230)):
        mask = np.zeros((240, 320), dtype=bool)
        mask[y1:y2, x1:x2] = True
        pixels = np.full((240, 320, 3), 190, dtype=np.uint8)
        pixels[::16] = (90, 90, 90)
        pixels[mask] = (220, 30, 30)
        masks.append(mask)
        images.append(Image.fromarray(pixels))
    rows = datasets.Dataset.from_dict({"image": images, "text": ["the red thing", "the other red thing"],
                                       "mask": [m.tolist() for m in masks]})
    path = tmp_path / "reasonseg.parquet"
    rows.to_parquet(str(path))
    return path


def grounding_run(policy, reasonseg, output):
    """One logged lisa step from a hand-made attempt: completions in the MODEL's frame, as the model writes them."""
    task = get_task("lisa", data_path=str(reasonseg))
    row = task.load("test")[0]
    prompts = policy.family.encode([task.messages(row)], ids=[row["id"]])
    sx, sy = policy.family.box_scale(prompts.image_sizes[0][0])
    x1, y1, x2, y2 = row["box"]
    model_box = f"({round(x1 * sx)},{round(y1 * sy)}),({round(x2 * sx)},{round(y2 * sy)})"
    texts = [f"<think> the red one </think>\n<answer>{model_box}</answer>", f"<answer>[10,10,60,50]</answer>{SCRIPT}",
             "no box at all"]
    tokens = policy.family.tokenizer(texts, padding=True, return_tensors="pt").input_ids
    ids = torch.cat([tokens, torch.full((3, 1), policy.family.eos_ids[0])], dim=1)
    mask = torch.ones_like(ids, dtype=torch.bool)
    from gpg_vl.rollout.types import in_task_frame

    scored = in_task_frame(policy, task, texts, prompts, 3)
    scores = [task.reward_components(text, row) for text in scored]
    rewards = torch.tensor([[task.total(s) for s in scores]])
    attempt = Attempt([row], prompts, Rollout(ids, mask, texts, 3), rewards,
                      {n: torch.tensor([[s[n] for s in scores]]) for n in task.reward_functions},
                      rewards - rewards.mean(), torch.tensor([True]))
    log_rollouts(1, [attempt], policy=policy, task=task, output_dir=output, every=10, groups=8)
    return row, scored, write_rollouts_html(output)


def test_grounding_boxes_are_logged_and_drawn_in_original_pixels(policy, reasonseg, tmp_path):
    row, scored, page = grounding_run(policy, reasonseg, tmp_path)
    group = read_steps(tmp_path)[0]["groups"][0]
    assert group["target_box"] == list(row["box"]) == [40, 30, 200, 150] and group["image_sizes"] == [[320, 240]]
    boxes = [c["box"] for c in group["completions"]]
    assert boxes[0] == pytest.approx(row["box"], abs=2) and boxes[2] is None  # back in original pixels
    assert [c["text"] for c in group["completions"]] == scored  # the texts the rewards saw
    html = page.read_text()
    assert "viewBox='0 0 320 240'" in html and "<rect class='truth' x='40' y='30' width='160' height='120'/>" in html
    assert html.count("<rect class='pred'") == 2 and "&lt;script&gt;" in html


def lisa_predictions(reasonseg, output):
    """predictions.html of two hand-written lisa completions, re-scored with the box segmenter (no model)."""
    output.mkdir()
    predictions = output / "given.jsonl"
    answers = ["(40,30),(200,150)", f"[0,0,100,100]{SCRIPT}"]
    with predictions.open("w") as handle:
        for index, answer in enumerate(answers):
            handle.write(json.dumps({"index": index, "id": f"{index}", "split": "test",
                                     "completion": f"<think> x </think>\n<answer>{answer}</answer>"}) + "\n")
    assert run_cli("eval", eval_main, ["task=lisa", f"data.path={reasonseg}", f"predictions={predictions}",
                                       "segmenter=box", f"output_dir={output}"]) == 0
    return output / "predictions.html"


def test_predictions_page_of_lisa_has_boxes_masks_filter_and_scores(reasonseg, tmp_path):
    lisa_predictions(reasonseg, tmp_path / "out")
    records = [json.loads(x) for x in (tmp_path / "out" / "predictions.jsonl").read_text().splitlines()]
    assert all(r["pred_mask"]["size"] == [240, 320] for r in records)  # the segmenter's masks are saved
    html = (tmp_path / "out" / "predictions.html").read_text()
    assert "2 rows, 1 right" in html and html.count("<rect class='truth'") == 2
    assert html.count("class='mask truth'") == 2 and html.count("class='mask pred'") == 2
    assert "<option value='right'>right</option>" in html and html.count("<script") == 1
    assert re.search(r"<td>miou</td><td>0\.5\d*</td>", html)


def test_predictions_page_breaks_accuracy_down_by_the_task_groups(shapes_eval):
    output, metrics = shapes_eval
    html = (output / "predictions.html").read_text()
    rows = re.findall(r"data-filter-value='question_type=(\w+)'>\w+</button></td><td>(\d+)</td><td>(\d+)</td>", html)
    assert rows
    for qtype, count, right in rows:
        assert int(right) / int(count) == pytest.approx(metrics[f"accuracy/{qtype}"])
    assert sum(int(c) for _, c, _ in rows) == 8


def test_predictions_page_shows_a_bounded_number_of_samples_per_row_and_says_how_many_it_hides(tmp_path):
    from gpg_vl.observe.viewer import SAMPLES_SHOWN, write_predictions_html

    task = get_task("shapes")
    rows = task.load(task.eval_split)[:4]

    def records(k):
        return [{"index": i, "id": str(i), "sample": s, "prompt": "What shape?", "completion": f"<answer>{s}</answer>",
                 "answer": str(s), "target": "circle", "rewards": {"accuracy": float(s % 2)}}
                for i in range(len(rows)) for s in range(k)]

    many = records(500)  # eval.samples=500 on 4 rows
    kept = json.dumps(many)
    page = write_predictions_html(tmp_path / "many.html", task, many, rows, {"accuracy": 0.5}, split="test")
    html = page.read_text()
    assert html.count("<article class='card item'") == 4 * SAMPLES_SHOWN == 32
    hidden = 4 * 500 - 32
    assert (f"2000 predictions of 4 rows, 1000 right (right: accuracy reward &gt;= 0.5); the page shows the first "
            f"8 samples of each row, {hidden} more are in predictions.jsonl") in html  # the counts cover them all
    assert json.dumps(many) == kept  # the records (what predictions.jsonl holds) are all left as they were
    one = write_predictions_html(tmp_path / "one.html", task, records(1), rows, {"accuracy": 0.0}).read_text()
    assert one.count("<article class='card item'") == 4 and "more are in" not in one  # greedy: every row shown
    eight = write_predictions_html(tmp_path / "eight.html", task, records(8), rows, {"accuracy": 0.5}, split="test")
    assert page.stat().st_size < 1.05 * eight.stat().st_size  # 500 samples a row weigh what 8 do


@pytest.fixture(scope="module")
def shapes_eval(tmp_path_factory):
    output = tmp_path_factory.mktemp("eval")
    metrics = eval_main(load_config("eval", [f"output_dir={output}", "eval.limit=8", "rollout.max_new_tokens=24"]))
    return output, metrics


# ---------------------------------------------------------------- a person's view: headless chromium


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_chromium_opens_the_pages_without_errors_and_shows_the_images(run, shapes_eval, policy, reasonseg, tmp_path):
    # the check itself sees an error: a page whose script fails
    broken = tmp_path / "broken.html"
    broken.write_text(write_rollouts_html(run.output).read_text().replace("apply();\n})();", "nosuch();\n})();"))
    dom, console = open_in_chromium(broken, tmp_path / "broken.png")
    assert "data-js-error=" in root_tag(dom) and any("nosuch" in line for line in console)

    grounding = grounding_run(policy, reasonseg, tmp_path / "lisa-run")[2]
    pages = {"rollouts": write_rollouts_html(run.output), "predictions": shapes_eval[0] / "predictions.html",
             "lisa-rollouts": grounding, "lisa-predictions": lisa_predictions(reasonseg, tmp_path / "lisa-eval")}
    doms = {}  # each page's DOM as chromium left it, read again below
    for name, page in pages.items():
        screenshot = tmp_path / f"{name}.png"
        dom, console = doms[name] = open_in_chromium(page, screenshot)
        assert console == [], (name, console)
        assert "data-js-error=" not in root_tag(dom) and 'data-ready="1"' in root_tag(dom), name  # it ran to its end
        # the thumbnails' column (left of the completions) shows image content, not a blank page
        assert image_tiles(screenshot, (0, 0, 300, 1500)) >= 6, name
    assert "&lt;script&gt;alert('x')&lt;/script&gt;" in doms["lisa-rollouts"][0]
    # the step selector lists every logged step, the last one shown
    dom = doms["rollouts"][0]
    assert re.findall(r'<option value="(\d+)"', dom) == ["1", "2", "3"]
    assert re.findall(r'<section class="step" data-step="(\d+)"(?! hidden)', dom) == ["3"]
    # filters, set from the address: only the wrong predictions, only a step's invalid groups
    def visible(dom, kind):
        tags = re.findall(rf'<article class="{kind} item[^"]*" data-tags="([^"]*)"([^>]*)>', dom)
        return [tag for tag, rest in tags if "hidden" not in rest]

    dom, _ = open_in_chromium(pages["lisa-predictions"], tmp_path / "w.png", "#verdict=wrong")
    assert visible(dom, "card") == ["[&quot;wrong&quot;]"]
    step = next(r["step"] for r in read_steps(run.output) if not all(g["valid"] for g in r["groups"]))
    dom, _ = open_in_chromium(pages["rollouts"], tmp_path / "i.png", f"#step={step}&state=invalid")
    section = re.search(rf'<section class="step" data-step="{step}">(.*?)</section>', dom, re.S).group(1)
    shown = visible(section, "group")
    assert shown and all("invalid" in tags for tags in shown)
