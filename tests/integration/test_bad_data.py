"""Bad data never crashes a run: each broken case is skipped and counted by reason, the run goes on, too many bad
rows stop it with one sentence; NaN/inf losses and gradients skip the step, too many in a row stop the run."""

import io
import json
import math
import struct
import sys
import zlib
from pathlib import Path

import datasets
import gpg_vl_tasks.lisa
import numpy as np
import pytest
import torch
from PIL import Image

from gpg_vl import get_task
from gpg_vl.cli import train_main
from gpg_vl.config.compose import load_config
from gpg_vl.data.stream import PromptStream, prepare_prompt
from gpg_vl.errors import BadRow, UserError
from gpg_vl.train.checkpoint.folder import latest_checkpoint

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import validate_data  # noqa: E402

GOOD_IMAGES = {  # file -> (image, the RGB pixel expected at (0, 0) after conversion)
    "rgb.png": (Image.new("RGB", (8, 8), (10, 20, 30)), (10, 20, 30)),
    "rgba.png": (Image.new("RGBA", (8, 8), (255, 0, 0, 128)), (255, 127, 127)),  # composited on white
    "grey.png": (Image.new("L", (8, 8), 77), (77, 77, 77)),
    "palette.png": (Image.new("P", (8, 8), 1), (0, 0, 255)),
    "cmyk.jpg": (Image.new("CMYK", (8, 8), (0, 255, 255, 0)), (255, 0, 0)),
    "sixteen.png": (Image.fromarray(np.full((8, 8), 100 * 257, dtype=np.uint16)), (100, 100, 100)),  # I;16
}
# row -> the reason it is bad, for the GeoQA test layout (image_path, question, ground_truth)
BAD_REASONS = {6: "missing image file", 7: "corrupt image", 8: "corrupt image", 9: "zero-size image",
               10: "image too large", 11: "empty question", 12: "empty answer", 13: "missing column",
               14: "missing image"}


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-datasets-cache")))


def png_bytes(image):
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def bomb_png(width=30_000, height=30_000) -> bytes:
    """A 70-byte PNG whose header claims width x height pixels (a decompression bomb, without the memory)."""
    data = bytearray(png_bytes(Image.new("L", (1, 1))))
    header = bytearray(struct.pack(">II", width, height)) + data[24:29]
    data[16:33] = header + struct.pack(">I", zlib.crc32(b"IHDR" + header))
    return bytes(data)


