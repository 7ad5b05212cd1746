"""`screenspot`: ScreenSpot (SeeClick) and ScreenSpot-v2 (OS-Atlas' corrected labels), GUI grounding on mobile,
desktop and web screenshots, scored as SeeClick's `pretrain/screenspot_test.py` scores it. Evaluation only.

Published as three json files per version, `screenspot_{mobile,desktop,web}.json` (v2:
`screenspot_{mobile,desktop,web}_v2.json`), each a list of rows `{"img_filename", "bbox": [x, y, w, h] (pixels),
"instruction", "data_type": "text" | "icon", "data_source": "ios" | "android" | "macos" | "windows" | a web
site}`, with the screenshots in a folder beside them (`screenspot_imgs/`, v2 `screenspotv2_image/`). Pass the
folder of json files (or one file) as data.path and the image folder as data.image_root.

Scoring, as SeeClick's: the box becomes (x, y, x + w, y + h), and the box and the click are divided by the image's
size (W, H); the click is right when `x1 <= x <= x2 and y1 <= y <= y2`; an answer without a click is a wrong
format (counted wrong). A box answer is read as its centre. The platform of a row is its `platform` column, else
its file's (mobile, desktop or web in the file name, as SeeClick evaluates one file per platform), else its
`data_source` (ios or android: mobile; macos or windows: desktop; anything else: web, as lmms-eval groups them).

Metrics, SeeClick's per platform and overall (ScreenSpot-Pro's `calc_metric_for_result_list` computes the same):
`accuracy` (all rows: the tables' "Avg."), `text_acc`, `icon_acc`, `num_correct_action`, `num_total`,
`wrong_format_num`, and `<platform>/<metric>` for each (the tables' columns: `mobile/text_acc` is "Mobile
Text").
"""

from __future__ import annotations

from collections.abc import Sequence

from gpg_vl.data.task import register_task
from gpg_vl.errors import UserError

from .gui import GuiTask, accuracy_counts

PLATFORMS = ("mobile", "desktop", "web")
MOBILE, DESKTOP = ("ios", "android"), ("macos", "windows")


def platform_of(row: dict) -> str:
    """A row's platform: its `platform`, else its file's name, else its `data_source` (see the module doc)."""
    if row.get("platform"):
        return str(row["platform"])
    source = str(row.get("source", ""))
    named = [platform for platform in PLATFORMS if platform in source]
    if len(named) == 1:
        return named[0]
    data_source = str(row.get("data_source", ""))
    if any(name in data_source for name in MOBILE):
        return "mobile"
    return "desktop" if any(name in data_source for name in DESKTOP) else "web"


def seeclick_report(results: Sequence[dict]) -> dict[str, dict[str, float]]:
    """{"overall": ..., "<platform>": ...}: `accuracy_counts` of all results and of each platform's."""
    report = {"overall": accuracy_counts(results)}
    for platform in sorted({r["platform"] for r in results}):
        report[platform] = accuracy_counts([r for r in results if r["platform"] == platform])
    return report


@register_task
class ScreenSpot(GuiTask):
    """ScreenSpot / ScreenSpot-v2 (1,272 rows in v2): a click inside the target box; accuracy per platform and
    element type."""

    name = "screenspot"
    train_split = "test"  # one split
    eval_split = "test"
    box_format = "xywh"
    group_columns = ("platform", "data_type")

    def load(self, split: str):
        if self.data_path is None:
            raise UserError("ScreenSpot's annotation files are not on the Hugging Face Hub in their published form; "
                            "pass data.path=/path/to/screenspot (the folder of screenspot_*.json) and "
                            "data.image_root=/path/to/screenspot_imgs.")
        return self.load_records(split)

    def prepared(self, row: dict) -> dict:
        return {**super().prepared(row), "platform": platform_of(row)}

    def metrics(self, rows: Sequence[dict], completions: Sequence[str],
                scores: Sequence[dict] | None = None) -> dict[str, float]:
        """The reward means, then SeeClick's numbers (see the module doc)."""
        rows = [{**row, "platform": platform_of(row)} for row in map(self.scoring_row, rows)]
        result = {name: value for name, value in super().metrics(rows, completions, scores).items()
                  if name.startswith("reward/")}
        report = seeclick_report(self.results(rows, completions, ("platform",)))
        overall = report.pop("overall")
        result["accuracy"] = overall.pop("action_acc")
        result.update(overall)
        for platform, numbers in report.items():
            result.update({f"{platform}/{name}": value for name, value in numbers.items()})
        return result
