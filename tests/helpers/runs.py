"""Shared set-up of the integration tests that train the embedded default: a quick run that checkpoints every
step (4 prompts x 4 completions of 16 tokens, no evaluation, every group forwarded)."""

from gpg_vl.cli import train_main
from gpg_vl.config.compose import load_config

QUICK_RUN = ["trainer.eval_before=false", "trainer.eval_after=false", "trainer.batch_size=4", "trainer.group_size=4",
             "rollout.max_new_tokens=16", "trainer.save_every=1", "trainer.keep_checkpoints=5", "trainer.beta_th=0"]


def train_run(output_dir, *overrides) -> dict:
    """train_main on QUICK_RUN plus `overrides`, writing to `output_dir`; the run's summary."""
    return train_main(load_config("train", [f"output_dir={output_dir}", *QUICK_RUN, *overrides]))


def untimed(metrics: dict) -> dict:
    """A step's metrics without the wall-clock ones (WALL_CLOCK_METRICS): what two runs of one seed agree on."""
    from gpg_vl.train.loop import WALL_CLOCK_METRICS

    return {k: v for k, v in metrics.items() if k not in WALL_CLOCK_METRICS}


_BUILT: dict = {}  # family -> its folder, built once per test process (the session's temporary folder)


def tiny_family_path(family: str, tmp_path_factory):
    """The folder of `family`'s tiny model: the embedded Qwen2.5-VL, or a random one of the family's real classes
    built under pytest's temporary folder the first time a test of this process asks (seeded, so every build of a
    family is the same: building it once changes nothing a test sees)."""
    from gpg_vl.models.tiny import EMBEDDED_TINY, build_tiny_family

    if family == "qwen2_5_vl":
        return EMBEDDED_TINY
    if family not in _BUILT:
        path = tmp_path_factory.mktemp("tiny") / family
        build_tiny_family(path, family)
        _BUILT[family] = path
    return _BUILT[family]


def tiny_family_policy(family: str, tmp_path_factory):
    """A float32 tiny model of `family` (tiny_family_path), loaded afresh: a test may change it."""
    import torch

    from gpg_vl.models.load import load_policy

    path = tiny_family_path(family, tmp_path_factory)
    torch.manual_seed(0)
    return load_policy(str(path), family="auto", dtype="float32", min_pixels=3136, max_pixels=50176)
