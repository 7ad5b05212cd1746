"""Write docs/configuration.md, the configuration reference, from the settings schema (gpg_vl/config/schema.py).

    python scripts/gen_config_docs.py            # rewrite docs/configuration.md
    python scripts/gen_config_docs.py --check    # exit 1 if docs/configuration.md is not what it would write

Every key of configs/train.yaml and configs/eval.yaml gets one row: key, where it applies, type, default, what is
allowed and its one-line meaning, all read from the schema's fields and their metadata (`meta`); the allowed
values are those gpg_vl/config/validate.py checks. tests/unit/test_config_docs.py fails when the page differs from
what this script writes. It imports neither torch nor transformers: choices that come from a registry or a
library are named by their source (schema.CHOICE_SOURCES), not listed.
"""

from __future__ import annotations

import re
import sys
import typing
from dataclasses import Field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's gpg_vl

from gpg_vl.config.keys import declared, default_of, key_of  # noqa: E402
from gpg_vl.config.rules import value_type  # noqa: E402
from gpg_vl.config.schema import CHOICE_SOURCES, EvalSchema, TrainSchema  # noqa: E402
from gpg_vl.config.validate import rule_for  # noqa: E402

PAGE = ROOT / "docs" / "configuration.md"
SECTIONS = [  # (heading, key prefix, what it is)
    ("trainer", "trainer.", "The optimisation, the policy-gradient objective, the update's throughput paths, "
                            "checkpoints and logging (`TrainerSettings`). Training only; a task config's `trainer.*` "
                            "values are accepted and ignored by evaluation."),
    ("rollout", "rollout.", "Sampling the G completions of each prompt, through the engine `rollout.engine` names "
                            "(`RolloutSettings`); evaluation decodes through the same engine. Each engine's own "
                            "settings are `rollout.<engine>.*` and each tool's `rollout.tools.<tool>.*`, declared "
                            "by the engine and the tool (`gpg_vl/rollout/settings.py` for the built-ins; an "
                            "out-of-tree engine or tool declares its own: [Extending](extending.md))."),
    ("eval", "eval.", "Evaluation of the held-out split, during training and by `scripts/eval.py` "
                      "(`EvalSettings`): greedy, or `eval.samples` completions per row ([Evaluation](evaluation.md))."),
    ("model", "model.", "Which model, how it is loaded and how it is trained (`ModelSettings`, `LoraSettings`): the "
                        "one home of the model defaults; a model alias (`model=<alias>`, `configs/model/`) sets "
                        "only what differs, e.g. `name_or_path` and `family`."),
    ("data", "data.", "Where the task's data is read from, and how many bad rows a run tolerates (`DataSettings`)."),
    ("task", "task.", "The task plugin (`TaskSettings`); `task=<name>` selects `configs/task/<name>.yaml`, which "
                      "sets both keys and the paper's trainer settings for the task."),
    ("reward", "reward.", "Reward settings of the run, whatever the task (`RewardSettings`, `JudgeSettings`): the "
                          "LLM judge a task asks where no rule scores an answer ([Tasks: the LLM judge]"
                          "(tasks.md#the-llm-judge)); training and evaluation alike."),
    ("teacher", "teacher.", "On-policy distillation from a frozen teacher on the student's own samples "
                            "(`TeacherSettings`; [Distillation](distillation.md)); training only."),
    ("top-level", "", "The run's own keys (`TrainSchema`, `EvalSchema`)."),
]


def keys() -> dict[str, dict[str, Field]]:
    """Every leaf key -> {"train": field, "eval": field} for the configs that declare it, in the schema's order."""
    table: dict[str, dict[str, Field]] = {}
    for config, schema in (("train", TrainSchema), ("eval", EvalSchema)):
        for name, item in declared(schema):
            if item.type is typing.Any and name in ("trainer",):  # eval.yaml accepts trainer.* and ignores it
                continue
            table.setdefault(name, {})[config] = item
    return table


def type_text(item: Field) -> str:
    hint, optional = value_type(item)
    name = "any" if hint is typing.Any else getattr(typing.get_origin(hint) or hint, "__name__", str(hint))
    return f"{name} or null" if optional else name


def value_text(value) -> str:
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, list | tuple):
        return "`[" + ", ".join(str(v) for v in value) + "]`"
    if isinstance(value, str) and not value:
        return "`''`"
    return f"`{value}`"


