"""Two processes launched as `accelerate launch` starts them (forked: helpers/procs.py), with the shipped
accelerate configs' environment: what the distributed tests and the multi-process server tests share; and
"machines" on this one host, each a real `accelerate launch --num_machines N --machine_rank R` (`machine`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from helpers import procs
from helpers.procs import ROOT

WORKER = ROOT / "tests" / "distributed" / "distributed_worker.py"


CONFIGS = ROOT / "configs" / "accelerate"


def launch_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}


def free_port() -> int:
    with socket.socket() as sock:  # other test runs on this machine may hold accelerate's default 29500
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


LAUNCH = ["--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]


def launch(*arguments: str, config: str | None = None) -> str:
    """2 processes as `accelerate launch <LAUNCH> [--config_file configs/accelerate/<config> | --multi_gpu]
    <arguments>` starts them (`--multi_gpu` starts them on a CPU machine too), forked (helpers/procs.py); returns
    their output."""
    environment = launch_environment(CONFIGS / config if config else None, LAUNCH)
    done = procs.launch(list(arguments), env={**launch_env(), **environment}, port=free_port())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done.stdout + done.stderr


def machine(rank: int, machines: int, port: int, *arguments: str, log: Path) -> subprocess.Popen:
    """Machine `rank` of `machines` simulated on this host: `accelerate launch --multi_gpu --num_machines <machines>
    --machine_rank <rank> --num_processes <machines> --main_process_ip 127.0.0.1 --main_process_port <port>
    <arguments>` (one trainer process per machine, accelerate's default static rendezvous at the port, which machine
    0's launcher serves), in a session of its own; both streams in `log`."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", str(machines),
               "--machine_rank", str(rank), "--num_processes", str(machines), "--main_process_ip", "127.0.0.1",
               "--main_process_port", str(port), "--mixed_precision", "no", "--dynamo_backend", "no", *arguments]
    return subprocess.Popen(command, cwd=ROOT, env=launch_env(), stdout=open(log, "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            start_new_session=True)


def kill_machine(launcher: subprocess.Popen) -> None:
    """A machine lost at once: its launcher and every process under it (torchrun starts each trainer process in a
    session of its own, so the launcher's process group alone would leave them running)."""
    import psutil

    try:
        processes = [psutil.Process(launcher.pid), *psutil.Process(launcher.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    launcher.wait()


# ---------------------------------------------------------------------------------------------
# the shipped accelerate configs
# ---------------------------------------------------------------------------------------------
def launch_environment(config: Path | None, options: Sequence[str] = ("--num_processes", "2")) -> dict[str, str]:
    """What `accelerate launch <options> --config_file config` (`--multi_gpu` without one) puts in the processes'
    environment, computed by accelerate's own launcher code (which rejects unknown top-level keys)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    parser = launch_command_parser()
    engine = ["--config_file", str(config)] if config else ["--multi_gpu"]
    arguments = parser.parse_args([*engine, *options, "scripts/train.py"])
    arguments, defaults, _ = _validate_launch_command(arguments)
    # accelerate copies nested keys onto the launch arguments without checking them: check them here
    launch_options = {action.dest for action in parser._actions}
    nested = {**(defaults.fsdp_config if defaults else {}), **(defaults.deepspeed_config if defaults else {})}
    assert not set(nested) - launch_options, f"{config}: unknown keys {sorted(set(nested) - launch_options)}"
    if arguments.use_deepspeed:
        arguments.deepspeed_fields_from_accelerate_config = ",".join([*defaults.deepspeed_config, "mixed_precision"])
        return prepare_deepspeed_cmd_env(arguments)[1]
    return prepare_multi_gpu_env(arguments)


def require_deepspeed() -> None:
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[dev]' installs it)")
