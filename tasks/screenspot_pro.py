"""`screenspot_pro`: ScreenSpot-Pro, GUI grounding on high-resolution professional software, scored as its
`eval_screenspot_pro.py` (likaixin2000/ScreenSpot-Pro-GUI-Grounding) scores it. Evaluation only.

Published as `annotations/<application>_<platform>.json` files, each a list of rows `{"img_filename", "bbox":
[x1, y1, x2, y2] (pixels), "instruction", "instruction_cn", "img_size": [W, H], "application", "platform",
"group", "ui_type": "text" | "icon", "id"}`, the screenshots under `images/`. Pass the annotations folder (or one
file) as data.path and the images folder as data.image_root.

As the script does, the rows are evaluated once per instruction style x ground-truth type x language named by the
options `inst_style`, `gt_type` and `language` (each one value or "all"; the published setting is instruction,
positive, en): the style is a label only (every style shows the row's `instruction`), Chinese shows
`instruction_cn` and exists for the instruction style and positive rows only. A negative row asks for the same
element, and only a refusal is right (`REFUSALS` of gpg_vl/reward/gui.py, "not found" in the prompt's words).

Scoring, as the script's: the box and the click both divided by `img_size`; right when `x1 <= x <= x2 and y1 <= y <=
y2`; a positive row without a click is `wrong_format` (and wrong); a negative row is right on a refusal, wrong on a
click, else wrong format. Reported as its `evaluate(results)["metrics"]` reports (`screenspot_pro_report`): the
`overall` numbers (`accuracy` is its `action_acc`; `text_acc`, `icon_acc`, `num_correct_action`, `num_total`,
`wrong_format_num`), and the accuracies `<key>/action_acc`, `<key>/text_acc`, `<key>/icon_acc` of each key of its
four breakdowns: `group:<group>` (the leaderboard's table), `app:<application>`, `plat:<platform>
inst_style:<style> gt_type:<type>` (SeeClick's style) and `plat:... app:... inst_style:... gt_type:...`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from gpg_vl.data.sources import RowView
from gpg_vl.data.task import register_task
from gpg_vl.errors import UserError

from .gui import GuiTask, accuracy_counts

INSTRUCTION_STYLES = ("instruction", "action", "description")
GT_TYPES = ("positive", "negative")
LANGUAGES = ("en", "cn")
# report section -> the attributes its keys combine, and how each is written in a key
STYLES = {
    "fine_grained": (("platform", "plat"), ("application", "app"), ("instruction_style", "inst_style"),
                     ("gt_type", "gt_type")),
    "seeclick_style": (("platform", "plat"), ("instruction_style", "inst_style"), ("gt_type", "gt_type")),
    "leaderboard_simple_style": (("group", "group"),),
    "leaderboard_detailed_style": (("application", "app"),),
}
FIELDS = ("platform", "group", "application", "language", "gt_type", "instruction_style")


def chosen(value: str, allowed: Sequence[str], option: str) -> list[str]:
    """The values an option names: one, several (comma-separated) or "all"."""
    values = list(allowed) if value == "all" else [v.strip() for v in str(value).split(",")]
    wrong = [v for v in values if v not in allowed]
    if wrong:
        raise UserError(f"task screenspot_pro has no {option} {', '.join(wrong)}; set task.options.{option} to "
                        f"{', '.join(allowed)} or all.")
    return values


def screenspot_pro_report(results: Sequence[dict]) -> dict[str, dict]:
    """The metrics of ScreenSpot-Pro's `evaluate(results)`: for each breakdown the keys it makes from the values the
    results hold (every combination of them; a value None filters nothing, as its `collect_results_to_eval` reads
    None) and each key's `accuracy_counts`, keys without a result left out; and `overall`."""
    report = {}
    for style, attributes in STYLES.items():
        values = [sorted({r.get(field) for r in results}, key=str) for field, _ in attributes]
        section = {}
        for combination in itertools.product(*values):
            kept = [r for r in results if all(value is None or r.get(field) == value
                                              for (field, _), value in zip(attributes, combination, strict=True))]
            if kept:
                key = " ".join(f"{short}:{value}" for (_, short), value in zip(attributes, combination, strict=True))
                section[key] = accuracy_counts(kept)
        report[style] = section
    report["overall"] = accuracy_counts(results)
    return report


@register_task
class ScreenSpotPro(GuiTask):
    """ScreenSpot-Pro (1,581 rows, 23 applications, 6 groups): a click inside the target box, or a refusal on a
    negative row; its script's breakdowns."""

    name = "screenspot_pro"
    train_split = "test"  # one split
    eval_split = "test"
    box_format = "xyxy"
    group_columns = ("group", "ui_type")

    def __init__(self, rewards: str | Sequence[str] = ("point_in_box",), answer: str = "point",
                 format_weight: float = 0.2, weights: dict | None = None, inst_style: str = "instruction",
                 gt_type: str = "positive", language: str = "en") -> None:
        super().__init__(rewards=rewards, answer=answer, format_weight=format_weight, weights=weights)
        self.styles = chosen(inst_style, INSTRUCTION_STYLES, "inst_style")
        self.gt_types = chosen(gt_type, GT_TYPES, "gt_type")
        self.languages = chosen(language, LANGUAGES, "language")
        if "cn" in self.languages and (self.styles != ["instruction"] or self.gt_types != ["positive"]):
            raise UserError("ScreenSpot-Pro's Chinese instructions exist for inst_style=instruction and "
                            "gt_type=positive only (as its script says); set those options, or language=en.")

    def load(self, split: str) -> RowView:
        if self.data_path is None:
            raise UserError("ScreenSpot-Pro's annotation files are not on the Hugging Face Hub as a dataset; pass "
                            "data.path=/path/to/ScreenSpot-Pro/annotations and "
                            "data.image_root=/path/to/ScreenSpot-Pro/images.")
        records = self.load_records(split).rows
        expanded = [{**record, "instruction_style": style, "gt_type": gt_type, "language": language}
                    for record in records for style in self.styles for gt_type in self.gt_types
                    for language in self.languages]
        return RowView(expanded, lambda index, row: self.prepared(row))

    def prepared(self, row: dict) -> dict:
        base = row.get("id", f"{row.get('source', self.name)}-{row.get('number', 0)}")
        row = {**row, "id": f"{base}:{row['instruction_style']}:{row['gt_type']}:{row['language']}"}
        if row["language"] == "cn":
            row["instruction"] = row.get("instruction_cn")
        return {**row, **self.prepare_targets(row)}

    def metrics(self, rows: Sequence[dict], completions: Sequence[str],
                scores: Sequence[dict] | None = None) -> dict[str, float]:
        """The reward means, then the script's report (see the module doc)."""
        result = {name: value for name, value in super().metrics(rows, completions, scores).items()
                  if name.startswith("reward/")}
        report = screenspot_pro_report(self.results(rows, completions, FIELDS))
        overall = report.pop("overall")
        result["accuracy"] = overall.pop("action_acc")
        result.update(overall)
        for section in report.values():
            for key, numbers in section.items():
                result.update({f"{key}/{name}": numbers[name] for name in ("action_acc", "text_acc", "icon_acc")})
        return result