def allowed_text(item: Field) -> str:
    key, rule = key_of(item), rule_for(item)
    if rule is None:
        hint, optional = value_type(item)
        return ("a string" if hint is str else "any") + (" or null" if optional and hint is str else "")
    if key is not None and isinstance(key.choices, str):  # a registry or a library: named, not imported
        text = CHOICE_SOURCES[key.choices]
        text += ", or module:name / path.py:name" if key.references else ""
        text += " or null" if rule.optional else ""
        return f"{text} ({rule.note})" if rule.note else text
    return rule.allowed()


def cell(text: str) -> str:
    """Text for a table cell: outside code spans, `|`, `<` and `*` escaped (no column break, HTML or emphasis)."""
    parts = text.replace("\n", " ").split("`")
    for index in range(0, len(parts), 2):
        parts[index] = re.sub(r"<(?=[A-Za-z/!])", "&lt;", parts[index].replace("|", "\\|").replace("*", "\\*"))
    return "`".join(parts)


def default_text(where: dict[str, Field]) -> str:
    values = {config: default_of(item) for config, item in where.items()}
    if len(set(map(repr, values.values()))) == 1:
        return value_text(next(iter(values.values())))
    return "; ".join(f"{config}: {value_text(value)}" for config, value in values.items())


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (ROOT / "configs" / group).glob("*.yaml") if not p.stem.startswith("_"))


def render() -> str:
    table = keys()
    lines = [
        "# Configuration reference",
        "",
        "Generated from the schema (`gpg_vl/config/schema.py`) by `python scripts/gen_config_docs.py`; do not edit",
        "by hand. Change a key's type, default, range or meaning where it is declared, in the schema, and run the",
        "generator again; `tests/unit/test_config_docs.py` fails while this page and the schema disagree.",
        "",
        "Every key is set on the command line as `key=value`: `python scripts/train.py trainer.lr=1e-6` (training,",
        "`configs/train.yaml`) or `python scripts/eval.py eval.limit=200` (evaluation, `configs/eval.yaml`; the",
        "*in* column says which of the two has the key). An unknown key fails with the list of valid ones, a value",
        "of the wrong type or outside *allowed* with one sentence naming the key, before any model loads.",
        "`python scripts/train.py --cfg job` prints every key with its value.",
        "",
        "*default* is the schema's default. A config group may set other values: the model alias (`model=`, default",
        "`tiny`: `embedded:tiny-qwen2.5-vl` in float32 at 224 x 224 pixels at most), the task (`task=`, default",
        "`shapes`, whose config sets a short CPU run: `trainer.max_steps=150`, `trainer.batch_size=16`,",
        "`trainer.lr=1e-4`, ...) and the algorithm preset (`algorithm=`, training only). A few rules tie two keys",
        "together (`trainer.group_size=1` needs `trainer.advantage=none`; `model.min_pixels <= model.max_pixels`;",
        "`trainer.ppo_mini_batch` a multiple of `trainer.group_size`; ...); they are checked after the ranges.",
        "",
        "## Config groups",
        "",
        "| group | options (files in `configs/<group>/`) |",
        "|---|---|",
    ]
    for group, words in (("model", "`model=<alias>`, or `model=/path/to/dir`"), ("task", "`task=<name>`, or "
                         "`task=module:Class` / `task=path/to/file.py:Class`"),
                         ("algorithm", "`algorithm=<name>` (training only)"),
                         ("experiment", "`+experiment=<name>`: a paper recipe (task, the paper's model, settings)")):
        lines.append(f"| {words} | {', '.join(f'`{name}`' for name in group_options(group))} |")
    for heading, prefix, about in SECTIONS:
        rows = [(name, where) for name, where in table.items()
                if (name.startswith(prefix) if prefix else "." not in name)]
        lines += ["", f"## {heading}", "", about, "", "| key | in | type | default | allowed | meaning |",
                  "|---|---|---|---|---|---|"]
        for name, where in rows:
            item = next(iter(where.values()))
            meaning = key_of(item).help if key_of(item) is not None else ""
            lines.append(f"| `{name}` | {', '.join(where)} | {type_text(item)} | {cell(default_text(where))} | "
                         f"{cell(allowed_text(item))} | {cell(meaning)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is out of date: run `python scripts/gen_config_docs.py`.", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)} ({len(table_rows(text))} keys)")
    return 0


def table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| `")]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
