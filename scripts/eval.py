"""Evaluate a model on a task with batched greedy decoding, or re-score saved predictions.

    python scripts/eval.py                                           # tiny model on the shapes test split
    python scripts/eval.py task=shapes model.name_or_path=outputs/run/final eval.limit=100
    python scripts/eval.py task=shapes predictions=outputs/eval/.../predictions.jsonl   # no model loaded
"""

import sys

from gpg_vl.cli import eval_main
from gpg_vl.config.compose import run_cli

if __name__ == "__main__":
    sys.exit(run_cli("eval", eval_main))
