"""GUI grounding scored as the benchmarks score it: hand-made rows in each benchmark's published schema, run through
the tasks (`screenspot`, `screenspot_pro`) and through a REFERENCE re-implementation, in this file, of each
benchmark's own scoring code, written from reading it (not copied):

- SeeClick's `pretrain/screenspot_test.py` (ScreenSpot and ScreenSpot-v2): per json file (platform), the box
  [x, y, w, h] turned into (x, y, x + w, y + h) and divided by the image's size, the predicted point (already
  0-1) right when x1 <= x <= x2 and y1 <= y <= y2; a response it cannot read is a wrong format counted wrong;
  per file: action accuracy, total, wrong-format count, text and icon accuracy.
- ScreenSpot-Pro's `eval_screenspot_pro.py`: `eval_sample_positive_gt` (box [x1, y1, x2, y2] and point divided by
  `img_size`, inclusive on all four sides, no point: "wrong_format"), `eval_sample_negative_gt` (a refusal is
  correct, a click wrong, else wrong format), its main loop's expansion over instruction style x ground-truth type
  x language, and `evaluate(results)["metrics"]` with its four breakdowns (`make_combinations`,
  `collect_results_to_eval` reading None as "no filter", `calc_metric_for_result_list`).

The model's answers are written in original pixels here (the family's conversion is tested in
tests/integration/test_task_gui.py); the reference receives the same clicks divided by the image size, as each
benchmark's model wrappers hand them over.
"""

from __future__ import annotations

import copy
import itertools
import json

import pytest
from PIL import Image

from gpg_vl.data.task import get_task

# ---------------------------------------------------------------------------------------------
# REFERENCE: SeeClick's screenspot_test.py, re-implemented from its text
# ---------------------------------------------------------------------------------------------


def reference_seeclick(files: dict[str, list[dict]], sizes: dict[str, tuple[int, int]], responses) -> dict:
    """{task: {action_acc, num_total, wrong_format_num, text_acc, icon_acc}} as the script's loop computes and
    logs them; `responses(item)` gives the normalised click it parsed, or None where parsing raised."""
    report = {}
    for task, items in files.items():
        num_action = corr_action = num_wrong_format = 0
        text_correct, icon_correct = [], []
        for item in items:
            num_action += 1
            bbox = item["bbox"]
            bbox = [bbox[0], bbox[1], bbox[0] + bbox[2], bbox[1] + bbox[3]]
            img_size = sizes[item["img_filename"]]
            bbox = [bbox[0] / img_size[0], bbox[1] / img_size[1], bbox[2] / img_size[0], bbox[3] / img_size[1]]
            click_point = responses(item)
            if click_point is None:  # the script's bare `except:` around parsing
                num_wrong_format += 1
                (text_correct if item["data_type"] == "text" else icon_correct).append(0)
                continue
            hit = (bbox[0] <= click_point[0] <= bbox[2]) and (bbox[1] <= click_point[1] <= bbox[3])
            corr_action += hit
            (text_correct if item["data_type"] == "text" else icon_correct).append(int(hit))
        report[task] = {"action_acc": corr_action / num_action, "num_total": num_action,
                        "wrong_format_num": num_wrong_format,
                        "text_acc": sum(text_correct) / len(text_correct) if text_correct else 0,
                        "icon_acc": sum(icon_correct) / len(icon_correct) if icon_correct else 0}
    return report


# ---------------------------------------------------------------------------------------------
# REFERENCE: ScreenSpot-Pro's eval_screenspot_pro.py, re-implemented from its text
# ---------------------------------------------------------------------------------------------


def ref_positive(sample, response):
    bbox = sample["bbox"]
    img_size = sample["img_size"]
    bbox = [bbox[0] / img_size[0], bbox[1] / img_size[1], bbox[2] / img_size[0], bbox[3] / img_size[1]]
    click_point = response["point"]
    if click_point is None:
        return "wrong_format"
    if (bbox[0] <= click_point[0] <= bbox[2]) and (bbox[1] <= click_point[1] <= bbox[3]):
        return "correct"
    return "wrong"


def ref_negative(sample, response):
    if response["result"] == "negative":
        return "correct"
    if response["result"] == "positive":
        return "wrong"
    return "wrong_format"


ATTRIBUTES = ("platform", "group", "application", "language", "gt_type", "instruction_style", "ui_type")


