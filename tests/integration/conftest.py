"""Fixtures the integration tests share."""

import pytest
from helpers.vllm_real import served  # noqa: F401 (the shared real vLLM server, one test at a time on it)


@pytest.fixture()
def no_model(monkeypatch):
    """Fail the test if the policy model starts loading: the checks under test must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the check")

    monkeypatch.setattr("gpg_vl.train.build.build_policy", refuse)


@pytest.fixture(scope="session")
def model_aliases(tmp_path_factory):
    """Every model alias (configs/model/, all but the shared _tiny) -> the model settings of its composed train
    config: composed once per test run for the tests that read them all (48 compositions; helpers/once.py shares
    them between the workers), read back as OmegaConf configs."""
    from helpers.once import once
    from omegaconf import OmegaConf

    def make(folder):
        from gpg_vl.config.compose import group_options, load_config

        composed = {alias: load_config("train", [f"model={alias}"]).model for alias in group_options("model")}
        (folder / "aliases.yaml").write_text(OmegaConf.to_yaml(composed))

    return OmegaConf.load(once(tmp_path_factory, "model-aliases", make) / "aliases.yaml")


@pytest.fixture(scope="module")
def perturbed_teacher(tmp_path_factory):
    """The embedded tiny model with every weight moved by noise: the same tokenizer, other log-probs."""
    import torch

    from gpg_vl.models.load import load_policy
    from gpg_vl.models.tiny import EMBEDDED_TINY

    folder = tmp_path_factory.mktemp("teacher")
    policy = load_policy(str(EMBEDDED_TINY), dtype="float32")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in policy.model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    policy.model.save_pretrained(folder)
    policy.processor.save_pretrained(folder)
    return folder
