"""Shared set-up of the integration tests that train the embedded default: a quick run that checkpoints every
step (4 prompts x 4 completions of 16 tokens, no evaluation, every group forwarded)."""

from gpg_vl.cli import train_main
from gpg_vl.config.compose import load_config

QUICK_RUN = ["trainer.eval_before=false", "trainer.eval_after=false", "trainer.batch_size=4", "trainer.group_size=4",
             "rollout.max_new_tokens=16", "trainer.save_every=1", "trainer.keep_checkpoints=5", "trainer.beta_th=0"]


def train_run(output_dir, *overrides) -> dict:
    """train_main on QUICK_RUN plus `overrides`, writing to `output_dir`; the run's summary."""
    return train_main(load_config("train", [f"output_dir={output_dir}", *QUICK_RUN, *overrides]))


def tiny_family_policy(family: str, tmp_path_factory):
    """A float32 tiny model of `family`: the embedded Qwen2.5-VL, or a random one of the family's real classes
    built under pytest's temporary folder (seeded, so every build of a family is the same)."""
    import torch

    from gpg_vl.models.load import load_policy
    from gpg_vl.models.tiny import EMBEDDED_TINY, build_tiny_family

    path = EMBEDDED_TINY
    if family != "qwen2_5_vl":
        path = tmp_path_factory.mktemp("tiny") / family
        build_tiny_family(path, family)
    torch.manual_seed(0)
    return load_policy(str(path), family="auto", dtype="float32", min_pixels=3136, max_pixels=50176)
