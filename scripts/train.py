"""Train a vision-language model with GPG.

    python scripts/train.py                                  # tiny model, synthetic task, CPU, minutes
    python scripts/train.py +experiment=geoqa-paper          # a paper recipe: task, the paper's model, settings
    python scripts/train.py task=geoqa model=qwen2.5-vl-7b   # the task's paper settings on another model
    python scripts/train.py trainer.max_steps=10 --cfg job   # print the resolved config
"""

import sys

from gpg_vl.cli import train_main
from gpg_vl.config.compose import run_cli

if __name__ == "__main__":
    sys.exit(run_cli("train", train_main))
