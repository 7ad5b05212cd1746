"""Python processes for the tests, forked from a server that has imported torch, transformers and gpg-vl once.

A fresh `python scripts/train.py ...` spends about 10 s of CPU importing torch and transformers before its first
step (a 4-step run measured 17.3 s started fresh, 6.3 s forked, with the same weights bit for bit), and the suite
starts dozens of such processes: CLI runs, and each rank of every 2-process launch. multiprocessing's forkserver
imports `PRELOAD` once per test process and forks each process below from that server. Each is a new process
(it never ran a test) with its own argv, environment, working folder and output files; it runs the script as
`python script args` runs it (runpy, as `__main__`) and exits with the script's code.

What a forked process cannot change is whatever was read when torch was imported: OMP_NUM_THREADS (the suite's
1). A test that needs another value, or a process that must not import anything heavy (the light commands'
tests), starts a real interpreter with subprocess. The test of a failed save in a 2-process run still goes through
`accelerate launch` itself.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRELOAD = ["torch", "transformers", "accelerate", "gpg_vl.cli", "gpg_vl.train.loop", "gpg_vl.models.load"]


def context() -> multiprocessing.context.ForkServerContext:
    """The forkserver context, its server preloading `PRELOAD` (started on first use, once per test process)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _become(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """In the forked process: `python *argv` run in `cwd` with the environment `env`, its output in `out` and `err`
    (one file opened for appending when they are the same path)."""
    same = out == err
    for fd, path in ((1, out), (2, err)) if not same else ((1, out),):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if same else os.O_TRUNC), 0o644)
        os.dup2(file, fd)
        if same:
            os.dup2(file, 2)
        os.close(file)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102  (python -c)
    elif argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = str(Path(argv[0]).resolve())
        sys.argv = [script, *argv[1:]]
        sys.path.insert(0, str(Path(script).parent))  # as the interpreter puts a script's folder first
        runpy.run_path(script, run_name="__main__")


class Forked:
    """One forked `python *argv`, used like subprocess.Popen: `poll`, `wait`, `kill`, `pid`, `returncode`; and
    `result` for what subprocess.run(capture_output=True, text=True) returns. `output`: a file both streams are
    appended to (Popen's stdout=file, stderr=STDOUT); without it they are captured apart."""

    def __init__(self, argv: list[str], *, env: dict[str, str] | None = None, cwd: Path | str = ROOT,
                 output: Path | str | None = None) -> None:
        env = dict(os.environ if env is None else env)
        if env.get("OMP_NUM_THREADS") != os.environ.get("OMP_NUM_THREADS"):
            raise ValueError("a forked process keeps the suite's OMP_NUM_THREADS; start this one with subprocess")
        self.args, self.returncode = [sys.executable, *argv], None
        self.folder = None
        if output is None:
            self.folder = tempfile.TemporaryDirectory(prefix="gpg-vl-proc-")
            self.out, self.err = (os.path.join(self.folder.name, name) for name in ("out", "err"))
        else:
            self.out = self.err = str(output)
        self.process = context().Process(target=_become, args=(list(argv), env, str(cwd), self.out, self.err))
        self.process.start()
        self.pid = self.process.pid

    def poll(self) -> int | None:
        self.returncode = self.process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code (-N when signal N ended it); subprocess.TimeoutExpired when it outlives `timeout`."""
        self.process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.poll()

    def result(self, timeout: float | None = None) -> subprocess.CompletedProcess:
        """Its exit code and output; subprocess.TimeoutExpired (after killing it) when it outlives `timeout`."""
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise subprocess.TimeoutExpired(self.args, timeout, output=self._read(self.out),
                                            stderr=self._read(self.err)) from None
        done = subprocess.CompletedProcess(self.args, self.returncode, self._read(self.out), self._read(self.err))
        if self.folder is not None:
            self.folder.cleanup()
        return done

    @staticmethod
    def _read(path: str) -> str:
        with open(path, errors="replace") as file:
            return file.read()


def run(argv: list[str], *, env: dict[str, str] | None = None, cwd: Path | str = ROOT,
        timeout: float = 900) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=...)`,
    forked from the preloaded server."""
    return Forked(argv, env=env, cwd=cwd).result(timeout)


def launch(argv: list[str], *, env: dict[str, str], port: int, processes: int = 2, cwd: Path | str = ROOT,
           timeout: float = 900) -> subprocess.CompletedProcess:
    """The `processes` ranks of one machine as `accelerate launch` starts them through torchrun, forked: `env` is
    what accelerate's launcher puts in their environment (`prepare_multi_gpu_env` / `prepare_deepspeed_cmd_env`),
    and each rank gets torchrun's rank variables. Every rank ends by itself (none is killed when another fails:
    the tests check that a failure ends them all); the exit code is the first rank's non-zero code, or 0, and
    the output is the ranks' outputs in rank order."""
    ranks = []
    for rank in range(processes):
        torchrun = {"RANK": rank, "LOCAL_RANK": rank, "GROUP_RANK": 0, "ROLE_RANK": rank, "WORLD_SIZE": processes,
                    "LOCAL_WORLD_SIZE": processes, "GROUP_WORLD_SIZE": 1, "ROLE_WORLD_SIZE": processes,
                    "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                    "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": 0, "TORCHELASTIC_MAX_RESTARTS": 0}
        ranks.append(Forked(argv, env={**env, **{key: str(value) for key, value in torchrun.items()}}, cwd=cwd))
    deadline = time.monotonic() + timeout
    try:
        done = [rank.result(max(0.0, deadline - time.monotonic())) for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
    code = next((d.returncode for d in done if d.returncode != 0), 0)
    return subprocess.CompletedProcess([sys.executable, *argv], code, "".join(d.stdout for d in done),
                                       "".join(d.stderr for d in done))
