"""lisa's mask metrics end to end: predicted boxes -> segmenter masks -> ReasonSeg gIoU / cIoU (and box mIoU).

The fixture is written here in ReasonSeg's Hub schema (mask: a 2-D bool array); its metrics are worked out by hand
with the `box` segmenter. The `sam` and `sam2` segmenters run tiny random-weight models built from their configs
and saved locally; nothing is downloaded.
"""

import json

import datasets
import gpg_vl_tasks.lisa  # noqa: F401  (importing registers the task)
import numpy as np
import pytest
import torch
from gpg_vl_tasks.lisa import POINTS_PROMPT, mask_rle
from PIL import Image
from pycocotools import mask as mask_utils

from gpg_vl import get_task
from gpg_vl.cli import eval_main
from gpg_vl.config.compose import run_cli
from gpg_vl.errors import UserError
from gpg_vl.reward.segment import (
    BoxSegmenter,
    SamSegmenter,
    box_rle,
    clip_box,
    intersection_union,
    load_segmenter,
    mask_metrics,
)
from gpg_vl.train.eval.evaluate import rescore

WIDTH, HEIGHT = 64, 48
THINK = "<think> looking </think>"


def rect(x1, y1, x2, y2):
    mask = np.zeros((HEIGHT, WIDTH), dtype=bool)
    mask[y1:y2, x1:x2] = True
    return mask


# Row 0's object is an L: the rectangle x 10-30, y 8-20 (240 px) without its corner x 20-30, y 14-20 (60 px).
L_SHAPE = rect(10, 8, 30, 20) & ~rect(20, 14, 30, 20)
MASKS = [L_SHAPE, rect(0, 0, 16, 16), rect(40, 24, 64, 48), rect(0, 0, 0, 0), rect(0, 0, 0, 0), rect(50, 30, 64, 48)]
ANSWERS = ["(10,8),(30,20)", "[8, 0, 24, 16]", "somewhere", "nothing here", "[0, 0, 10, 10]", "[50, 30, 80, 60]"]
# By hand, per row: (intersection, union) of the filled predicted box with the ground-truth mask, in pixels.
#   0: box 20 x 12 = 240 px covers the whole L (180 px): I 180, U 240, IoU 3/4
#   1: gt 16 x 16 = 256, box 16 x 16 = 256, overlap x 8-16 = 8 x 16 = 128: I 128, U 384, IoU 1/3
#   2: no box -> empty mask; gt 24 x 24 = 576: I 0, U 576, IoU 0
#   3: no box, empty gt: U 0 -> IoU 1 (ReasonSeg's "no-object target"), nothing added to cIoU
#   4: box 10 x 10 = 100 px, empty gt: I 0, U 100, IoU 0
#   5: box clipped to the image (50, 30, 64, 48) = 14 x 18 = 252 = the gt: I 252, U 252, IoU 1
HAND_COUNTS = [(180, 240), (128, 384), (0, 576), (0, 0), (0, 100), (252, 252)]
HAND_GIOU = (3 / 4 + 1 / 3 + 0 + 1 + 0 + 1) / 6  # = 37/72
HAND_CIOU = (180 + 128 + 252) / (240 + 384 + 576 + 100 + 252)  # = 560/1552 = 35/97
# Box mIoU over the rows with a target box (0, 1, 2, 5): the L's box is (10, 8, 30, 20): 1, 1/3, 0, 1 (clipped)
HAND_MIOU = (1 + 1 / 3 + 0 + 1) / 4


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-datasets-cache")))


@pytest.fixture()
def reasonseg(tmp_path):
    """Six ReasonSeg rows (Hub schema) in a parquet file; each image shows its mask in red on grey."""
    images = []
    for mask in MASKS:
        pixels = np.full((HEIGHT, WIDTH, 3), 200, dtype=np.uint8)
        pixels[mask] = (220, 30, 30)
        images.append(Image.fromarray(pixels))
    rows = datasets.Dataset.from_dict({
        "image": images, "text": [f"the red thing {i}" for i in range(len(MASKS))],
        "mask": [m.tolist() for m in MASKS], "image_id": [f"img{i}" for i in range(len(MASKS))],
        "ann_id": [0] * len(MASKS), "img_height": [HEIGHT] * len(MASKS), "img_width": [WIDTH] * len(MASKS)})
    path = tmp_path / "reasonseg.parquet"
    rows.to_parquet(str(path))
    return path