def ref_collect(results, **wanted):
    return [s for s in results if all(v is None or s.get(k) == v for k, v in wanted.items())]


def ref_combinations(results, **asked):
    unique = {key: set() for key in ATTRIBUTES}
    for sample in results:
        for key in ATTRIBUTES:
            if asked.get(key):
                unique[key].add(sample.get(key))
    values = {key: list(found) for key, found in unique.items() if found}
    return [dict(zip(values, combination, strict=True)) for combination in itertools.product(*values.values())]


def ref_calc(results):
    total = len(results)
    correct = sum(1 for r in results if r["correctness"] == "correct")
    text = ref_collect(results, ui_type="text")
    icon = ref_collect(results, ui_type="icon")
    text_correct = sum(1 for r in text if r["correctness"] == "correct")
    icon_correct = sum(1 for r in icon if r["correctness"] == "correct")
    return {"num_correct_action": correct, "num_total": total,
            "wrong_format_num": sum(1 for r in results if r["correctness"] == "wrong_format"),
            "action_acc": correct / total if total > 0 else 0,
            "text_acc": text_correct / len(text) if len(text) > 0 else 0,
            "icon_acc": icon_correct / len(icon) if len(icon) > 0 else 0}


def ref_section(results, key_of, **asked):
    section = {}
    for combo in ref_combinations(results, **asked):
        metrics = ref_calc(ref_collect(results, **combo))
        if metrics["num_total"]:
            section[key_of(combo)] = metrics
    return section


def ref_evaluate(results):
    return {
        "fine_grained": ref_section(results, lambda c: f"plat:{c['platform']} app:{c['application']} inst_style:"
                                                       f"{c['instruction_style']} gt_type:{c['gt_type']}",
                                    platform=True, application=True, instruction_style=True, gt_type=True),
        "seeclick_style": ref_section(results, lambda c: f"plat:{c['platform']} inst_style:{c['instruction_style']} "
                                                         f"gt_type:{c['gt_type']}",
                                      platform=True, instruction_style=True, gt_type=True),
        "leaderboard_simple_style": ref_section(results, lambda c: f"group:{c['group']}", group=True),
        "leaderboard_detailed_style": ref_section(results, lambda c: f"app:{c['application']}", application=True),
        "overall": ref_calc(results),
    }


def reference_screenspot_pro(task_data: dict[str, list[dict]], inst_styles, gt_types, languages, respond):
    """The script's main loop: expand, ask `respond(sample)` for the model's response dict, score, evaluate."""
    results = []
    for task_filename, rows in task_data.items():
        for inst_style, gt_type, lang, instance in itertools.product(inst_styles, gt_types, languages, rows):
            sample = copy.deepcopy(instance)
            sample.update(task_filename=task_filename, gt_type=gt_type, instruction_style=inst_style, language=lang)
            sample["prompt_to_evaluate"] = sample["instruction_cn"] if lang == "cn" else sample["instruction"]
            response = respond(sample)
            result = {"group": sample.get("group"), "platform": sample["platform"],
                      "application": sample["application"], "lang": sample["language"],
                      "instruction_style": sample["instruction_style"], "gt_type": sample["gt_type"],
                      "ui_type": sample["ui_type"]}
            positive = sample["gt_type"] == "positive"
            result["correctness"] = ref_positive(sample, response) if positive else ref_negative(sample, response)
            results.append(result)
    return ref_evaluate(results)


# ---------------------------------------------------------------------------------------------
# the fixtures: rows in each published schema, and answers that hit every case
# ---------------------------------------------------------------------------------------------
def write_images(root, sizes):
    for name, size in sizes.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", size, (255, 255, 255)).save(root / name)


def answer(point=None, box=None, text=None) -> str:
    if text is None:
        text = f"({point[0]}, {point[1]})" if point is not None else f"[{', '.join(map(str, box))}]"
    return f"<think> look </think><answer>{text}</answer>"


# each case: (what the completion says, what the benchmark's wrapper hands the scorer)
def seeclick_cases(x1, y1, x2, y2):
    """Answers in original pixels for a box (x1, y1, x2, y2), covering every edge, a box answer and no answer."""
    cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
    return [
        ("centre", (cx, cy)), ("left edge", (x1, cy)), ("right edge", (x2, cy)), ("top edge", (cx, y1)),
        ("bottom edge", (cx, y2)), ("corner", (x2, y2)), ("just left", (x1 - 0.5, cy)),
        ("just below", (cx, y2 + 0.5)), ("far", (1, 1)), ("box answer", ("box", (x1, y1, x2, y2))),
        ("no click", None), ("two points", "two"),
    ]


