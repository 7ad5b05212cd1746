"""`task.reward(completion, row)` takes the dataset's PUBLISHED row (its columns as `datasets` yields them) and
scores it exactly as the row the task's loader prepared, for every built-in task and each split's schema.

The published rows are read back through `datasets` (`gpg_vl.data.sources.load_rows`, which is `datasets.load_dataset`
/ `load_from_disk` on a local copy), the prepared rows through `task.load`. Nothing is downloaded.
"""

import json

import datasets
import gpg_vl_tasks.lisa
import numpy as np
import pytest
from PIL import Image

from gpg_vl import get_task
from gpg_vl.data.sources import load_rows

THINK = "<think> looking </think>"


def said(text):
    return f"{THINK}<answer>{text}</answer>"


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-datasets-cache")))


def picture(size=(48, 40), colour=(200, 40, 40)):
    return Image.new("RGB", size, colour)


def published_and_prepared(task, path, split):
    """(the published rows, the rows the task's loader prepared), same split, same order."""
    return list(load_rows(None, split, path=path)), list(task.load(split))


def assert_scores_alike(task, published, prepared, right, wrong):
    """The right completion scores full accuracy and the wrong one 0, on the published row as on the prepared row."""
    for completion, accuracy in ((right, 1.0), (wrong, 0.0)):
        from_published = task.reward_components(completion, published)
        assert from_published == task.reward_components(completion, prepared)
        assert from_published["accuracy"] == pytest.approx(accuracy)
        assert task.reward(completion, published) == task.reward(completion, prepared)
    assert task.target(published) == task.target(prepared)
    assert task.metrics([published, published], [right, wrong]) == task.metrics([prepared, prepared], [right, wrong])
    assert not task.reward_errors  # no reward raised on a published row (a missing key would be counted here)


# ---------------------------------------------------------------- geoqa

def test_geoqa_test_jsonl_row_scores_as_prepared(tmp_path):
    (tmp_path / "Geo170K" / "images" / "test").mkdir(parents=True)
    rows = [("Find x.", "2√{3}"), ("Find the arc.", "4πcm"), ("Find the area.", "27cm^{2}")]
    lines = []
    for i, (question, truth) in enumerate(rows):
        picture().save(tmp_path / "Geo170K" / "images" / "test" / f"{i}.png")
        lines.append(json.dumps({"image_path": f"./Geo170K/images/test/{i}.png", "question": question,
                                 "ground_truth": truth}, ensure_ascii=False))
    path = tmp_path / "geoqa_test.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    task = get_task("geoqa", data_path=path)
    published, prepared = published_and_prepared(task, path, "test")
    assert set(published[0]) == {"image_path", "question", "ground_truth"}
    for pub, prep, (right, wrong) in zip(published, prepared, [("2\\sqrt{3}", "2"), ("4\\pi", "4"), ("27", "28")],
                                         strict=True):
        assert_scores_alike(task, pub, prep, said(right), said(wrong))


def test_geoqa_train_row_scores_as_prepared(tmp_path):
    features = datasets.Features({"image": datasets.Image(), "problem": datasets.Value("string"),
                                  "solution": datasets.Value("string")})
    datasets.Dataset.from_dict({"image": [picture(), picture()], "problem": ["Find AC.", "Find the angle."],
                                "solution": ["<answer>5</answer>", "<answer>140°</answer>"]},
                               features=features).to_parquet(str(tmp_path / "train.parquet"))
    task = get_task("geoqa", data_path=tmp_path)
    published, prepared = published_and_prepared(task, tmp_path, "train")
    assert set(published[0]) == {"image", "problem", "solution"}
    assert_scores_alike(task, published[0], prepared[0], said("5"), said("6"))
    assert_scores_alike(task, published[1], prepared[1], said("140"), said("40"))


# ---------------------------------------------------------------- classification

@pytest.mark.parametrize("prompt", ["evaluation", "problem"])
def test_virft_row_scores_as_prepared(tmp_path, prompt):
    features = datasets.Features({"image": datasets.Image(), "problem": datasets.Value("string"),
                                  "solution": datasets.Value("string")})
    datasets.Dataset.from_dict({"image": [picture()], "problem": ["Identify the species."],
                                "solution": ["<answer>pink primrose</answer>"]},
                               features=features).to_parquet(str(tmp_path / "flower.parquet"))
    path = tmp_path / "flower.parquet"
    task = get_task("classification", data_path=str(path), prompt=prompt,
                    synonyms={"pink primrose": ["evening primrose"]})
    (published,), (prepared,) = published_and_prepared(task, path, "validation")
    assert set(published) == {"image", "problem", "solution"}
    assert_scores_alike(task, published, prepared, said("Pink Primrose"), said("primrose"))
    assert task.reward_components(said("evening primrose"), published)["accuracy"] == 1.0  # the option's synonym


