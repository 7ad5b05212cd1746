"""`geoqa`: geometry problems with a numeric answer (the paper's GeoQA experiment).

Train rows come from `leonardPKU/GEOQA_R1V_Train_8K` (`image`, `problem`, `solution` = `<answer>N</answer>`).
The GeoQA test set (754 items) has no Hub copy: it is a jsonl of `{"image_path": "./Geo170K/images/test/N.png",
"question", "ground_truth"}` given as data.path, its image paths resolving against data.image_root (by default the
jsonl's folder). A data.path serves whichever split is asked, so rows of either layout are read by their columns.
The accuracy reward is mathematical equality with the answer, read as GeoQA writes it (`math_reward` with
`strip_units`: "140°" and "140" agree, "2√{3}" and "2\\sqrt{3}", "4πcm" and "4\\pi", "27cm^{2}" and "27").
"""

from __future__ import annotations

from gpg_vl.data.sources import RowView, load_rows
from gpg_vl.data.task import Task, checked_text, column_text, image_question, register_task, require_text
from gpg_vl.errors import UserError
from gpg_vl.reward.primitives import extract_answer, format_reward, math_reward

HUB_ID = "leonardPKU/GEOQA_R1V_Train_8K"
TRAIN_COLUMNS = ("image", "problem", "solution")  # the Hub's train layout
TEST_COLUMNS = ("image_path", "question", "ground_truth")  # the GeoQA test jsonl's layout
INSTRUCTION = "  Output the thinking process in <think> </think> and final answer (number) in <answer> </answer> tags."


@register_task
class GeoQA(Task):
    """GeoQA geometry: numeric answers; accuracy (math equality) + format rewards."""

    name = "geoqa"

    def __init__(self) -> None:
        super().__init__()
        self.reward_functions = {
            "accuracy": lambda completion, row: math_reward(completion, row["answer"], strip_units=True),
            "format": lambda completion, row: format_reward(completion),
        }
        self.reward_weights = {"accuracy": 1.0, "format": 1.0}

    def load(self, split: str) -> RowView:
        if self.data_path is None and split == self.eval_split:
            raise UserError(
                "the GeoQA test split has no Hub copy; pass data.path=/path/to/geoqa_test.jsonl and "
                "data.image_root=/path/with/Geo170K (the folder holding Geo170K/images/test)."
            )
        rows = load_rows(HUB_ID, split, path=self.data_path)
        columns = set(rows.column_names)
        if set(TEST_COLUMNS) <= columns:
            return RowView(rows, self._test_row)
        if set(TRAIN_COLUMNS) <= columns:
            return RowView(rows, lambda index, row: self._train_row(row, index, split))
        where = repr(self.data_path) if self.data_path else f"dataset {HUB_ID!r}"
        raise UserError(
            f"split {split!r} of {where} has columns {rows.column_names}, neither GeoQA layout; give rows with "
            f"{list(TRAIN_COLUMNS)} (the Hub's train set) or {list(TEST_COLUMNS)} (the GeoQA test jsonl)."
        )

    def _test_row(self, index: int, row: dict) -> dict:
        row["id"] = row["image_path"]
        targets = self.prepare_targets(row)  # before the image: a row without a target is not decoded
        image = self.open_image(row["image_path"], row=index)
        return {**row, "image": image, **targets}

    def _train_row(self, row: dict, index: int, split: str) -> dict:
        row["id"] = f"geoqa-{split}-{index}"
        targets = self.prepare_targets(row)
        image = self.open_image(row["image"], row=index)
        return {**row, "image": image, "question": row["problem"], **targets}

    def prepare_targets(self, row: dict) -> dict:
        """`answer`: the test layout's `ground_truth`, or the content of the train layout's `solution` tag (the
        whole solution when it has none). A missing, null, blank, NaN or infinite target raises `BadRow`."""
        if "ground_truth" in row:
            return {"answer": column_text(row, "ground_truth")}
        solution = column_text(row, "solution")
        answer = extract_answer(solution)
        return {"answer": solution if answer is None else checked_text(answer, row, "answer", "'solution' tag")}

    def check_row(self, row: dict) -> None:
        """A question and an answer, in the columns of either layout."""
        require_text(row, question="question" if "ground_truth" in row else "problem")
        super().check_row(row)

    def messages(self, row: dict) -> list[dict]:
        return image_question(row["image"], row["question"] + INSTRUCTION)