def completions():
    return [f"{THINK}\n<answer>{a}</answer>" for a in ANSWERS]


def write_predictions(path, rows):
    with path.open("w") as handle:
        for index, (row, completion) in enumerate(zip(rows, completions(), strict=True)):
            record = {"index": index, "id": row["id"], "split": "test", "completion": completion}
            handle.write(json.dumps(record) + "\n")
    return path


def tiny_sam(directory):
    """A random-weight SamModel (52k parameters, 64 px input) and its processor, saved to `directory`."""
    from transformers import SamConfig, SamImageProcessor, SamModel, SamProcessor

    torch.manual_seed(0)
    config = SamConfig(
        vision_config={"hidden_size": 32, "output_channels": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": 64, "patch_size": 16, "window_size": 2, "global_attn_indexes": [1],
                       "num_pos_feats": 8, "mlp_dim": 32},
        prompt_encoder_config={"hidden_size": 16, "image_size": 64, "patch_size": 16, "mask_input_channels": 4},
        mask_decoder_config={"hidden_size": 16, "mlp_dim": 32, "num_attention_heads": 2, "iou_head_hidden_dim": 16})
    SamModel(config).save_pretrained(directory)
    SamProcessor(SamImageProcessor(size={"longest_edge": 64}, pad_size={"height": 64, "width": 64})).save_pretrained(
        directory)
    return directory


def tiny_sam2(directory):
    """A random-weight Sam2Model (118k parameters, 64 px input) and its processor, saved to `directory`."""
    from transformers import (
        Sam2Config,
        Sam2HieraDetConfig,
        Sam2ImageProcessor,
        Sam2Model,
        Sam2Processor,
        Sam2VisionConfig,
    )

    torch.manual_seed(0)
    backbone = Sam2HieraDetConfig(  # a global-attention block may not open a stage (its window would be 0)
        hidden_size=8, num_attention_heads=1, image_size=[64, 64], blocks_per_stage=[1, 1, 2, 1],
        embed_dim_per_stage=[8, 16, 32, 64], num_attention_heads_per_stage=[1, 1, 1, 1],
        window_size_per_stage=[4, 4, 4, 2], global_attention_blocks=[3],
        window_positional_embedding_background_size=[2, 2])
    vision = Sam2VisionConfig(backbone_config=backbone, backbone_channel_list=[64, 32, 16, 8],
                              backbone_feature_sizes=[[16, 16], [8, 8], [4, 4]], fpn_hidden_size=32)
    config = Sam2Config(
        vision_config=vision,
        prompt_encoder_config={"hidden_size": 32, "image_size": 64, "patch_size": 16, "mask_input_channels": 4},
        mask_decoder_config={"hidden_size": 32, "mlp_dim": 32, "num_attention_heads": 2, "iou_head_hidden_dim": 16})
    Sam2Model(config).save_pretrained(directory)
    processor = Sam2ImageProcessor(size={"height": 64, "width": 64}, mask_size={"height": 16, "width": 16})
    Sam2Processor(processor, target_size=64).save_pretrained(directory)
    return directory


@pytest.fixture()
def no_policy(monkeypatch):
    """Fail the test if anything tries to load the policy model."""
    def refuse(*args, **kwargs):
        raise AssertionError("the policy model was loaded")

    import gpg_vl.models.load
    import gpg_vl.train.build

    monkeypatch.setattr(gpg_vl.train.build, "load_policy", refuse)
    monkeypatch.setattr(gpg_vl.models.load, "load_policy", refuse)
    monkeypatch.setattr("transformers.AutoModelForImageTextToText.from_pretrained", refuse)


def cli(argv, capsys):
    code = run_cli("eval", eval_main, argv)
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------- pure functions

def test_mask_metrics_follow_reasonseg_by_hand():
    assert mask_metrics(HAND_COUNTS) == pytest.approx({"giou": 37 / 72, "ciou": 35 / 97})
    assert mask_metrics([(3, 4), (1, 4)]) == pytest.approx({"giou": (3 / 4 + 1 / 4) / 2, "ciou": 4 / 8})
    # gIoU weighs rows equally, cIoU weighs pixels: a big good row and a small bad one
    assert mask_metrics([(90, 100), (0, 10)]) == pytest.approx({"giou": 0.45, "ciou": 90 / 110})
    assert mask_metrics([(0, 0)]) == {"giou": 1.0, "ciou": 0.0}  # both empty: IoU 1, cIoU has no pixels
    assert mask_metrics([]) == {"giou": 0.0, "ciou": 0.0}


