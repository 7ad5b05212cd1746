"""Scan a task's data for the rows training would skip, and print the report a run logs; no model is loaded.

    python scripts/validate_data.py task=geoqa data.path=/data/geoqa_test.jsonl data.image_root=/data
    python scripts/validate_data.py task=lisa data.path=/data/reasonseg split=train
    python scripts/validate_data.py task=cvbench split=test limit=500

Every row goes through the checks of training (the row is read, the task's `check_row` and `messages` run, its
images are decoded), and bad rows are counted by reason. `split=` names the split (default: the task's train
split) and `limit=` scans the first N rows only; the other keys are those of configs/train.yaml (task=, data.*).
When more than data.max_bad_fraction of the rows are bad, it ends with the sentence a run would stop with
(exit status 2).
"""

import sys

from tqdm.auto import tqdm

from gpg_vl.cli import build_task
from gpg_vl.config.compose import run_cli
from gpg_vl.data.stream import scan_rows
from gpg_vl.data.task import load_split
from gpg_vl.errors import UserError


def validate_main(cfg, *, split: str | None, limit: int | None) -> None:
    task = build_task(cfg.task, cfg.data)
    split = split or task.train_split
    rows = load_split(task, split)
    rows = rows[:limit] if limit else rows
    with tqdm(total=len(rows), desc=f"{task.name}/{split}", dynamic_ncols=True, file=sys.stderr) as bar:
        _, log = scan_rows(task, rows, max_bad_fraction=cfg.data.max_bad_fraction, kept=None,
                           progress=lambda _: bar.update(1))
    print(log.report(f"{task.name} / {split}"))
    if log.over_limit():
        raise UserError(log.stop_message())


def main(argv: list[str]) -> int:
    options = {"split": None, "limit": None}
    rest = []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key in options and value:
            options[key] = value
        else:
            rest.append(arg)
    try:
        limit = int(options["limit"]) if options["limit"] else None
    except ValueError:
        print(f"error: limit={options['limit']!r} is not a whole number; give limit=N.", file=sys.stderr)
        return 2
    return run_cli("train", lambda cfg: validate_main(cfg, split=options["split"], limit=limit), rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
