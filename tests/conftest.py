"""Shared fixtures: the embedded tiny model and the synthetic task; nothing is downloaded."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One torch thread: several tests compare two runs bit for bit (resume, equal weights), and with more threads a
# multithreaded CPU kernel on the prompt-once update path can round differently from one run to the next.
os.environ["OMP_NUM_THREADS"] = "1"  # for the training subprocesses the tests start
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def shapes():
    from gpg_vl import get_task

    return get_task("shapes", train_size=2000, test_size=40)


@pytest.fixture()
def policy():
    from gpg_vl.models.load import load_policy

    torch.manual_seed(0)
    return load_policy("embedded:tiny-qwen2.5-vl", dtype="float32", min_pixels=3136, max_pixels=50176)
