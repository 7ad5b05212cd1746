"""`classification`: few-shot fine-grained classification, Visual-RFT's 4-shot sets (the paper's third experiment).

Rows have the published columns `image`, `problem` (the training instruction) and `solution`
(`<answer>class name</answer>`); the label is the content of the solution's answer tag. The option `dataset`
picks one of the four Hub copies (`DATASETS`); any dataset with those columns works through `data.path=`.

The Hub copies hold the 4-shot `train` split only; the evaluation rows (the datasets' validation images, split
`validation`) come from `data.path=` in the same columns, or another split through `eval.split=`.

Prompt: Visual-RFT's evaluation prompt, the same for train and eval rows, so that training optimises the
prompt the model is scored on (`prompt="problem"` uses each row's published `problem` column instead).
Rewards: `accuracy` (normalized label match, synonyms allowed, an empty answer scores 0) and `format`.
"""

from __future__ import annotations

from gpg_vl.data.sources import RowView, load_rows
from gpg_vl.data.task import Task, checked_text, column_text, image_question, register_task, require_text
from gpg_vl.errors import UserError
from gpg_vl.reward.primitives import extract_answer, format_reward, label_reward, normalize_text

# option value -> (Hub id, object named in the prompt, what to identify)
DATASETS = {
    "flower": ("laolao77/ViRFT_CLS_flower_4_shot", "plant", "species"),
    "pets37": ("laolao77/ViRFT_CLS_pets37_4shot", "pet", "breed"),
    "aircraft": ("laolao77/ViRFT_CLS_fgvc_aircraft_4_shot", "aircraft", "model"),
    "cars196": ("laolao77/ViRFT_CLS_car196_4shot", "car", "model"),
}
PROMPTS = ("evaluation", "problem")
COLUMNS = ("image", "problem", "solution")
INSTRUCTION = "Output the thinking process in <think> </think> and final answer in <answer> </answer> tags."


def evaluation_prompt(dataset: str) -> str:
    """Visual-RFT's evaluation prompt for `dataset`, e.g. 'This is an image containing a plant. Please identify
    the species of the plant based on the image. Output the thinking process in ...'."""
    _, thing, kind = DATASETS[dataset]
    article = "an" if thing[0] in "aeiou" else "a"
    return f"This is an image containing {article} {thing}. Please identify the {kind} of the {thing} based on the " \
           f"image. {INSTRUCTION}"


def solution_label(solution: str) -> str:
    """The class name of a `solution`: its last `<answer>` content, or the whole text when it has no tag."""
    answer = extract_answer(str(solution))
    return (answer if answer is not None else str(solution)).strip()


@register_task
class Classification(Task):
    """Few-shot classification (flower, pets37, aircraft, cars196): label-match accuracy + format rewards.

    Options: `dataset` (which of `DATASETS`: Hub id and prompt wording), `prompt` ("evaluation": Visual-RFT's
    evaluation prompt for every row; "problem": each row's `problem` column) and `synonyms` (class name ->
    extra accepted answers, added to a row's own `synonyms` column when it has one).
    """

    name = "classification"
    eval_split = "validation"  # the datasets' validation images (REFERENCE.md); pass them through data.path

    def __init__(self, dataset: str = "flower", prompt: str = "evaluation",
                 synonyms: dict[str, list[str]] | None = None) -> None:
        super().__init__()
        if dataset not in DATASETS:
            raise UserError(f"task classification has no dataset {dataset!r}; set task.options.dataset to one of "
                            f"{', '.join(DATASETS)}.")
        if prompt not in PROMPTS:
            raise UserError(f"task classification has no prompt {prompt!r}; set task.options.prompt to one of "
                            f"{', '.join(PROMPTS)}.")
        self.dataset, self.prompt = dataset, prompt
        self.synonyms = {normalize_text(k): [str(s) for s in v] for k, v in (synonyms or {}).items()}
        self.reward_functions = {
            "accuracy": lambda completion, row: label_reward(completion, row["labels"]),
            "format": lambda completion, row: format_reward(completion),
        }
        self.reward_weights = {"accuracy": 1.0, "format": 1.0}

    def load(self, split: str) -> RowView:
        hub_id = DATASETS[self.dataset][0]
        rows = load_rows(hub_id, split, path=self.data_path, required_columns=COLUMNS)
        return RowView(rows, self._prepare)

    def _prepare(self, index: int, row: dict) -> dict:
        """Adds `id` (the row's own, else its index) and the targets (`prepare_targets`)."""
        row["id"] = str(row["id"]) if row.get("id") is not None else str(index)
        return {**row, **self.prepare_targets(row)}

    def prepare_targets(self, row: dict) -> dict:
        """`answer`, the label (`solution_label` of `solution`), and `labels`: the label and its synonyms (the
        row's own `synonyms` column, then the `synonyms` option's). A missing or blank label raises `BadRow`."""
        label = checked_text(solution_label(column_text(row, "solution")), row, "answer", "'solution'")
        own = row.get("synonyms") or []
        extra = [own] if isinstance(own, str) else [str(s) for s in own]
        extra += self.synonyms.get(normalize_text(label), [])
        return {"answer": label, "labels": [label, *extra]}

    def check_row(self, row: dict) -> None:
        """A solution whose label is not blank (and a problem text when the prompt is each row's own)."""
        super().check_row(row)
        if self.prompt == "problem":
            require_text(row, question="problem")

    def messages(self, row: dict) -> list[dict]:
        image = self.open_image(row["image"], row=row["id"])
        text = evaluation_prompt(self.dataset) if self.prompt == "evaluation" else str(row["problem"])
        return image_question(image, text)
