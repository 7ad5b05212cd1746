"""`+experiment=paper-mix` (CV-Bench, GeoQA, classification and LISA grounding in one run) at fixture scale on the tiny
model: the recipe composes with the paper's settings, each task reads its own fixture (the published schemas, the
fixtures of test_task_cvbench_geoqa.py and test_task_classification_lisa.py), and two steps train on all four."""

import json

import datasets
import pytest
from helpers.task_fixtures import GEO_TRAIN, array_mask, picture, reasonseg, sat_parquet

from gpg_vl.cli import train_main
from gpg_vl.config.compose import load_config
from gpg_vl.train.build import build_task

TASKS = ("cvbench", "geoqa", "classification", "lisa")


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-datasets-cache")))


def fixtures(folder):
    """Each task's train split in its published layout: SAT parquet, GeoQA parquet, ViRFT flowers, ReasonSeg."""
    (folder / "cvbench").mkdir()
    sat_parquet(folder / "cvbench" / "train.parquet")
    (folder / "geoqa").mkdir()
    features = datasets.Features({"image": datasets.Image(), "problem": datasets.Value("string"),
                                  "solution": datasets.Value("string")})
    datasets.Dataset.from_dict({"image": [picture(i) for i in range(len(GEO_TRAIN))],
                                "problem": [p for p, _ in GEO_TRAIN], "solution": [s for _, s in GEO_TRAIN]},
                               features=features).to_parquet(str(folder / "geoqa" / "train.parquet"))
    names = ["sunflower", "pink primrose", "sunflower", "english marigold"]
    datasets.Dataset.from_dict({"image": [picture(i, (40, 40)) for i in range(4)], "problem": ["Which flower?"] * 4,
                                "solution": [f"<answer>{n}</answer>" for n in names]},
                               features=features).to_parquet(str(folder / "flower.parquet"))
    boxes = [(10.0, 8.0, 30.0, 20.0), (0.0, 0.0, 16.0, 16.0), (40.0, 24.0, 64.0, 48.0)]
    reasonseg([array_mask(b).tolist() for b in boxes], boxes).to_parquet(str(folder / "reasonseg.parquet"))
    return {"cvbench": folder / "cvbench", "geoqa": folder / "geoqa", "classification": folder / "flower.parquet",
            "lisa": folder / "reasonseg.parquet"}


def test_the_recipe_holds_the_papers_settings_for_each_task():
    cfg = load_config("train", ["+experiment=paper-mix"])
    assert cfg.model.name_or_path == "Qwen/Qwen2.5-VL-7B-Instruct" and dict(cfg.task.mixture) == dict.fromkeys(
        TASKS, 1)
    assert (cfg.trainer.group_size, cfg.trainer.lr, cfg.trainer.beta_th, cfg.rollout.temperature) == (8, 1e-6, 0.4, 1.0)
    mixture = build_task(cfg.task, cfg.data)
    assert {name: owned["max_new_tokens"] for name, owned in mixture.rollouts.items()} == {
        "cvbench": 700, "geoqa": 256, "classification": 256, "lisa": 256}
    assert {name: owned["max_new_tokens"] for name, owned in mixture.evals.items()} == {
        "cvbench": 1024, "geoqa": 1024, "classification": 256, "lisa": 128}


def test_the_paper_mix_trains_on_fixtures_with_the_tiny_model(tmp_path):
    paths = fixtures(tmp_path)
    overrides = ["+experiment=paper-mix", "model=tiny", f"output_dir={tmp_path / 'run'}", "trainer.max_steps=2",
                 "trainer.batch_size=8", "trainer.group_size=4", "trainer.eval_before=false",
                 "trainer.eval_after=false", "trainer.save_every=0", "trainer.lr=1e-4"]
    overrides += [f"task.data.{name}.path={path}" for name, path in paths.items()]
    overrides += [f"task.rollout.{name}.max_new_tokens=16" for name in TASKS]
    train_main(load_config("train", overrides))
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    drawn = {name: lines[-1][f"{name}/prompts_drawn"] for name in TASKS}
    assert sum(drawn.values()) == lines[-1]["data_position"] >= 16 and sum(1 for n in drawn.values() if n) >= 3
    assert "lisa/reward/iou" in lines[-1] or "lisa/reward/accuracy" in lines[-1]