# ---------------------------------------------------------------- cvbench: SAT and CV-Bench rows are tested with the
# task's own fixtures, in test_task_cvbench_geoqa.py (test_published_sat_and_cv_bench_rows_score_as_prepared)


# ---------------------------------------------------------------- lisa (ReasonSeg)

WIDTH, HEIGHT = 64, 48
BOX = (10.0, 8.0, 30.0, 20.0)


def reasonseg_parquet(path, mask):
    """One ReasonSeg row as the Hub copies publish it: a 2-D bool mask, image_id, ann_id, img_height, img_width."""
    datasets.Dataset.from_dict({
        "image": [picture((WIDTH, HEIGHT))], "text": ["the thing a cook would stir with"], "mask": [mask],
        "image_id": ["img0"], "ann_id": [0], "img_height": [HEIGHT], "img_width": [WIDTH],
    }).to_parquet(str(path))
    return path


def box_mask():
    mask = np.zeros((HEIGHT, WIDTH), dtype=bool)
    mask[8:20, 10:30] = True
    return mask.tolist()


@pytest.mark.parametrize("options", [{}, {"reward": "giou"}, {"answer": "box_points"}])
def test_reasonseg_row_scores_as_prepared(tmp_path, options):
    path = reasonseg_parquet(tmp_path / "reasonseg.parquet", box_mask())
    task = get_task("lisa", data_path=str(path), **options)
    (published,), (prepared,) = published_and_prepared(task, path, "test")
    assert {"image", "text", "mask", "img_height", "img_width"} <= set(published) and "box" not in published
    if options.get("answer") == "box_points":
        right, wrong = ('[{"bbox_2d": [10, 8, 30, 20], "point_2d": [15, 10]}]',
                        '[{"bbox_2d": [40, 30, 60, 46], "point_2d": [50, 40]}]')
        assert task.reward_components(said(right), published)["point"] == 1.0
    else:
        right, wrong = "(10,8),(30,20)", "(40,30),(60,46)"
    # the wrong box misses: IoU 0; GIoU + 1 = 1 - (enclosing 50 x 38 - union 240 + 320) / enclosing
    accuracy = {"giou": (2.0, 1 - 1340 / 1900)}.get(options.get("reward"), (1.0, 0.0))
    for completion, expected in zip((said(right), said(wrong)), accuracy, strict=True):
        scores = task.reward_components(completion, published)
        assert scores == task.reward_components(completion, prepared)
        assert scores["accuracy"] == pytest.approx(expected, abs=1e-12)
    assert task.target(published) == task.target(prepared) == "[10, 8, 30, 20]"
    completions = [said(right), said(wrong)]
    assert task.metrics([published, published], completions) == task.metrics([prepared, prepared], completions)
    assert not task.reward_errors


def test_a_published_reasonseg_row_decodes_its_mask_once_for_g_completions(tmp_path, monkeypatch):
    path = reasonseg_parquet(tmp_path / "reasonseg.parquet", box_mask())
    task = get_task("lisa", data_path=str(path))
    (published,) = load_rows(None, "test", path=path)
    decoded = []
    real = gpg_vl_tasks.lisa.mask_rle
    monkeypatch.setattr(gpg_vl_tasks.lisa, "mask_rle",
                        lambda mask, *size: decoded.append(type(mask)) or real(mask, *size))
    group = [said(f"(10,8),({30 - k},20)") for k in range(8)]  # G = 8 completions of one row
    scores = [task.reward(completion, published) for completion in group]
    assert scores[0] == 2.0 and scores[-1] < scores[0]
    assert decoded == [list]  # the published mask (nested lists) was decoded once, not once per completion
    assert task.metrics([published] * 8, group)["accuracy"] == pytest.approx(sum(s - 1.0 for s in scores) / 8)
    assert decoded.count(list) == 1  # metrics over the same row object reuse it too (the compressed RLE it made
    # may be read again: that is no decode)
