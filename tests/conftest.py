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


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker more than the cores. A worker waiting on a test's child processes, a timeout or another
    worker's shared fixture leaves its core to the extra one: on this project's 2-core machine, 3 workers ran the
    suite in 17:18 where 2 took 18:47 (the same code, one after the other)."""
    return (os.cpu_count() or 1) + 1


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`-n auto --dist worksteal`, the default run) the slow tests start first, spread over the
    workers: worksteal hands each worker an equal contiguous share of the collection and a worker that runs out
    steals the back half of another's queue, so a long test left at the back of a share may start last, when the
    other workers are done, and the run waits for it alone. Here each share begins with its part of the slow tests
    (a module's together: they may share a module fixture); the order of the other tests is kept. One process
    (`-n 0`, `-p no:xdist`): the collection is left as it is."""
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    slow = [item for item in items if item.get_closest_marker("slow")]
    if workers < 2 or not slow:
        return
    by_module: dict[str, list] = {}
    for item in slow:
        by_module.setdefault(item.nodeid.split("::")[0], []).append(item)
    starts = [[] for _ in range(workers)]
    for module in sorted(by_module.values(), key=len, reverse=True):  # the most slow tests first, to the least filled
        min(starts, key=len).extend(module)
    rest = [item for item in items if not item.get_closest_marker("slow")]
    ordered, remaining = [], len(items)
    for k, start in enumerate(starts):
        share = remaining // (workers - k)  # worksteal's first share of the worker k
        take = max(0, share - len(start))
        ordered += start + rest[:take]
        rest = rest[take:]
        remaining -= share
    items[:] = ordered + rest
