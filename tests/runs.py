"""Shared set-up of the integration tests that train the embedded default: a quick run that checkpoints every
step (4 prompts x 4 completions of 16 tokens, no evaluation, every group forwarded)."""

from gpg_vl.cli import train_main
from gpg_vl.config.compose import load_config

QUICK_RUN = ["trainer.eval_before=false", "trainer.eval_after=false", "trainer.batch_size=4", "trainer.group_size=4",
             "rollout.max_new_tokens=16", "trainer.save_every=1", "trainer.keep_checkpoints=5", "trainer.beta_th=0"]


def train_run(output_dir, *overrides) -> dict:
    """train_main on QUICK_RUN plus `overrides`, writing to `output_dir`; the run's summary."""
    return train_main(load_config("train", [f"output_dir={output_dir}", *QUICK_RUN, *overrides]))