def completion_of(case, size):
    """(completion text, the normalised point the reference receives or None)."""
    if case is None:
        return answer(text="the search button"), None
    if case == "two":
        return answer(text="(1, 2) or (3, 4)"), None
    if case[0] == "box":
        x1, y1, x2, y2 = case[1]
        return answer(box=case[1]), (((x1 + x2) / 2) / size[0], ((y1 + y2) / 2) / size[1])
    return answer(point=case), (case[0] / size[0], case[1] / size[1])


def test_screenspot_scores_seeclick_rows_as_seeclicks_own_script(tmp_path):
    sizes = {"m1.png": (1000, 2000), "d1.png": (1600, 1000), "w1.png": (1280, 800)}
    write_images(tmp_path / "imgs", sizes)
    boxes = {"mobile": ("m1.png", [100, 200, 300, 100]), "desktop": ("d1.png", [40, 50, 20, 10]),
             "web": ("w1.png", [640, 400, 128, 80])}
    files, by_instruction = {}, {}
    for platform, (image, box) in boxes.items():
        x, y, w, h = box
        rows = []
        for k, (name, case) in enumerate(seeclick_cases(x, y, x + w, y + h)):
            instruction = f"{platform} {name}"
            rows.append({"img_filename": image, "bbox": box, "instruction": instruction,
                         "data_type": "text" if k % 3 else "icon", "data_source": "ios" if platform == "mobile" else
                         ("windows" if platform == "desktop" else "gitlab")})
            by_instruction[instruction] = completion_of(case, sizes[image])
        files[platform] = rows
        (tmp_path / f"screenspot_{platform}_v2.json").write_text(json.dumps(rows))

    task = get_task("screenspot", data_path=str(tmp_path), image_root=str(tmp_path / "imgs"))
    rows = task.load("test")
    completions = [by_instruction[row["instruction"]][0] for row in rows]
    ours = task.metrics(rows, completions)
    reference = reference_seeclick(files, sizes, lambda item: by_instruction[item["instruction"]][1])
    for platform, numbers in reference.items():
        for name, value in numbers.items():
            assert ours[f"{platform}/{name}"] == value, (platform, name)
    everything = [row for rows in files.values() for row in rows]
    overall = reference_seeclick({"all": everything}, sizes, lambda item: by_instruction[item["instruction"]][1])
    assert ours["accuracy"] == overall["all"]["action_acc"]  # the published tables' "Avg.": every row counts once
    assert ours["num_total"] == 36 and ours["wrong_format_num"] == 6
    # the hand-worked count: per platform, the centre, the four edges, the corner and the box answer hit (7 of 12)
    assert ours["accuracy"] == pytest.approx(21 / 36) and ours["mobile/action_acc"] == pytest.approx(7 / 12)