def test_filled_boxes_clipping_and_intersections():
    assert clip_box((50, 30, 80, 60), WIDTH, HEIGHT) == (50, 30, 64, 48)
    assert clip_box((-5, -5, 10, 10), WIDTH, HEIGHT) == (0, 0, 10, 10)
    assert clip_box((70, 0, 90, 10), WIDTH, HEIGHT) is None and clip_box(None, WIDTH, HEIGHT) is None
    assert clip_box((0, 0, float("inf"), 10), WIDTH, HEIGHT) is None
    filled = mask_utils.decode(box_rle((10, 8, 30, 20), HEIGHT, WIDTH)).astype(bool)
    assert filled.shape == (HEIGHT, WIDTH) and (filled == rect(10, 8, 30, 20)).all()
    assert mask_utils.area(box_rle((10.4, 8, 30.4, 20), HEIGHT, WIDTH)) == 240  # edges round to the nearest pixel
    assert mask_utils.area(box_rle((70, 0, 90, 10), HEIGHT, WIDTH)) == 0  # outside the image
    gt = mask_rle(L_SHAPE)
    assert intersection_union(box_rle((10, 8, 30, 20), HEIGHT, WIDTH), gt) == (180, 240)
    assert intersection_union(box_rle(None, HEIGHT, WIDTH), gt) == (0, 180)
    with pytest.raises(UserError, match="same size"):
        intersection_union(box_rle((0, 0, 4, 4), 10, 10), gt)


def test_ground_truth_mask_formats_give_the_same_metric():
    """Polygons, compressed and uncompressed RLE and 2-D arrays decode (pycocotools) to the same mask."""
    box = box_rle((8, 0, 24, 16), HEIGHT, WIDTH)
    compressed = mask_utils.encode(np.asfortranarray(rect(0, 0, 16, 16).astype(np.uint8)))
    flat = rect(0, 0, 16, 16).flatten(order="F").astype(int)  # column-major, as COCO counts run
    changes = np.flatnonzero(np.diff(np.concatenate([[0], flat, [1 - flat[-1]]])))
    runs = np.diff(np.concatenate([[0], changes]))  # starts with the run of 0s (empty here: pixel (0, 0) is set)
    forms = [rect(0, 0, 16, 16), rect(0, 0, 16, 16).astype(np.uint8).tolist(),
             {"size": [HEIGHT, WIDTH], "counts": compressed["counts"].decode()},
             {"size": [HEIGHT, WIDTH], "counts": runs.tolist()},  # uncompressed RLE
             [[0, 0, 16, 0, 16, 16, 0, 16]]]
    assert runs[0] == 0 and runs.sum() == HEIGHT * WIDTH
    for form in forms:
        assert intersection_union(box, mask_rle(form, HEIGHT, WIDTH)) == (128, 384), form
    with pytest.raises(UserError, match="add up to 736"):  # pycocotools would hang merging this one
        mask_rle({"size": [HEIGHT, WIDTH], "counts": runs[:-1].tolist()})


# ---------------------------------------------------------------- the box segmenter: the fixture by hand

def test_box_segmenter_metrics_equal_the_hand_computation(reasonseg):
    task = get_task("lisa", data_path=str(reasonseg))
    rows = [dict(row) for row in task.load("test")]
    assert "mask_giou" not in task.metrics(rows, completions())  # no segmenter: box metrics only
    task.segmenter = BoxSegmenter()
    fields = task.prediction_fields(rows, completions())
    masks = [mask_utils.decode(f["pred_mask"]).astype(bool) for f in fields]
    assert all(m.shape == (HEIGHT, WIDTH) for m in masks)
    assert (masks[0] == rect(10, 8, 30, 20)).all() and not masks[2].any() and (masks[5] == rect(50, 30, 64, 48)).all()
    assert [intersection_union(f["pred_mask"], row["mask_rle"]) for f, row in zip(fields, rows, strict=True)] \
        == HAND_COUNTS
    metrics = task.metrics(rows, completions())
    assert metrics["mask_giou"] == pytest.approx(HAND_GIOU) and metrics["mask_ciou"] == pytest.approx(HAND_CIOU)
    assert metrics["miou"] == pytest.approx(HAND_MIOU)
    # masks attached by evaluation (prediction_fields) are the ones scored
    scored = [{**row, **f} for row, f in zip(rows, fields, strict=True)]
    task.segmenter = None
    assert task.metrics(scored, completions())["mask_ciou"] == pytest.approx(HAND_CIOU)


