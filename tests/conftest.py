"""Shared fixtures: the embedded tiny model and the synthetic task; nothing is downloaded."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def shapes():
    from gpg_vl import get_task

    return get_task("shapes", train_size=2000, test_size=40)


@pytest.fixture()
def policy():
    from gpg_vl.models.base import load_policy

    torch.manual_seed(0)
    return load_policy("embedded:tiny-qwen2.5-vl", dtype="float32", min_pixels=3136, max_pixels=50176)