def write_geoqa_fixture(folder: Path, good_copies: int = 1) -> Path:
    """A GeoQA test-layout jsonl with images in every mode and one row for each way a row can be broken."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, (image, _) in GOOD_IMAGES.items():
        if image.mode == "P":
            image.putpalette([0, 0, 0, 0, 0, 255])
        image.save(folder / name)
    noise = png_bytes(Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)))
    (folder / "truncated.png").write_bytes(noise[: len(noise) // 2])
    (folder / "garbage.png").write_bytes(b"this is not an image at all")
    (folder / "empty.png").write_bytes(b"")
    (folder / "bomb.png").write_bytes(bomb_png())
    rows = [{"image_path": name, "question": f"What is {i} + 1?", "ground_truth": str(i + 1)}
            for i, name in enumerate(GOOD_IMAGES)]
    rows += [
        {"image_path": "missing.png", "question": "q", "ground_truth": "1"},
        {"image_path": "truncated.png", "question": "q", "ground_truth": "1"},
        {"image_path": "garbage.png", "question": "q", "ground_truth": "1"},
        {"image_path": "empty.png", "question": "q", "ground_truth": "1"},
        {"image_path": "bomb.png", "question": "q", "ground_truth": "1"},
        {"image_path": "rgb.png", "question": "   ", "ground_truth": "1"},
        {"image_path": "rgb.png", "question": "What is 2 + 2?", "ground_truth": ""},
        {"image_path": "rgb.png", "questoin": "What is 2 + 2?", "ground_truth": "4"},  # a renamed column
        {"image_path": None, "question": "What is 2 + 2?", "ground_truth": "4"},
    ]
    rows += [{"image_path": name, "question": f"What is {i} + 1?", "ground_truth": str(i + 1)}
             for _ in range(good_copies - 1) for i, name in enumerate(GOOD_IMAGES)]
    file = folder / "geoqa_test.jsonl"
    file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return file


def geoqa(file):
    return get_task("geoqa", data_path=str(file))


def reasons(task, rows):
    found = {}
    for index in range(len(rows)):
        try:
            prepare_prompt(task, rows, index)
        except BadRow as error:
            found[index] = error.reason
    return found


def test_every_broken_row_is_told_apart_and_every_image_mode_converts_to_the_right_rgb(tmp_path):
    task = geoqa(write_geoqa_fixture(tmp_path))
    rows = task.load("test")
    assert reasons(task, rows) == BAD_REASONS
    for index, (name, (_, expected)) in enumerate(GOOD_IMAGES.items()):
        image = prepare_prompt(task, rows, index).messages[0]["content"][0]["image"]
        assert image.mode == "RGB" and image.size == (8, 8), name
        assert all(abs(a - b) <= 2 for a, b in zip(image.getpixel((0, 0)), expected, strict=True)), (name, expected)


def test_validate_data_prints_the_counts_by_reason_and_the_stop_sentence(tmp_path, capsys):
    file = write_geoqa_fixture(tmp_path)
    assert validate_data.main(["task=geoqa", f"data.path={file}", "split=test"]) == 2
    out, err = capsys.readouterr()
    assert "geoqa / test: 15 seen, 9 bad (60.0%; limit data.max_bad_fraction=0.05)" in out
    for reason, count in (("corrupt image", 2), ("missing image file", 1), ("empty question", 1),
                          ("empty answer", 1), ("missing column", 1), ("zero-size image", 1), ("image too large", 1)):
        assert any(line.split() == [*reason.split(), str(count)] for line in out.splitlines()), reason
    assert "bad rows:\n  row 6: missing image file: image file" in out and "row 14: missing image:" in out
    message = err.strip().splitlines()[-1]
    assert message.startswith("error: 9 of 15 rows seen are bad (60.0%), over data.max_bad_fraction=0.05; the "
                              "first: row 6 (missing image file), row 7 (corrupt image), row 8 (corrupt image)")
    assert "row 9 (zero-size image), row 10 (image too large); fix" in message and "\n" not in message
    assert message.count(". ") == 0 and message.endswith("raise data.max_bad_fraction.")
    assert validate_data.main(["task=geoqa", f"data.path={file}", "split=test", "limit=6"]) == 0
    assert "geoqa / test: 6 seen, 0 bad" in capsys.readouterr().out


LISA_SIZE = (8, 6)  # width, height


def test_lisa_masks_that_are_broken_or_do_not_fit_their_image_are_bad_rows(tmp_path):
    Image.new("RGB", LISA_SIZE, (0, 90, 0)).save(tmp_path / "scene.png")
    width, height = LISA_SIZE
    square = [[1.0, 1.0, 5.0, 1.0, 5.0, 4.0, 1.0, 4.0]]
    rows = {"image": ["scene.png"] * 5, "img_height": [height] * 5, "img_width": [width] * 5,
            "text": ["the green part", "   ", "the green part", "the green part", "the green part"],
            "mask": [square, square, [[1.0, 1.0, math.nan, 1.0, 5.0, 4.0]],
                     np.ones((height + 2, width), dtype=float).tolist(), [[1.0, 1.0, 5.0, 1.0, 5.0, 1e12]]]}
    datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / "train.parquet"))
    task = get_task("lisa", data_path=str(tmp_path))
    loaded = task.load("train")
    assert reasons(task, loaded) == {1: "empty question", 2: "bad mask", 3: "mask size mismatch", 4: "bad mask"}
    assert prepare_prompt(task, loaded, 0).row["box"] == (1.0, 1.0, 5.0, 4.0)


BOX_TASK = '''
from gpg_vl import Task
from gpg_vl.reward.primitives import iou_reward
from gpg_vl.data.sources import RowView, load_image, load_rows


class Boxes(Task):
    """Grounding rows (image, question, box in original pixels) from data.path."""

    name = "boxes-fixture"
    uses_boxes = True

    def __init__(self):
        super().__init__()
        self.reward_functions = {"accuracy": lambda completion, row: iou_reward(completion, row["box"])}

    def load(self, split):
        rows = load_rows(None, split, path=self.data_path)
        return RowView(rows, lambda index, row: {**row, "id": str(index)})

    def messages(self, row):
        image = load_image(row["image"], image_root=self.image_root)
        return [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": row["question"]}]}]
'''


def test_nan_and_inverted_target_boxes_are_bad_rows(tmp_path, capsys):
    Image.new("RGB", (16, 16)).save(tmp_path / "a.png")
    (tmp_path / "boxes.py").write_text(BOX_TASK)
    boxes = [[1.0, 1.0, 9.0, 9.0], [math.nan, 1.0, 9.0, 9.0], [9.0, 1.0, 1.0, 9.0], [1.0, 9.0, 9.0, 9.0],
             [1.0, 1.0, math.inf, 9.0], None]
    datasets.Dataset.from_dict({"image": ["a.png"] * 6, "question": ["where?"] * 6, "box": boxes}).to_parquet(
        str(tmp_path / "train.parquet"))
    args = [f"task={tmp_path / 'boxes.py'}:Boxes", f"data.path={tmp_path / 'train.parquet'}",
            f"data.image_root={tmp_path}", "data.max_bad_fraction=0.9"]
    assert validate_data.main(args) == 0
    out = capsys.readouterr().out
    assert "6 seen, 4 bad" in out and any(line.split() == ["bad", "box", "4"] for line in out.splitlines())
    assert "row 1: bad box: row '1' has the box [nan, 1.0, 9.0, 9.0]" in out


class ListTask:
    """Rows are ints; odd ones are bad."""

    def check_row(self, row):
        if row % 2:
            raise BadRow("odd", f"row {row} is odd.")

    def messages(self, row):
        return [{"role": "user", "content": [{"type": "text", "text": str(row)}]}]


def test_the_stream_refills_a_batch_with_good_rows_the_same_way_on_every_process():
    rows = list(range(40))
    single = PromptStream(rows, seed=2, warn=lambda _: None)
    batches = [[p.index for p in single.next_prompts(6, ListTask())] for _ in range(3)]
    assert all(len(b) == 6 and all(i % 2 == 0 for i in b) for b in batches)
    flat = [i for b in batches for i in b]
    assert len(set(flat)) == 18  # no good row twice within the epoch (20 good rows)
    assert single.bad.seen == single.position and single.bad.bad == single.position - 18
    assert single.bad.metrics() == {"rows_seen": single.position, "bad_rows": single.bad.bad,
                                    "bad_rows/odd": single.bad.bad}
    shards = [PromptStream(rows, seed=2, rank=r, world_size=2, warn=lambda _: None) for r in range(2)]
    local = [[p.index for p in s.next_prompts(6, ListTask())] for s in shards]
    assert sorted(local[0] + local[1]) == sorted(batches[0]) and len(local[0]) == len(local[1]) == 3

    resumed = PromptStream(rows, seed=2, warn=lambda _: None)
    resumed.load_state_dict(json.loads(json.dumps(single.state_dict())))
    assert resumed.bad.metrics() == single.bad.metrics()
    assert [p.index for p in resumed.next_prompts(2, ListTask())] == \
        [p.index for p in single.next_prompts(2, ListTask())]


def test_the_stop_rule_tolerates_early_bad_rows_and_stops_a_split_that_is_all_bad():
    stream = PromptStream(list(range(1000)), seed=0, max_bad_fraction=0.05, warn=lambda _: None)

    class FirstBad(ListTask):
        def check_row(self, row):
            if row == stream._order[0]:
                raise BadRow("first", "the very first row is bad.")

    assert len(stream.next_prompts(8, FirstBad())) == 8  # 1 bad of 9 seen: judged over 100 rows, not 11%
    everything = PromptStream(list(range(1000)), seed=0, max_bad_fraction=0.05, warn=lambda _: None)

    class AllBad(ListTask):
        def check_row(self, row):
            raise BadRow("odd", f"row {row} is bad.")

    with pytest.raises(UserError, match=r"^6 of 6 rows seen are bad \(100.0%\)"):
        everything.next_prompts(8, AllBad())


# shapes with enough tokens for the tiny model to answer, so that every step has groups to update on
SHAPES = ["trainer.eval_before=false", "trainer.eval_after=false", "trainer.batch_size=4", "trainer.group_size=4",
          "rollout.max_new_tokens=24"]
TRAIN = ["trainer.eval_before=false", "trainer.eval_after=false", "trainer.batch_size=4", "trainer.group_size=2",
         "rollout.max_new_tokens=8", "trainer.beta_th=0"]


def test_a_run_skips_and_counts_bad_rows_and_goes_on(tmp_path, monkeypatch):
    file = write_geoqa_fixture(tmp_path / "data")
    from gpg_vl.models import qwen as base  # the Qwen families (models.load no longer re-exports them)

    encoded = []
    original = base.QwenVLFamily.encode

    def spy(self, messages_batch, ids=None, tools=None):
        encoded.extend(ids or [])
        return original(self, messages_batch, ids, tools)

    monkeypatch.setattr(base.QwenVLFamily, "encode", spy)
    out = tmp_path / "run"
    train_main(load_config("train", [f"output_dir={out}", "task=geoqa", "model=tiny", f"data.path={file}",
                                      "data.max_bad_fraction=0.7", "trainer.max_steps=3", "trainer.epochs=null",
                                      "trainer.eval_before=true", "eval.limit=8", "eval.max_new_tokens=4", *TRAIN[1:]]))
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    last = lines[-1]
    assert last["bad_rows"] > 0 and last["rows_seen"] - last["bad_rows"] == 12  # 3 steps x 4 good prompts
    assert sum(v for k, v in last.items() if k.startswith("bad_rows/")) == last["bad_rows"]
    good_ids = {name for name in GOOD_IMAGES}
    assert set(encoded) <= good_ids  # only good rows reach the model (eval: 6 good of the first 8; train: 12)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data"]["bad_rows"] == last["bad_rows"] and summary["data"]["by_reason"]
    assert summary["eval_data"]["bad_rows"] == 2 and summary["eval_data"]["rows_seen"] == 8


def test_a_run_with_too_many_bad_rows_stops_with_one_sentence_naming_them(tmp_path):
    file = write_geoqa_fixture(tmp_path / "data", good_copies=3)
    out = tmp_path / "run"
    with pytest.raises(UserError) as stopped:
        train_main(load_config("train", [f"output_dir={out}", "task=geoqa", "model=tiny", f"data.path={file}",
                                          "trainer.max_steps=50", "trainer.epochs=null", *TRAIN]))
    message = str(stopped.value)
    assert "rows seen are bad" in message and "over data.max_bad_fraction=0.05; the first: row " in message
    assert "\n" not in message
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] == message and summary["data"]["bad_rows"] >= 1


def test_nan_losses_skip_the_step_and_too_many_in_a_row_stop_with_the_last_good_checkpoint_intact(tmp_path,
                                                                                                 monkeypatch):
    from gpg_vl.objective import POLICY_LOSSES

    real_loss = POLICY_LOSSES["gpg"]
    calls = {"n": 0}

    def loss_nan_after_two_steps(logps, *args, **kwargs):
        loss, info = real_loss(logps, *args, **kwargs)
        calls["n"] += 1
        return (loss * math.nan if calls["n"] > 2 else loss), info

    monkeypatch.setitem(POLICY_LOSSES._entries, "gpg", loss_nan_after_two_steps)  # the registered object, for this test
    out = tmp_path / "run"
    args = [f"output_dir={out}", "trainer.max_steps=8", "trainer.save_every=1", "trainer.max_bad_steps=3", *SHAPES]
    with pytest.raises(UserError) as stopped:
        train_main(load_config("train", args))
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5]
    assert [m.get("nonfinite", 0.0) for m in lines] == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert all(math.isnan(m["loss"]) for m in lines[2:]) and lines[-1]["nonfinite_steps"] == 3
    message = str(stopped.value)
    assert message.startswith("stopped at step 5: the last 3 steps had a NaN or infinite loss or gradient "
                              "(trainer.max_bad_steps=3)") and "checkpoint-2" in message and "\n" not in message
    assert latest_checkpoint(out) == out / "checkpoint-2" and not (out / "final").exists()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    from transformers import AutoModelForImageTextToText

    kept = AutoModelForImageTextToText.from_pretrained(out / "checkpoint-2").state_dict()
    assert all(torch.isfinite(v).all() for v in kept.values())
    assert json.loads((out / "summary.json").read_text())["stopped"] == message


def test_an_infinite_gradient_skips_the_step_without_touching_the_weights(tmp_path, monkeypatch, policy, shapes):
    from gpg_vl.config.schema import RolloutSettings, TrainerSettings
    from gpg_vl.train.loop import RunSettings, setup_policy, train

    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    first = next(p for p in policy.model.parameters() if p.requires_grad)
    first.register_hook(lambda grad: grad * math.inf)
    trainer = TrainerSettings(max_steps=2, group_size=4, batch_size=4, lr=1e-3, eval_before=False, eval_after=False,
                              max_bad_steps=5)
    train(setup_policy(policy, shapes, RunSettings(trainer, RolloutSettings(max_new_tokens=24), output_dir=tmp_path)))
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m.get("nonfinite") for m in lines] == [1.0, 1.0] and not math.isfinite(lines[0]["grad_norm"])
    assert all(torch.equal(p, before[n]) for n, p in policy.model.named_parameters())


# ---------------------------------------------------------------- bad data that used to pass

def said(answer):
    return f"<think> t </think><answer>{answer}</answer>"


def test_a_missing_null_or_nan_geoqa_target_is_a_bad_row_not_the_answer_nan(tmp_path):
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    lines = ['{"image_path": "a.png", "question": "q", "ground_truth": "140°"}',
             '{"image_path": "a.png", "question": "q", "ground_truth": NaN}',  # json's NaN: read as null
             '{"image_path": "a.png", "question": "q", "ground_truth": "nan"}',  # a float NaN written out
             '{"image_path": "a.png", "question": "q", "ground_truth": "-inf"}',
             '{"image_path": "a.png", "question": "q", "ground_truth": null}',
             '{"image_path": "a.png", "question": "q"}']  # no target at all
    (tmp_path / "test.jsonl").write_text("\n".join(lines) + "\n")
    task = geoqa(tmp_path / "test.jsonl")
    rows = task.load("test")
    assert reasons(task, rows) == {1: "missing column", 2: "non-finite answer", 3: "non-finite answer",
                                   4: "missing column", 5: "missing column"}
    # a float column (a pandas-made parquet) with NaN, and a train row whose answer tag holds nan
    (tmp_path / "floats").mkdir()
    floats = {"image_path": ["a.png"] * 2, "question": ["q"] * 2, "ground_truth": [140.0, math.nan]}
    datasets.Dataset.from_dict(floats).to_parquet(str(tmp_path / "floats" / "test.parquet"))
    task = get_task("geoqa", data_path=str(tmp_path / "floats"), image_root=str(tmp_path))
    assert reasons(task, task.load("test")) == {1: "non-finite answer"}
    datasets.Dataset.from_dict({"image": ["a.png"] * 2, "problem": ["q"] * 2,
                                "solution": ["<answer>5</answer>", "<answer>nan</answer>"]}).to_parquet(
        str(tmp_path / "train.parquet"))
    task = get_task("geoqa", data_path=str(tmp_path / "train.parquet"))
    assert reasons(task, task.load("train")) == {1: "non-finite answer"}
    # through the API, `<answer>nan</answer>` on a NaN row is refused, not scored 1 (the reward hack)
    with pytest.raises(BadRow, match="NaN or infinite") as refused:
        task.reward(said("nan"), {"image_path": "a.png", "question": "q", "ground_truth": "nan"})
    assert refused.value.reason == "non-finite answer"
    assert task.reward(said("nan"), {"image_path": "a.png", "question": "q", "ground_truth": "5"}) == 1.0  # format


def test_a_reasonseg_mask_with_nan_outside_the_object_is_a_bad_row_not_a_whole_image_box(tmp_path):
    Image.new("RGB", LISA_SIZE, (0, 90, 0)).save(tmp_path / "scene.png")
    width, height = LISA_SIZE
    good = np.zeros((height, width))
    good[1:4, 1:5] = 1.0
    outside_nan = np.where(good > 0, 1.0, math.nan)  # was read as the object everywhere: box (0, 0, 8, 6)
    with_inf = good.copy()
    with_inf[0, 0] = math.inf
    masks = [good.tolist(), outside_nan.tolist(), with_inf.tolist()]
    datasets.Dataset.from_dict({"image": ["scene.png"] * 3, "text": ["the green part"] * 3, "mask": masks,
                                "img_height": [height] * 3, "img_width": [width] * 3}).to_parquet(
        str(tmp_path / "train.parquet"))
    task = get_task("lisa", data_path=str(tmp_path))
    rows = task.load("train")
    assert reasons(task, rows) == {1: "bad mask", 2: "bad mask"}
    assert prepare_prompt(task, rows, 0).row["box"] == (1.0, 1.0, 5.0, 4.0)
    with pytest.raises(BadRow, match="not finite"):  # a published row through the API
        task.reward(said("(1,1),(5,4)"), {"image": "scene.png", "text": "the green part", "mask": outside_nan})
    with pytest.raises(BadRow, match="not finite"):  # a float ("F") PIL image mask too
        gpg_vl_tasks.lisa.mask_rle(Image.fromarray(outside_nan.astype(np.float32), mode="F"))


def test_image_paths_outside_the_image_root_are_bad_rows_unless_allowed(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (8, 8)).save(data / "in.png")
    Image.new("RGB", (8, 8)).save(tmp_path / "outside.png")  # exists, beside the data folder
    (data / "linked").symlink_to(tmp_path, target_is_directory=True)  # a link the user made under the root
    paths = ["in.png", "../outside.png", "../../../../../../etc/passwd", str(tmp_path / "outside.png"), "/etc/hostname",
             "linked/outside.png", "~/x.png"]
    (data / "test.jsonl").write_text("".join(json.dumps({"image_path": path, "question": "q", "ground_truth": "1"})
                                             + "\n" for path in paths))
    outside = "image path outside the image root"
    task = geoqa(data / "test.jsonl")  # no data.image_root: the data file's folder is the root
    assert reasons(task, task.load("test")) == {1: outside, 2: outside, 3: outside, 4: outside, 6: outside}
    task = get_task("geoqa", data_path=str(data / "test.jsonl"), image_root=str(tmp_path))  # a wider root
    assert reasons(task, task.load("test")) == {0: "missing image file", 1: outside, 2: outside, 4: outside,
                                                5: "missing image file", 6: outside}
    trusted = get_task("geoqa", data_path=str(data / "test.jsonl"), allow_outside_paths=True)
    found = reasons(trusted, trusted.load("test"))
    assert outside not in found.values() and 1 not in found and 3 not in found  # the outside image loads
    # the config key, through scripts/validate_data.py
    args = ["task=geoqa", f"data.path={data / 'test.jsonl'}", "split=test", "data.max_bad_fraction=1"]
    assert validate_data.main(args) == 0
    assert any(line.split() == [*outside.split(), "5"] for line in capsys.readouterr().out.splitlines())
    assert validate_data.main([*args, "data.allow_outside_paths=true"]) == 0
    assert outside not in capsys.readouterr().out


def test_an_empty_jsonl_fails_saying_which_file_is_empty(tmp_path, capsys):
    (tmp_path / "test.jsonl").write_text("")
    with pytest.raises(UserError, match=r"data file '.*test\.jsonl' is empty \(no rows\)") as empty:
        geoqa(tmp_path / "test.jsonl").load("test")
    assert "StopIteration" not in str(empty.value)
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    with pytest.raises(UserError, match=r"blank\.jsonl' is empty"):
        geoqa(tmp_path / "blank.jsonl").load("test")
    assert validate_data.main(["task=geoqa", f"data.path={tmp_path / 'test.jsonl'}", "split=test"]) == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith("error: data file ") and "test.jsonl' is empty" in message
    # a split of several files: the empty ones are left out; all of them empty fails naming the folder
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "test-00000-of-00002.jsonl").write_text("")
    (shards / "test-00001-of-00002.jsonl").write_text("")
    with pytest.raises(UserError, match=r"all 2 data files of the split under .*shards' are empty"):
        geoqa(shards).load("test")
    Image.new("RGB", (8, 8)).save(shards / "a.png")
    row = {"image_path": "a.png", "question": "q", "ground_truth": "1"}
    (shards / "test-00001-of-00002.jsonl").write_text(json.dumps(row) + "\n")
    assert len(geoqa(shards).load("test")) == 1
    # a parquet file with the columns but no rows
    datasets.Dataset.from_dict({"image_path": [], "question": [], "ground_truth": []}).to_parquet(
        str(tmp_path / "none.parquet"))
    with pytest.raises(UserError, match=r"none\.parquet' is empty \(no rows\)"):
        geoqa(tmp_path / "none.parquet").load("test")
    # pandas' empty frame, and a table without columns: the same sentence, not "could not read"
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    pd.DataFrame({"question": ["q"]}).iloc[:0].to_parquet(tmp_path / "frame.parquet")
    pq.write_table(pa.table({}), tmp_path / "columns.parquet")
    for name in ("frame", "columns"):
        with pytest.raises(UserError, match=rf"{name}\.parquet' is empty \(no rows\)"):
            geoqa(tmp_path / f"{name}.parquet").load("test")