def test_rescoring_with_the_box_segmenter_never_loads_the_model(reasonseg, tmp_path, no_policy, capsys):
    rows = get_task("lisa", data_path=str(reasonseg)).load("test")
    predictions = write_predictions(tmp_path / "predictions.jsonl", rows)
    code, out, err = cli(["task=lisa", f"data.path={reasonseg}", f"predictions={predictions}", "segmenter=box",
                          f"output_dir={tmp_path / 'rescored'}"], capsys)
    assert code == 0, err
    metrics = json.loads((tmp_path / "rescored" / "metrics.json").read_text())
    assert metrics["mask_giou"] == pytest.approx(HAND_GIOU) and metrics["mask_ciou"] == pytest.approx(HAND_CIOU)
    assert metrics["miou"] == pytest.approx(HAND_MIOU)
    assert "masks by segmenter box" in out and "mask_giou" in out
    records = [json.loads(line) for line in (tmp_path / "rescored" / "predictions.jsonl").read_text().splitlines()]
    assert [r["rewards"]["accuracy"] for r in records] == pytest.approx([1, 1 / 3, 0, 0, 0, 252 / 900])


def test_segmenter_errors_are_one_sentence(reasonseg, tmp_path, no_policy, capsys):
    rows = get_task("lisa", data_path=str(reasonseg)).load("test")
    predictions = write_predictions(tmp_path / "predictions.jsonl", rows)
    common = ["task=lisa", f"data.path={reasonseg}", f"predictions={predictions}", f"output_dir={tmp_path / 'o'}"]
    code, _, err = cli([*common, "segmenter=sam3"], capsys)
    assert code == 2 and "segmenter='sam3'" in err and "one of box, sam, sam2" in err
    for name, model in (("sam", "gpg-vl-tests/no-such-sam"), ("sam2", str(tmp_path / "missing"))):
        code, _, err = cli([*common, f"segmenter={name}", f"segmenter_model={model}"], capsys)
        message = err.strip().removeprefix("error: ")
        assert code == 2 and model in message and "segmenter_model=/path/to/local/copy" in message
        assert "segmenter=box" in message and message.count(". ") == 0 and "\n" not in message
    with pytest.raises(UserError, match="segmenter_batch_size"):
        SamSegmenter("sam", torch.nn.Linear(1, 1), None, batch_size=0)


# ---------------------------------------------------------------- tiny random SAM / SAM 2: the pipeline runs

@pytest.mark.parametrize("name,build", [("sam", tiny_sam), ("sam2", tiny_sam2)])
def test_tiny_sam_pipeline_runs_end_to_end(name, build, reasonseg, tmp_path, no_policy, capsys):
    model_dir = build(tmp_path / name)
    task = get_task("lisa", data_path=str(reasonseg))
    rows = task.load("test")
    # the CLI: segmenter=<name> segmenter_model=<dir> re-scores the saved predictions through the segmenter
    predictions = write_predictions(tmp_path / "predictions.jsonl", rows)
    code, out, err = cli(["task=lisa", f"data.path={reasonseg}", f"predictions={predictions}", f"segmenter={name}",
                          f"segmenter_model={model_dir}", "segmenter_batch_size=4", f"output_dir={tmp_path / 'o'}"],
                         capsys)
    assert code == 0, err
    metrics = json.loads((tmp_path / "o" / "metrics.json").read_text())
    assert metrics["miou"] == pytest.approx(HAND_MIOU)  # box mIoU does not depend on the segmenter
    # the masks: one per row, of the image's size; no box gives an empty mask; batching does not mix rows up
    task.segmenter = load_segmenter(name, str(model_dir), batch_size=4)
    assert isinstance(task.segmenter, SamSegmenter) and task.segmenter.needs_images
    full = [rows[i] for i in range(len(rows))]
    batched = task.prediction_fields(full, completions())
    task.segmenter.batch_size = 1
    one_by_one = task.prediction_fields(full, completions())
    assert [f["pred_mask"] for f in batched] == [f["pred_mask"] for f in one_by_one]
    masks = [mask_utils.decode(f["pred_mask"]) for f in batched]
    assert all(m.shape == (HEIGHT, WIDTH) for m in masks)
    assert not masks[2].any() and not masks[3].any()  # rows without a box
    counts = [intersection_union(f["pred_mask"], row["mask_rle"]) for f, row in zip(batched, full, strict=True)]
    assert metrics["mask_giou"] == pytest.approx(mask_metrics(counts)["giou"])
    assert metrics["mask_ciou"] == pytest.approx(mask_metrics(counts)["ciou"])
    # the same through rescore, in-process
    records = [json.loads(line) for line in predictions.read_text().splitlines()]
    assert rescore(task, records, rows)[0] == pytest.approx(metrics)


