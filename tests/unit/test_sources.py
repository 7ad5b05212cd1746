"""Loading split rows from local copies and the (unreachable) Hub, and decoding images; nothing is downloaded."""

import io
import json
import struct
import zlib

import datasets
import huggingface_hub
import numpy as np
import pytest
from PIL import Image

from gpg_vl.data.sources import load_image, load_rows, to_rgb
from gpg_vl.errors import BadRow, UserError

FEATURES = datasets.Features(
    {"image": datasets.Image(), "question": datasets.Value("string"), "answer": datasets.Value("int64")}
)


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path_factory, monkeypatch):
    """Keep the arrow cache that `load_dataset` writes for local files out of the home folder (and the data's)."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-datasets-cache")))


def image_rows(count, colour=(200, 30, 30)):
    images = [Image.new("RGB", (8 + i, 6), colour) for i in range(count)]
    questions = [f"how wide is image {i}?" for i in range(count)]
    return datasets.Dataset.from_dict(
        {"image": images, "question": questions, "answer": [8 + i for i in range(count)]}, features=FEATURES
    )


def png_bytes(image, **params):
    buffer = io.BytesIO()
    image.save(buffer, "PNG", **params)
    return buffer.getvalue()


def test_a_parquet_file_yields_pil_images_and_intact_columns_for_any_split_name(tmp_path):
    file = tmp_path / "cv-bench.parquet"
    image_rows(3).to_parquet(str(file))
    rows = load_rows(None, "test", path=str(file), required_columns=("image", "answer"))
    assert isinstance(rows, datasets.Dataset) and len(rows) == 3
    row = rows[2]
    assert isinstance(row["image"], Image.Image) and row["image"].size == (10, 6)
    assert row["image"].getpixel((0, 0)) == (200, 30, 30)
    assert row["question"] == "how wide is image 2?" and row["answer"] == 10


def test_a_folder_chooses_the_split_by_file_name_and_lists_the_available_ones(tmp_path):
    image_rows(2).to_parquet(str(tmp_path / "train.parquet"))
    (tmp_path / "test.jsonl").write_text("\n".join(json.dumps({"question": f"q{i}", "answer": i}) for i in range(3)))
    (tmp_path / "data").mkdir()
    image_rows(4).to_parquet(str(tmp_path / "data" / "validation-00000-of-00001.parquet"))
    (tmp_path / "dataset_infos.json").write_text("{}")  # Hub metadata, not a split

    assert isinstance(load_rows(None, "train", path=tmp_path)[0]["image"], Image.Image)
    test = load_rows(None, "test", path=tmp_path)
    assert len(test) == 3 and test[1] == {"question": "q1", "answer": 1}
    assert len(load_rows(None, "validation", path=tmp_path)) == 4
    with pytest.raises(UserError, match=r"no split 'dev' \(available: test, train, validation\)"):
        load_rows(None, "dev", path=tmp_path)


def test_save_to_disk_folders_of_a_dataset_dict_and_of_a_single_dataset(tmp_path):
    datasets.DatasetDict({"train": image_rows(2), "test": image_rows(5)}).save_to_disk(str(tmp_path / "dict"))
    assert len(load_rows(None, "test", path=tmp_path / "dict")) == 5
    assert isinstance(load_rows(None, "train", path=tmp_path / "dict")[1]["image"], Image.Image)
    with pytest.raises(UserError, match=r"no split 'validation' \(available: train, test\)"):
        load_rows(None, "validation", path=tmp_path / "dict")

    image_rows(3).save_to_disk(str(tmp_path / "single"))
    assert load_rows(None, "anything", path=tmp_path / "single")[0]["answer"] == 8

    image_rows(1).save_to_disk(str(tmp_path / "splits" / "test"))  # one save_to_disk folder per split
    assert len(load_rows(None, "test", path=tmp_path / "splits")) == 1


def test_jsonl_rows_with_relative_image_paths_resolve_against_image_root(tmp_path):
    (tmp_path / "images").mkdir()
    Image.new("RGB", (4, 4), (0, 0, 255)).save(tmp_path / "images" / "a.png")
    Image.new("L", (3, 5), 128).save(tmp_path / "images" / "b.jpg")
    rows = [{"image_path": "./images/a.png", "label": "blue"}, {"image_path": "images/b.jpg", "label": "grey"}]
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(row) for row in rows) + "\n")

    loaded = load_rows(None, "train", path=tmp_path / "rows.jsonl", required_columns=["image_path", "label"])
    first, second = (load_image(row["image_path"], image_root=tmp_path) for row in loaded)
    assert first.mode == "RGB" and first.getpixel((1, 1)) == (0, 0, 255)
    assert second.mode == "RGB" and second.size == (3, 5)
    assert load_image({"bytes": None, "path": "images/a.png"}, image_root=tmp_path).size == (4, 4)
    assert load_image(str(tmp_path / "images" / "a.png"), image_root=tmp_path).size == (4, 4)  # absolute, inside
    # outside the root: refused before the file is opened, unless the data's paths are trusted
    with pytest.raises(BadRow, match="outside the image root '/elsewhere'") as refused:
        load_image(str(tmp_path / "images" / "a.png"), image_root="/elsewhere")
    assert refused.value.reason == "image path outside the image root"
    assert load_image(str(tmp_path / "images" / "a.png"), image_root="/elsewhere", allow_outside=True).size == (4, 4)


def test_a_missing_required_column_is_named_with_the_columns_present(tmp_path):
    file = tmp_path / "rows.parquet"
    image_rows(1).to_parquet(str(file))
    with pytest.raises(UserError, match=r"lacks column\(s\) \['choices'\] \(it has \['image', 'question', 'answer'"):
        load_rows(None, "train", path=file, required_columns=["image", "choices"])


def test_a_missing_path_or_an_unsupported_file_type_names_the_path_and_what_is_accepted(tmp_path):
    with pytest.raises(UserError, match=r"'.*nowhere' does not exist; pass a parquet/jsonl/json"):
        load_rows(None, "train", path=tmp_path / "nowhere")
    (tmp_path / "rows.txt").write_text("hello\n")
    with pytest.raises(UserError, match=r"rows.txt' has an unsupported file type '.txt'; pass a parquet"):
        load_rows(None, "train", path=tmp_path / "rows.txt")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(UserError, match=r"could not read '.*broken.parquet'"):
        load_rows(None, "train", path=tmp_path / "broken.parquet")
    with pytest.raises(UserError, match="no data source"):
        load_rows(None, "train")


def test_an_unreachable_hub_says_in_one_line_how_to_use_a_local_copy(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # both read the variables at import time
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError) as raised:
        load_rows("gpg-vl-tests/definitely-not-cached", "test")
    message = str(raised.value)
    assert "\n" not in message and "'gpg-vl-tests/definitely-not-cached'" in message
    assert "data.path=" in message and message.endswith(".")


def test_transparency_is_composited_on_white():
    rgba = Image.new("RGBA", (2, 1), (255, 0, 0, 255))
    rgba.putpixel((1, 0), (0, 0, 0, 0))
    assert list(load_image(rgba).get_flattened_data()) == [(255, 0, 0), (255, 255, 255)]
    assert load_image(Image.new("LA", (1, 1), (0, 0))).getpixel((0, 0)) == (255, 255, 255)

    palette = Image.new("P", (2, 1))
    palette.putpalette([0, 255, 0, 0, 0, 255])
    palette.putpixel((1, 0), 1)
    decoded = load_image(png_bytes(palette, transparency=0))
    assert decoded.mode == "RGB" and list(decoded.get_flattened_data()) == [(255, 255, 255), (0, 0, 255)]


def test_grey_cmyk_and_16_bit_images_convert_to_rgb_sensibly():
    assert load_image(Image.new("L", (1, 1), 77)).getpixel((0, 0)) == (77, 77, 77)
    assert load_image(Image.new("CMYK", (1, 1), (0, 255, 255, 0))).getpixel((0, 0)) == (255, 0, 0)
    assert load_image(Image.new("1", (1, 1), 1)).getpixel((0, 0)) == (255, 255, 255)

    gradient = (np.arange(256, dtype=np.uint16) * 257).reshape(1, 256)  # 0 .. 65535
    sixteen = Image.fromarray(gradient)
    assert sixteen.mode == "I;16"
    for image in (sixteen, load_image(png_bytes(sixteen)), to_rgb(sixteen.convert("I"))):
        values = np.asarray(to_rgb(image))[0, :, 0]
        assert values.min() == 0 and values.max() == 255 and (values == np.arange(256)).all()


def test_png_bytes_and_datasets_image_dicts_decode():
    data = png_bytes(Image.new("RGB", (5, 3), (1, 2, 3)))
    assert load_image(data).getpixel((4, 2)) == (1, 2, 3)
    assert load_image(memoryview(data)).size == (5, 3)
    assert load_image({"bytes": data, "path": "remote/name.png"}).size == (5, 3)


def test_broken_and_missing_images_name_the_file_or_row(tmp_path):
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    data = png_bytes(noise)
    with pytest.raises(UserError, match=r"could not decode image bytes of row 7 \(.*truncated"):
        load_image(data[: len(data) // 2], row=7)
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match=r"could not decode .*cut.png"):
        load_image("cut.png", image_root=tmp_path)
    with pytest.raises(UserError, match=r"could not decode image bytes"):
        load_image(b"not an image")
    with pytest.raises(UserError, match=r"image file '.*missing.png' does not exist; check data.image_root="):
        load_image("./missing.png", image_root=tmp_path)
    with pytest.raises(UserError, match=r"is a int, not an image"):
        load_image(3)


def test_decompression_bombs_are_refused_with_their_size(tmp_path, monkeypatch):
    data = bytearray(png_bytes(Image.new("L", (1, 1))))
    ihdr = bytearray(struct.pack(">II", 30000, 30000)) + data[24:29]  # width, height, depth/colour/...
    data[16:33] = ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    (tmp_path / "bomb.png").write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"bomb.png' is too large to decode safely \(900000000 pixels, over"):
        load_image(tmp_path / "bomb.png")

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 300)  # 400 pixels: over the limit, under twice it
    with pytest.raises(UserError, match=r"too large to decode safely \(20x20 = 400 pixels, over PIL's limit of 300\)"):
        load_image(png_bytes(Image.new("RGB", (20, 20))))


def test_rows_skipped_by_design_are_counted_apart_from_bad_rows_and_never_stop_the_run():
    from gpg_vl.data.stream import BadRowLog
    from gpg_vl.errors import BadRow, SkippedRow

    log = BadRowLog(max_bad_fraction=0.0, total=4)
    note = log.record(0, SkippedRow("sentence answer without a judge", "row 0 needs a judge."))
    assert note.startswith("skipped row 0 (sentence answer without a judge): row 0 needs a judge. Such rows are "
                           "counted as skipped_rows/sentence answer without a judge")
    assert log.record(1, SkippedRow("sentence answer without a judge", "row 1 needs a judge.")) is None  # once
    assert not log.over_limit() and (log.seen, log.bad) == (0, 0)
    assert log.metrics() == {"rows_seen": 0, "bad_rows": 0, "skipped_rows/sentence answer without a judge": 2}
    assert "no training row can be used" in log.stop_message()  # a split of skipped rows only
    log.record(2, BadRow("empty question", "row 2 has no question."))
    assert log.over_limit() and log.stop_message().startswith("1 of 1 rows seen are bad")
    restored = BadRowLog()
    restored.load_state_dict(log.state_dict())
    assert restored.metrics() == log.metrics() and restored.summary() == log.summary()