def test_screenspot_pro_scores_its_rows_as_its_own_script_with_every_breakdown(tmp_path):
    sizes = {"vscode/a.png": (3840, 2160), "photoshop/b.png": (2560, 1440), "excel/c.png": (1920, 1080)}
    write_images(tmp_path / "images", sizes)
    specs = {"vscode_windows": ("vscode/a.png", [1000, 500, 1100, 540], "Dev", "windows", "vscode"),
             "photoshop_macos": ("photoshop/b.png", [10, 20, 60, 70], "Creative", "macos", "photoshop"),
             "excel_windows": ("excel/c.png", [1800, 1000, 1920, 1080], "Office", "windows", "excel")}
    task_data, responses = {}, {}
    for file, (image, box, group, platform, application) in specs.items():
        rows = []
        for k, (name, case) in enumerate(seeclick_cases(*box)):
            row = {"img_filename": image, "bbox": box, "instruction": f"{file} {name}",
                   "instruction_cn": f"{file} {name} (cn)", "img_size": list(sizes[image]),
                   "application": application, "platform": platform, "group": group,
                   "ui_type": "icon" if k % 2 else "text", "id": f"{file}-{k}"}
            rows.append(row)
            responses[row["instruction"]] = completion_of(case, sizes[image])
        task_data[file] = rows
        (tmp_path / f"{file}.json").write_text(json.dumps(rows))

    def respond(sample):
        """The wrapper's response dict: a point (normalised), or for negative rows whether it refused."""
        text, point = responses[sample["instruction"]]
        refused = "no click" in sample["instruction"] and sample["gt_type"] == "negative"
        result = "negative" if refused else ("positive" if point is not None else "wrong_format")
        return {"point": None if refused else point, "result": result}

    def completion(row):
        text, _ = responses[row["instruction"]]
        if "no click" in row["instruction"] and row["gt_type"] == "negative":
            return answer(text="Not found.")
        return text

    task = get_task("screenspot_pro", data_path=str(tmp_path), image_root=str(tmp_path / "images"),
                    inst_style="all", gt_type="all")
    rows = task.load("test")
    assert len(rows) == 3 * 12 * 3 * 2
    completions = [completion(row) for row in rows]
    reference = reference_screenspot_pro(task_data, ("instruction", "action", "description"),
                                         ("positive", "negative"), ("en",), respond)
    from gpg_vl_tasks.screenspot_pro import FIELDS, screenspot_pro_report

    assert screenspot_pro_report(task.results(rows, completions, FIELDS)) == reference
    ours = task.metrics(rows, completions)
    assert ours["accuracy"] == reference["overall"]["action_acc"]
    assert ours["wrong_format_num"] == reference["overall"]["wrong_format_num"]
    for section in ("leaderboard_simple_style", "leaderboard_detailed_style", "seeclick_style", "fine_grained"):
        for key, numbers in reference[section].items():
            assert ours[f"{key}/action_acc"] == numbers["action_acc"] and ours[f"{key}/icon_acc"] == numbers["icon_acc"]
    # hand-worked: positive rows hit 7 of 12 per file; negative rows are right only for the refusal (1 of 12), and
    # their answers without a click (the two-point one) are wrong formats
    assert reference["overall"]["num_correct_action"] == 3 * 3 * (7 + 1)
    assert reference["overall"]["wrong_format_num"] == 3 * 3 * (2 + 1)
    assert ours["group:Office/action_acc"] == pytest.approx(8 / 24)

    # Chinese instructions (positive, instruction style only): the rows show instruction_cn
    chinese = get_task("screenspot_pro", data_path=str(tmp_path), image_root=str(tmp_path / "images"), language="cn")
    assert chinese.load("test")[0]["instruction"].endswith("(cn)")


def test_screenspot_pro_groups_rows_without_a_group_as_its_script_does(tmp_path):
    """A row without `group` gives the key `group:None`, whose filter (None) takes every result, as the script's
    `collect_results_to_eval` reads None."""
    write_images(tmp_path / "images", {"a.png": (100, 100)})
    rows = [{"img_filename": "a.png", "bbox": [10, 10, 20, 20], "instruction": f"click {k}", "img_size": [100, 100],
             "application": "app", "platform": "linux", "ui_type": "text"} for k in range(2)]
    rows[1]["group"] = "OS"
    (tmp_path / "a.json").write_text(json.dumps(rows))
    task = get_task("screenspot_pro", data_path=str(tmp_path / "a.json"), image_root=str(tmp_path / "images"))
    loaded = task.load("test")
    completions = [answer(point=(15, 15)), answer(point=(50, 50))]
    from gpg_vl_tasks.screenspot_pro import FIELDS, screenspot_pro_report

    results = task.results(loaded, completions, FIELDS)
    reference = ref_evaluate([{**r, "group": r["group"]} for r in results])
    assert screenspot_pro_report(results) == reference
    assert reference["leaderboard_simple_style"]["group:None"]["num_total"] == 2


def test_screenspot_pro_rows_whose_img_size_is_not_their_image_are_refused_before_the_model_loads(tmp_path):
    """ScreenSpot-Pro normalises by the row's `img_size`; an image of another size would score every click at the
    wrong place, so the task refuses it in one sentence when it is built."""
    from gpg_vl.errors import UserError

    write_images(tmp_path / "images", {"a.png": (120, 100)})
    row = {"img_filename": "a.png", "bbox": [10, 10, 20, 20], "instruction": "click", "img_size": [100, 100],
           "application": "app", "platform": "linux", "ui_type": "text", "id": "r0"}
    (tmp_path / "a.json").write_text(json.dumps([row]))
    with pytest.raises(UserError, match=r"a\.json, row 0: row 'r0' gives img_size \[100, 100\] for a 120x100 image"):
        get_task("screenspot_pro", data_path=str(tmp_path / "a.json"), image_root=str(tmp_path / "images"))
