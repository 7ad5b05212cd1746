"""The classification and lisa tasks on fixtures written here in the published schemas; nothing is downloaded.

Fixtures load through the same path as the Hub copies: `datasets` reading a parquet file or a save_to_disk folder.
"""

import json

import datasets
import gpg_vl_tasks.classification  # noqa: F401  (importing registers the tasks)
import gpg_vl_tasks.lisa  # noqa: F401
import numpy as np
import pytest
from gpg_vl_tasks.lisa import mask_box
from helpers.task_fixtures import BOX, HEIGHT, WIDTH, array_mask, reasonseg
from PIL import Image
from pycocotools import mask as mask_utils

from gpg_vl import get_task
from gpg_vl.cli import eval_main
from gpg_vl.config.compose import load_config
from gpg_vl.errors import UserError

THINK = "<think> looking </think>"
CLASSES = {"pink primrose": (230, 120, 170), "sunflower": (240, 200, 20), "english marigold": (240, 130, 20)}
PROBLEM = ("This is an image containing a plant. Please identify the species of the plant based on the image.\n"
           "Output the thinking process in <think> </think> and final answer in <answer> </answer> tags.")



@pytest.fixture(autouse=True)
def datasets_cache(tmp_path_factory, monkeypatch):
    """Keep the arrow cache that `load_dataset` writes for local files out of the home folder."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-datasets-cache")))


@pytest.fixture()
def cls_data(tmp_path):
    """Six rows, two per class, as in laolao77/ViRFT_CLS_*: image, problem, solution ("<answer>name</answer>")."""
    names = [name for name in CLASSES for _ in range(2)]
    rows = datasets.Dataset.from_dict(
        {"image": [Image.new("RGB", (40, 40), CLASSES[n]) for n in names], "problem": [PROBLEM] * len(names),
         "solution": [f"<answer>{n}</answer>" for n in names]},
        features=datasets.Features({"image": datasets.Image(), "problem": datasets.Value("string"),
                                    "solution": datasets.Value("string")}))
    path = tmp_path / "flower.parquet"
    rows.to_parquet(str(path))
    return path


@pytest.fixture()
def lisa_array(tmp_path):
    """Parquet, mask as a 2-D bool array: rows 0-2 hold an object (row 0: BOX; 1 and 2: elsewhere), row 3 none."""
    boxes = [BOX, (0.0, 0.0, 16.0, 16.0), (40.0, 24.0, 64.0, 48.0), None]
    path = tmp_path / "reasonseg_array.parquet"
    reasonseg([array_mask(b).tolist() for b in boxes], boxes).to_parquet(str(path))
    return path


@pytest.fixture()
def lisa_rle(tmp_path):
    """save_to_disk folder (DatasetDict, split test), mask as compressed COCO RLE of BOX's rectangle."""
    rle = mask_utils.encode(np.asfortranarray(array_mask().astype(np.uint8)))
    rows = reasonseg([{"size": [HEIGHT, WIDTH], "counts": rle["counts"].decode()}], [BOX])
    path = tmp_path / "reasonseg_rle"
    datasets.DatasetDict({"test": rows}).save_to_disk(str(path))
    return path


@pytest.fixture()
def lisa_polygons(tmp_path):
    """Parquet, mask as polygons: row 0 the corners of BOX's rectangle; row 1 two squares (a two-part object)."""
    masks = [[[10, 8, 30, 8, 30, 20, 10, 20]], [[2, 2, 6, 2, 6, 6, 2, 6], [50, 30, 60, 30, 60, 40, 50, 40]]]
    path = tmp_path / "reasonseg_polygons.parquet"
    reasonseg([[[float(v) for v in p] for p in m] for m in masks], [BOX, None]).to_parquet(str(path))
    return path


def lisa_task(path, **options):
    return get_task("lisa", data_path=str(path), **options)


def answer(text):
    return f"{THINK}\n<answer>{text}</answer>"


# ---------------------------------------------------------------- classification

def test_classification_rows_label_prompt_and_rewards(cls_data):
    task = get_task("classification", data_path=str(cls_data))
    rows = task.load(task.eval_split)
    assert task.eval_split == "validation" and len(rows) == 6 and len(rows[:4]) == 4
    row = rows[2]
    assert row["answer"] == "sunflower" and task.target(row) == "sunflower" and row["id"] == "2"
    content = task.messages(row)[0]["content"]
    assert isinstance(content[0]["image"], Image.Image) and content[0]["image"].size == (40, 40)
    assert content[1]["text"] == ("This is an image containing a plant. Please identify the species of the plant "
                                  "based on the image. Output the thinking process in <think> </think> and final "
                                  "answer in <answer> </answer> tags.")
    assert task.reward_components(answer("Sunflower."), row) == {"accuracy": 1.0, "format": 1.0}
    assert task.reward(answer("Sunflower."), row) == 2.0
    assert task.reward_components(answer("pink primrose"), row)["accuracy"] == 0.0  # wrong class
    for empty in (answer(""), answer("  "), "<answer></answer>"):  # the public reward scores these 1: never here
        assert task.reward_components(empty, row)["accuracy"] == 0.0
    assert task.reward_components("sunflower", row) == {"accuracy": 0.0, "format": 0.0}  # no tags
    metrics = task.metrics(rows[:3], [answer("pink primrose"), answer("Pink-Primrose"), answer("")])
    assert metrics["accuracy"] == pytest.approx(2 / 3) and metrics["reward/format"] == 1.0


