"""The cvbench and geoqa tasks on fixtures written in the datasets' published layouts; nothing is downloaded.

Each fixture loads the way the Hub copy would: `datasets` reading a parquet file, a `save_to_disk` folder, or a
jsonl with an image folder.
"""

import json

import datasets
import gpg_vl_tasks.cvbench
import gpg_vl_tasks.geoqa
import pytest
from helpers.task_fixtures import COLOURS, GEO_TRAIN, SAT_ROWS, picture, sat_parquet

from gpg_vl import get_task
from gpg_vl.cli import eval_main
from gpg_vl.config.compose import load_config
from gpg_vl.data.sources import load_rows
from gpg_vl.errors import UserError


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path_factory, monkeypatch):
    """Keep the arrow cache that `load_dataset` writes for local files out of the home folder."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-datasets-cache")))


def think(answer):
    return f"<think> looking </think><answer>{answer}</answer>"


# ---------------------------------------------------------------- cvbench

# CV-Bench rows: (task, source, options, right letter); Count/Relation are 2D, Depth/Distance 3D (Omni3D).
CV_ROWS = [
    ("Count", "ADE20K", ["3", "2", "1", "0"], "C"),
    ("Count", "COCO", ["1", "2", "4", "5"], "B"),
    ("Relation", "ADE20K", ["above", "below"], "A"),
    ("Relation", "COCO", ["left", "right"], "B"),
    ("Relation", "COCO", ["left", "right"], "A"),
    ("Depth", "Omni3D", ["chair", "lamp"], "A"),
    ("Depth", "Omni3D", ["bed", "table"], "B"),
    ("Distance", "Omni3D", ["shelf", "desk"], "A"),
    ("Distance", "Omni3D", ["sink", "oven"], "B"),
]
CV_FEATURES = datasets.Features({
    "idx": datasets.Value("int32"), "type": datasets.Value("string"), "task": datasets.Value("string"),
    "image": datasets.Image(), "question": datasets.Value("string"),
    "choices": datasets.List(datasets.Value("string")), "answer": datasets.Value("string"),
    "prompt": datasets.Value("string"), "filename": datasets.Value("string"), "source": datasets.Value("string"),
    "source_dataset": datasets.Value("string"), "source_filename": datasets.Value("string"),
    "target_class": datasets.Value("string"), "target_size": datasets.Value("int64"),
    "bbox": datasets.List(datasets.List(datasets.Value("float64"))),
})


def cv_bench_rows():
    columns = {name: [] for name in CV_FEATURES}
    for i, (task, source, options, letter) in enumerate(CV_ROWS):
        question = f"Question {i} about the {task.lower()}?"
        lines = "\n".join(f"({chr(65 + k)}) {option}" for k, option in enumerate(options))
        values = {
            "idx": i, "type": "2D" if source != "Omni3D" else "3D", "task": task, "image": picture(i, (64, 48)),
            "question": question, "choices": options, "answer": f"({letter})",
            "prompt": f"{question} Select from the following choices.\n{lines}",
            "filename": f"img/{task.lower()}/{i}.png", "source": source, "source_dataset": f"{source} set",
            "source_filename": f"{i}.jpg", "target_class": None, "target_size": None, "bbox": None,
        }
        for name, value in values.items():
            columns[name].append(value)
    return datasets.Dataset.from_dict(columns, features=CV_FEATURES)


@pytest.fixture()
def cvbench_data(tmp_path):
    """A folder holding train.parquet (SAT) and a `test` save_to_disk folder (CV-Bench)."""
    sat_parquet(tmp_path / "train.parquet")
    cv_bench_rows().save_to_disk(str(tmp_path / "test"))
    return tmp_path


def test_sat_rows_keep_single_images_up_to_the_limit_and_letter_their_options(cvbench_data):
    task = get_task("cvbench", data_path=cvbench_data)
    rows = task.load("train")
    assert len(rows) == 3 and [row["question"] for row in rows] == [r[1] for r in SAT_ROWS if r[0] == 1]
    assert len(get_task("cvbench", data_path=cvbench_data, train_limit=2).load("train")) == 2

    (message,) = task.messages(rows[1])
    images = [part["image"] for part in message["content"] if part["type"] == "image"]
    texts = [part["text"] for part in message["content"] if part["type"] == "text"]
    assert len(images) == 1 and images[0].mode == "RGB" and images[0].size == (56, 56)
    assert texts == [
        "Which object is closer to the camera? Select from the following choices.\n(A) lamp\n(B) sofa\n(C) door\n"
        "Output the thinking process in <think> </think> and final answer in <answer> </answer> tags."
    ]
    assert task.target(rows[1]) == "(B) sofa"
    for answer in ("sofa", "B", "(B)", "(B) sofa"):
        assert task.reward(think(answer), rows[1]) == 2.0, answer
    for answer in ("lamp", "A", "B or C", "sofa, door", "(A) sofa"):
        assert task.reward(think(answer), rows[1]) == 1.0, answer
    assert task.reward("<answer>sofa</answer>", rows[1]) == 1.0  # right, but not in the format

    metrics = task.metrics(rows, [think("right"), think("lamp"), think("(B)")])  # per SAT question type
    assert metrics["accuracy/obj_rel"] == 1.0 and metrics["accuracy/obj_depth"] == 0.0
    assert metrics["accuracy"] == pytest.approx(2 / 3) and "total" not in metrics and "official" not in metrics


def test_cv_bench_rows_messages_rewards_and_the_papers_metrics(cvbench_data):
    task = get_task("cvbench", data_path=cvbench_data)
    rows = task.load("test")
    assert len(rows) == len(CV_ROWS) and len(rows[:4]) == 4 and rows[2:][0]["id"] == rows[2]["id"]
    row = rows[0]
    (message,) = task.messages(row)
    assert [part["type"] for part in message["content"]] == ["image", "text"]
    assert message["content"][0]["image"].size == (64, 48)
    assert message["content"][1]["text"] == row["prompt"] + "\n" + gpg_vl_tasks.cvbench.INSTRUCTION
    assert row["prompt"].endswith("(C) 1\n(D) 0")
    assert task.reward(think("(C)"), row) == 2.0 and task.reward(think("1"), row) == 2.0
    assert task.reward(think("(A)"), row) == 1.0 and task.reward(think("C or D"), row) == 1.0

    right = [True, False, True, True, False, True, False, True, False]
    completions = [think(f"({letter})" if ok else "A or B") for (*_, letter), ok in zip(CV_ROWS, right, strict=True)]
    completions[2] = think("above")  # the right option's text counts too
    metrics = task.metrics(rows, completions)
    # Per task: Count 1/2, Relation 2/3, Depth 1/2, Distance 1/2 -> total = (1/2 + 2/3 + 1/2 + 1/2) / 4 = 13/24.
    # Per source: ADE20K 2/2, COCO 1/3, Omni3D 2/4 -> official = ((1 + 1/3) / 2 + 1/2) / 2 = 7/12.
    expected = {
        "accuracy/count": 1 / 2, "accuracy/relation": 2 / 3, "accuracy/depth": 1 / 2, "accuracy/distance": 1 / 2,
        "accuracy/2d": 3 / 5, "accuracy/3d": 2 / 4, "accuracy/ade20k": 1.0, "accuracy/coco": 1 / 3,
        "accuracy/omni3d": 2 / 4, "total": 13 / 24, "official": 7 / 12, "accuracy": 5 / 9,
        "reward/accuracy": 5 / 9, "reward/format": 1.0,
    }
    assert metrics.keys() >= expected.keys()
    assert {key: metrics[key] for key in expected} == pytest.approx(expected)

    # Without Omni3D rows the official score is the 2D half alone: (1 + 1/3) / 2.
    assert task.metrics(rows[:5], completions[:5])["official"] == pytest.approx(2 / 3)


def test_published_sat_and_cv_bench_rows_score_as_prepared(cvbench_data):
    """`reward(completion, row)` on a row as `datasets` yields it (SAT: `answers`, `correct_answer`; CV-Bench:
    `choices`, `answer`) scores as on the row the loader prepared, right and wrong answers alike."""
    task = get_task("cvbench", data_path=cvbench_data)
    sat = [row for row in load_rows(None, "train", path=cvbench_data) if len(row["image_bytes"]) == 1]
    cv_bench = list(load_rows(None, "test", path=cvbench_data))
    for published, prepared in [*zip(sat, task.load("train"), strict=True),
                                *zip(cv_bench, task.load("test"), strict=True)]:
        assert "choices" not in published or "correct_answer" not in published
        right = task.target(published)  # "(B) sofa": the letter and the option's text
        assert right == task.target(prepared)
        wrong = next(f"({letter})" for letter in "ABCD" if not right.startswith(f"({letter})"))
        for completion, accuracy in ((think(right), 1.0), (think(right[1]), 1.0), (think(wrong), 0.0)):
            scores = task.reward_components(completion, published)
            assert scores == task.reward_components(completion, prepared) and scores["accuracy"] == accuracy
        assert task.metrics([published], [think(right)]) == task.metrics([prepared], [think(right)])
    assert not task.reward_errors


def test_cvbench_config_is_the_papers_and_composes_for_eval_too():
    for config in ("train", "eval"):
        for overrides in (["task=cvbench"], ["+experiment=cvbench-paper"]):
            cfg = load_config(config, overrides)
            assert cfg.task.name == "cvbench" and cfg.task.options.train_limit == 15000
            assert cfg.trainer.group_size == 8 and cfg.trainer.lr == 1e-6 and cfg.trainer.beta_th == 0.4
            assert cfg.rollout.max_new_tokens == 700 and cfg.eval.max_new_tokens == 1024
        assert load_config(config, ["task=cvbench"]).model.name_or_path.startswith("embedded:")  # the task alone
        paper = load_config(config, ["+experiment=cvbench-paper"]).model  # the paper's recipe: the base model
        assert paper.name_or_path == "Qwen/Qwen2-VL-2B" and paper.prompt_style == "raw"
    base = load_config("eval", ["task=cvbench", "model=qwen2-vl-2b"])  # a task's settings on a named model
    assert base.model.name_or_path == "Qwen/Qwen2-VL-2B" and base.eval.max_new_tokens == 1024


def run_eval(tmp_path, overrides):
    out = tmp_path / "out"
    metrics = eval_main(load_config("eval", [*overrides, "model=tiny", "eval.limit=4", "eval.batch_size=4",
                                             "eval.max_new_tokens=8", f"output_dir={out}"]))
    assert len((out / "predictions.jsonl").read_text().splitlines()) == 4
    assert "accuracy" in json.loads((out / "metrics.json").read_text())
    return metrics


def test_cvbench_evaluates_on_the_tiny_model(tmp_path):
    file = tmp_path / "cv-bench.parquet"
    cv_bench_rows().to_parquet(str(file))
    metrics = run_eval(tmp_path, ["task=cvbench", f"data.path={file}"])
    assert {"accuracy/count", "accuracy/relation", "total", "official"} <= metrics.keys()


# ---------------------------------------------------------------- geoqa

GEO_TEST = [("Angle 1 = 40°; find angle 2.", "140°"), ("Find x.", "2\\sqrt{3}"), ("Find y.", "7"),
            ("Find z.", "0.5"), ("Find w.", "30°")]


def geoqa_test_jsonl(folder, image_root=None):
    """The GeoQA test jsonl in `folder`, its images under image_root (default: the same folder)."""
    root = image_root or folder
    (root / "Geo170K" / "images" / "test").mkdir(parents=True, exist_ok=True)
    lines = []
    for i, (question, truth) in enumerate(GEO_TEST):
        picture(i, (72, 60)).save(root / "Geo170K" / "images" / "test" / f"{i}.png")
        lines.append(json.dumps({"image_path": f"./Geo170K/images/test/{i}.png", "question": question,
                                 "ground_truth": truth}, ensure_ascii=False))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "geoqa_test.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder / "geoqa_test.jsonl"


def test_geoqa_train_rows_take_the_answer_tag_as_target(tmp_path):
    features = datasets.Features({"image": datasets.Image(), "problem": datasets.Value("string"),
                                  "solution": datasets.Value("string")})
    columns = {"image": [picture(i) for i in range(len(GEO_TRAIN))], "problem": [p for p, _ in GEO_TRAIN],
               "solution": [s for _, s in GEO_TRAIN]}
    datasets.Dataset.from_dict(columns, features=features).to_parquet(str(tmp_path / "train.parquet"))
    task = get_task("geoqa", data_path=tmp_path)
    rows = task.load("train")
    assert [task.target(row) for row in rows] == ["5", "140°", "12"]
    (message,) = task.messages(rows[0])
    assert [part["type"] for part in message["content"]] == ["image", "text"]
    assert message["content"][0]["image"].size == (56, 56)
    assert message["content"][1]["text"] == (
        "In the figure, AB = 3 and BC = 4; find AC.  Output the thinking process in <think> </think> and final "
        "answer (number) in <answer> </answer> tags."
    )
    assert task.reward(think("5"), rows[0]) == 2.0 and task.reward(think("6"), rows[0]) == 1.0
    assert task.reward(think("140"), rows[1]) == 2.0 and task.reward(think("140^\\circ"), rows[1]) == 2.0


def test_geoqa_test_jsonl_images_resolve_next_to_it_or_under_image_root(tmp_path):
    task = get_task("geoqa", data_path=geoqa_test_jsonl(tmp_path / "beside"))
    rows = task.load("test")
    assert len(rows) == len(GEO_TEST) and rows[0]["image"].size == (72, 60)
    assert task.target(rows[0]) == "140°" and rows[0]["id"] == "./Geo170K/images/test/0.png"
    assert task.messages(rows[0])[0]["content"][1]["text"].startswith("Angle 1 = 40°; find angle 2.  Output")
    assert task.reward(think("140"), rows[0]) == 2.0 and task.reward(think("40"), rows[0]) == 1.0
    assert task.reward(think("\\sqrt{12}"), rows[1]) == 2.0
    right = [think("140°"), think("2\\sqrt{3}"), "<answer>7</answer>", think("1/3"), "no answer"]
    metrics = task.metrics(rows, right)
    assert metrics["accuracy"] == pytest.approx(3 / 5) and metrics["reward/format"] == pytest.approx(3 / 5)

    elsewhere = tmp_path / "images"
    jsonl = geoqa_test_jsonl(tmp_path / "data", image_root=elsewhere)
    with pytest.raises(UserError, match="image_root"):
        get_task("geoqa", data_path=jsonl).load("test")[0]
    moved = get_task("geoqa", data_path=jsonl, image_root=elsewhere).load("test")
    assert moved[4]["image"].getpixel((0, 0)) == COLOURS[4]


def test_geoqa_test_split_without_data_path_fails_in_one_sentence_naming_it():
    with pytest.raises(UserError) as error:
        get_task("geoqa").load("test")
    message = str(error.value)
    assert "data.path=" in message and "data.image_root=" in message and message.count(". ") == 0


def test_geoqa_config_is_the_papers_and_the_model_can_be_overridden():
    for config in ("train", "eval"):
        for overrides in (["task=geoqa"], ["+experiment=geoqa-paper"]):
            cfg = load_config(config, overrides)
            assert cfg.task.name == "geoqa"
            assert cfg.trainer.group_size == 8 and cfg.trainer.lr == 1e-6 and cfg.trainer.epochs == 1
            assert cfg.rollout.max_new_tokens == 256 and cfg.eval.max_new_tokens == 1024
        assert load_config(config, ["task=geoqa"]).model.name_or_path == "embedded:tiny-qwen2.5-vl"  # model=tiny kept
        paper = load_config(config, ["+experiment=geoqa-paper"])
        assert paper.model.name_or_path == "Qwen/Qwen2.5-VL-3B-Instruct"
        assert config == "eval" or paper.trainer.loss == "gpg"  # GPG, train.yaml's default algorithm
    assert load_config("train", ["task=geoqa", "model=qwen2.5-vl-7b"]).model.name_or_path.endswith("7B-Instruct")
    named = load_config("train", ["+experiment=geoqa-paper", "model=qwen2.5-vl-7b"])  # the command line wins
    assert named.model.name_or_path.endswith("7B-Instruct")
    with pytest.raises(UserError, match="unknown experiment 'geoqa'; known: classification-paper"):
        load_config("train", ["+experiment=geoqa"])


def test_geoqa_evaluates_on_the_tiny_model(tmp_path):
    elsewhere = tmp_path / "images"
    jsonl = geoqa_test_jsonl(tmp_path / "data", image_root=elsewhere)
    run_eval(tmp_path, ["task=geoqa", "eval.split=test", f"data.path={jsonl}", f"data.image_root={elsewhere}"])


def test_importing_the_modules_registers_the_tasks():
    assert type(get_task("cvbench")) is gpg_vl_tasks.cvbench.CVBench
    assert type(get_task("geoqa")) is gpg_vl_tasks.geoqa.GeoQA