def test_a_sam_segmenter_refuses_an_image_of_another_size(reasonseg):
    task = get_task("lisa", data_path=str(reasonseg))
    row = dict(task.load("test")[0])
    row["image"] = row["image"].resize((32, 24))
    segmenter = object.__new__(SamSegmenter)  # no model needed: the sizes are checked before any forward pass
    segmenter.name, segmenter.batch_size = "sam", 1
    task.segmenter = segmenter
    with pytest.raises(UserError, match="32x24 for a mask of 64x48"):
        task.prediction_fields([row], completions()[:1])


# ---------------------------------------------------------------- Seg-Zero's box + point answer

def test_box_points_answer_prompt_and_rewards(reasonseg):
    task = get_task("lisa", data_path=str(reasonseg), answer="box_points")
    rows = task.load("test")
    text = task.messages(rows[0])[0]["content"][1]["text"]
    assert text == POINTS_PROMPT.format(query="the red thing 0")
    assert '<answer>[{"bbox_2d": [10,100,200,210], "point_2d": [30,110]}]</answer>' in text

    def seg_zero(box, point):
        return f'{THINK}<answer>[{{"bbox_2d": {box}, "point_2d": {point}}}]</answer>'

    assert task.reward_components(seg_zero([10, 8, 30, 20], [12, 10]), rows[0]) == {
        "accuracy": 1.0, "format": 1.0, "point": 1.0}
    # (25, 17) is inside the L's box but on its cut-away corner: the mask decides
    assert task.reward_components(seg_zero([20, 8, 40, 20], [25, 17]), rows[0]) == pytest.approx(
        {"accuracy": 1 / 3, "format": 1.0, "point": 0.0})
    assert task.reward(seg_zero([10, 8, 30, 20], [12, 10]), rows[0]) == 3.0
    assert task.reward_components(seg_zero([0, 0, 10, 10], [5, 5]), rows[3]) == {  # empty mask: no target
        "accuracy": 0.0, "format": 1.0, "point": 0.0}
    assert task.reward_components(f"{THINK}<answer>(10,8),(30,20)</answer>", rows[0]) == {
        "accuracy": 1.0, "format": 0.0, "point": 0.0}  # the box-only answer: no point, not the JSON format
    # box metrics read the JSON answer's box
    task.segmenter = BoxSegmenter()
    metrics = task.metrics([rows[0]], [seg_zero([10, 8, 30, 20], [12, 10])])
    assert metrics["miou"] == 1.0 and metrics["mask_giou"] == pytest.approx(0.75)
    with pytest.raises(UserError, match="box, box_points"):
        get_task("lisa", answer="points")


def test_adapters_rewrite_seg_zero_points_into_original_pixels():
    from gpg_vl.models.qwen import Qwen2VLFamily, QwenVLFamily

    text = '<answer>[{"bbox_2d": [100, 200, 500, 1000], "point_2d": [250,500]}]</answer>'
    qwen2 = object.__new__(Qwen2VLFamily)  # the frame maths need no processor
    assert qwen2.completion_to_original(text, [(64, 48, 56, 56)]) == \
        '<answer>[{"bbox_2d": [6.4, 9.6, 32, 48], "point_2d": [16,24]}]</answer>'  # 0-1000 -> 64 x 48 px
    qwen25 = object.__new__(QwenVLFamily)
    assert qwen25.completion_to_original(text, [(64, 48, 128, 96)]) == \
        '<answer>[{"bbox_2d": [50, 100, 250, 500], "point_2d": [125,250]}]</answer>'  # resized 128 x 96 -> 64 x 48