def test_classification_options_synonyms_prompts_and_unknown_dataset(cls_data):
    task = get_task("classification", data_path=str(cls_data), dataset="aircraft", prompt="problem",
                    synonyms={"Sunflower": ["helianthus annuus"]})
    row = task.load("train")[3]
    assert task.reward_components(answer("Helianthus annuus"), row)["accuracy"] == 1.0
    assert task.messages(row)[0]["content"][1]["text"] == PROBLEM
    assert get_task("classification", dataset="pets37").messages(row)[0]["content"][1]["text"].startswith(
        "This is an image containing a pet. Please identify the breed of the pet based on the image.")
    with pytest.raises(UserError) as error:
        get_task("classification", dataset="birds")
    assert all(name in str(error.value) for name in ("flower", "pets37", "aircraft", "cars196"))


# ---------------------------------------------------------------- lisa

def test_lisa_mask_formats_give_the_same_box(lisa_array, lisa_rle, lisa_polygons):
    array_rows = lisa_task(lisa_array).load("test")
    rle_rows = lisa_task(lisa_rle).load("test")
    polygon_rows = lisa_task(lisa_polygons).load("test")
    assert array_rows[0]["box"] == rle_rows[0]["box"] == polygon_rows[0]["box"] == BOX
    assert [r["box"] for r in array_rows] == [BOX, (0.0, 0.0, 16.0, 16.0), (40.0, 24.0, 64.0, 48.0), None]
    assert polygon_rows[1]["box"] == (2.0, 2.0, 60.0, 40.0)  # around both parts
    row = array_rows[0]
    assert "mask" not in row and row["id"] == "img0:0" and lisa_task(lisa_array).target(row) == "[10, 8, 30, 20]"
    assert lisa_task(lisa_array).target(array_rows[3]) == "none"
    # the same helper on in-memory forms: numpy 0/1, uncompressed RLE, one flat polygon, a PIL mask
    uncompressed = mask_utils.frPyObjects(  # run lengths in column-major order, built from the bool array
        {"size": [HEIGHT, WIDTH], "counts": _runs(array_mask())}, HEIGHT, WIDTH)
    assert mask_utils.toBbox(uncompressed).tolist() == [10, 8, 20, 12]
    assert mask_box({"size": [HEIGHT, WIDTH], "counts": _runs(array_mask())}) == BOX
    assert mask_box(array_mask().astype(np.uint8)) == BOX
    assert mask_box([10, 8, 30, 8, 30, 20, 10, 20], HEIGHT, WIDTH) == BOX
    assert mask_box(Image.fromarray(array_mask())) == BOX
    assert mask_box(np.zeros((4, 5), dtype=bool)) is None
    with pytest.raises(UserError, match="img_height"):
        mask_box([[10, 8, 30, 8, 30, 20]])


def _runs(mask):
    flat = mask.flatten(order="F").astype(int)
    changes = np.flatnonzero(np.diff(np.concatenate([[0], flat, [1 - flat[-1]]])))
    return np.diff(np.concatenate([[0], changes])).tolist()


def test_lisa_prompt_rewards_and_miou(lisa_array):
    task = lisa_task(lisa_array)
    rows = task.load("test")
    assert task.uses_boxes and task.eval_split == "test"
    text = task.messages(rows[0])[0]["content"][1]["text"]
    assert text == ("Output the bounding box in the image corresponding to the instruction: the thing a cook "
                    "would stir with, 0 Output the thinking process in <think> </think> and your grounding box. "
                    'Following "<think> thinking process </think>\n<answer>(x1,y1),(x2,y2)</answer>" format.')
    exact, half = answer("(10,8),(30,20)"), answer("[20, 8, 40, 20]")
    assert task.reward_components(exact, rows[0]) == {"accuracy": 1.0, "format": 1.0}
    assert task.reward(exact, rows[0]) == 2.0
    # half: intersection x 20..30 by y 8..20 = 10 * 12 = 120; union 240 + 240 - 120 = 360; IoU 1/3
    assert task.reward_components(half, rows[0])["accuracy"] == pytest.approx(1 / 3)
    assert task.reward_components(exact, rows[3]) == {"accuracy": 0.0, "format": 1.0}  # empty mask: no target
    assert task.reward_components("(10,8),(30,20)", rows[0]) == {"accuracy": 0.0, "format": 0.0}

    # miou over rows 0-2 (row 3 has no target): exact 1, half 1/3, unparsable 0 -> 4/9
    completions = [exact, answer("[8, 0, 24, 16]"), answer("somewhere"), exact]
    metrics = task.metrics(rows[:4], completions)
    # row 1: target (0,0,16,16) vs (8,0,24,16): 8*16 = 128 / (256 + 256 - 128) = 1/3; so (1 + 1/3 + 0) / 3
    assert metrics["miou"] == pytest.approx(4 / 9)
    assert metrics["reward/accuracy"] == pytest.approx((1 + 1 / 3) / 4) and metrics["reward/format"] == 1.0


def test_lisa_giou_option_and_unknown_reward(lisa_array):
    task = lisa_task(lisa_array, reward="giou")
    row = task.load("test")[0]
    assert task.reward_components(answer("(10,8),(30,20)"), row)["accuracy"] == 2.0
    # (20,14,40,26): intersection 10 * 6 = 60; union 240 + 240 - 60 = 420; enclosing (10,8,40,26) = 30 * 18 = 540
    # GIoU = 60/420 - (540 - 420)/540 = 1/7 - 2/9 = -5/63; reward GIoU + 1 = 58/63
    assert task.reward_components(answer("[20, 14, 40, 26]"), row)["accuracy"] == pytest.approx(58 / 63)
    assert task.reward_components(answer("no box"), row)["accuracy"] == 0.0
    with pytest.raises(UserError, match="iou, giou"):
        get_task("lisa", reward="dice")


def test_lisa_train_split_needs_data_path():
    with pytest.raises(UserError) as error:
        get_task("lisa").load("train")
    message = str(error.value)
    assert "data.path" in message and message.count(". ") == 0 and "\n" not in message


# ---------------------------------------------------------------- configs and eval on the tiny model

@pytest.mark.parametrize("name", ["classification", "lisa"])
def test_task_configs_compose_with_the_papers_settings(name):
    for config in ("train", "eval"):
        for overrides in ([f"task={name}"], [f"+experiment={name}-paper"]):
            cfg = load_config(config, overrides)
            assert cfg.task.name == name
            assert cfg.trainer.group_size == 8 and cfg.trainer.lr == 1e-6 and cfg.trainer.beta_th == 0.4
            assert cfg.rollout.max_new_tokens == 256 and cfg.rollout.temperature == 1.0
            assert cfg.eval.max_new_tokens == (256 if name == "classification" else 128)
        # the task alone keeps the model (tiny by default); the paper's recipe sets the paper's model
        assert load_config(config, [f"task={name}"]).model.name_or_path == "embedded:tiny-qwen2.5-vl"
        assert load_config(config, [f"+experiment={name}-paper"]).model.name_or_path == "Qwen/Qwen2-VL-2B-Instruct"
    assert load_config("eval", [f"task={name}", "model=tiny"]).model.name_or_path == "embedded:tiny-qwen2.5-vl"


@pytest.mark.parametrize("name,fixture,split,metric", [
    ("classification", "cls_data", "validation", "accuracy"), ("lisa", "lisa_array", "test", "miou")])
def test_eval_on_the_tiny_model_writes_predictions_and_metrics(name, fixture, split, metric, request, tmp_path):
    path = request.getfixturevalue(fixture)
    cfg = load_config("eval", [f"task={name}", "model=tiny", f"data.path={path}", "eval.limit=4",
                               "eval.batch_size=4", "eval.max_new_tokens=8", f"output_dir={tmp_path / 'out'}",
                               f"eval.split={split}", "segmenter=box"])
    metrics = eval_main(cfg)
    records = [json.loads(line) for line in (tmp_path / "out" / "predictions.jsonl").read_text().splitlines()]
    assert len(records) == 4 and metric in json.loads((tmp_path / "out" / "metrics.json").read_text())
    # measured: in 8 new tokens the tiny model closes no <answer>: no row is answered, none scored
    assert metrics[metric] == 0.0 and metrics["answered"] == 0.0
    if name == "lisa":
        assert [r["target"] for r in records] == ["[10, 8, 30, 20]", "[0, 0, 16, 16]", "[40, 24, 64, 48]", "none"]
        # segmenter=box, no box predicted: every mask is empty; the row without a target (empty mask, empty
        # prediction) is a match (gIoU 1 for it, 0 for the three others); no pixel intersects (cIoU 0)
        assert (metrics["mask_giou"], metrics["mask_ciou"]) == (0.25, 0.0)
    rescored = eval_main(load_config("eval", [f"task={name}", f"data.path={path}", f"eval.split={split}",
                                              f"predictions={tmp_path / 'out' / 'predictions.jsonl'}",
                                              f"output_dir={tmp_path / 'again'}", "segmenter=box"]))
    assert rescored == metrics  # row ids match, so saved completions re-score without a model
