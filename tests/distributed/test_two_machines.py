"""Two machines launched for real, simulated on one host: two `accelerate launch --multi_gpu --num_machines 2
--machine_rank 0|1 --num_processes 2 --main_process_ip 127.0.0.1 --main_process_port P` commands (docs/many-nodes.md's
recipe; accelerate's default static rendezvous, whose store machine 0's launcher serves at P), one trainer process
each, sampled by the test run's real `vllm serve` (vLLM's CPU build) through the `disk` sync.

Machine 1 is killed (its launcher and its trainer process) once checkpoint-1 is written: machine 0's trainer stops
in one sentence naming the newest intact checkpoint; the same two launches with resume=auto then finish the run. Every
step's metrics and the weights (checkpoint-1, written before the kill, and the final ones) equal those of one machine
with 2 processes (tests/integration/test_vllm_real_launch.py's run, `two_process_run`), bit for bit.

What the launchers do when a machine is lost, and their timeouts, are in docs/many-nodes.md ("Several trainer
machines")."""

from __future__ import annotations

import re
import subprocess
import time

import pytest
import torch
from helpers.launch import free_port, kill_machine, machine
from helpers.runs import untimed
from helpers.vllm_real import (
    TWO_PROCESSES,
    metrics,
    needs_vllm_env,
    run_overrides,
    server_lock,
    shared_server,
    two_process_run,
)
from safetensors.torch import load_file

from gpg_vl.train.checkpoint.folder import latest_checkpoint

LAUNCH_S = 900  # a launch on a loaded two-core machine: a minute or two


def same_weights(first, second) -> bool:
    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    return set(a) == set(b) and all(torch.equal(a[name], b[name]) for name in a)


def until_checkpoint(out, name: str, launchers: list[subprocess.Popen]) -> None:
    """Wait until `out` holds the intact checkpoint `name` (every launcher still running)."""
    deadline = time.monotonic() + LAUNCH_S
    while time.monotonic() < deadline:
        newest = latest_checkpoint(out) if out.exists() else None
        if newest is not None and newest.name == name:
            return
        ended = [launcher.returncode for launcher in launchers if launcher.poll() is not None]
        assert not ended, f"a machine ended (exit codes {ended}) before {name}"
        time.sleep(0.05)
    raise AssertionError(f"no {name} within {LAUNCH_S} s")


def test_a_lost_peer_is_recognised_in_what_gloo_torch_and_nccl_say():
    """What a collective raises when another process is gone, said in its first sentence (gloo names its source file
    first and adds advice); any other error is not a lost peer."""
    from gpg_vl.distributed import lost_peer

    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
                        "[127.0.0.1]:36532. This is typically caused by a remote worker crashing. Check the logs")
    assert lost_peer(gloo) == "Connection closed by peer [127.0.0.1]:36532"
    reset = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:538] Read error [127.0.0.1]:22758: "
                         "Connection reset by peer")
    assert lost_peer(reset) == "Read error [127.0.0.1]:22758: Connection reset by peer"
    assert lost_peer(RuntimeError("Timed out waiting 1800000ms for recv operation to complete")) == (
        "Timed out waiting 1800000ms for recv operation to complete")
    assert lost_peer(torch.distributed.DistNetworkError("Broken pipe")) == "Broken pipe"
    assert lost_peer(RuntimeError("CUDA out of memory")) is None and lost_peer(ValueError("closed by peer")) is None


@needs_vllm_env
@pytest.mark.slow
def test_two_machines_train_as_one_and_a_lost_machine_stops_the_other_where_resume_continues(tmp_path_factory,
                                                                                             tmp_path):
    reference = two_process_run(tmp_path_factory) / "run"
    url = shared_server(tmp_path_factory)
    out = tmp_path / "run"
    arguments = ["scripts/train.py", f"output_dir={out}",
                 *run_overrides(url, tmp_path / "transfer", "trainer.max_steps=3", *TWO_PROCESSES)]
    with server_lock(tmp_path_factory):
        port = free_port()
        launchers = [machine(rank, 2, port, *arguments, log=tmp_path / f"machine{rank}.log") for rank in (0, 1)]
        try:
            until_checkpoint(out, "checkpoint-1", launchers)
            kill_machine(launchers[1])  # machine 1 lost during step 2
            stopped = launchers[0].wait(timeout=LAUNCH_S)
        finally:
            for launcher in launchers:
                kill_machine(launcher)
        said = (tmp_path / "machine0.log").read_text(errors="replace")
        sentences = [line for line in said.splitlines() if line.startswith("error: ")]
        assert stopped != 0 and len(sentences) == 1, said[-4000:]
        expected = (r"error: process 0 of 2 lost another trainer process \([^()]*Connection (closed|reset) by peer"
                    r"[^()]*\), so the run stopped at step [12]; its newest intact checkpoint is checkpoint-1 "
                    rf"\(output_dir={re.escape(str(out))}\): once every machine is back, launch the same command on "
                    r"each with resume=auto \(docs/many-nodes\.md\)\.")
        assert re.fullmatch(expected, sentences[0]), sentences[0]
        assert "[rank0]: Traceback" not in said  # the trainer's (was gloo's RuntimeError); the launcher still reports
        assert len(metrics(out)) < 3 and same_weights(out / "checkpoint-1", reference / "checkpoint-1")
        port = free_port()  # the same two launches again, each with resume=auto
        launchers = [machine(rank, 2, port, *arguments, "resume=auto", log=tmp_path / f"resumed{rank}.log")
                     for rank in (0, 1)]
        try:
            codes = [launcher.wait(timeout=LAUNCH_S) for launcher in launchers]
        finally:
            for launcher in launchers:
                kill_machine(launcher)
    assert codes == [0, 0], (tmp_path / "resumed0.log").read_text(errors="replace")[-4000:]
    assert "resumed from" in (tmp_path / "resumed1.log").read_text()
    assert [untimed(m) for m in metrics(out)] == [untimed(m) for m in metrics(reference)]
    assert same_weights(out / "final", reference / "final")


def documented_launches() -> list[tuple[str, list[str]]]:
    """Each `accelerate launch` line of the docs' code blocks (continuations joined, comments dropped), its shell
    variables given values: (page, words)."""
    import shlex

    from helpers.launch import ROOT

    found, values = [], {"$R": "1", "$MASTER": "10.0.0.1"}
    for page in sorted((ROOT / "docs").glob("*.md")):
        for block in re.findall(r"^```[^\n]*\n(.*?)^```", page.read_text(), flags=re.S | re.M):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" #")[0].strip()
                if line.startswith("accelerate launch"):
                    found.append((page.name, shlex.split(re.sub(r"\$[A-Z]+", lambda m: values[m.group(0)], line))))
    return found


def test_the_docs_launch_lines_are_taken_by_accelerates_own_launcher(monkeypatch):
    """docs/distributed.md's and docs/many-nodes.md's `accelerate launch` lines, parsed and checked by accelerate's
    own launcher code (the arguments, the config file, the environment it gives the processes): a machine of several
    gets its rank, the machine count and the rendezvous address; the script's own settings compose
    (tests/unit/test_docs_commands.py)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import launch as launching

    monkeypatch.setattr(launching, "is_port_in_use", lambda port: False)  # another run here may hold the port
    lines = documented_launches()
    several = [(page, words) for page, words in lines if "--num_machines" in words]
    assert {page for page, _ in several} == {"distributed.md", "many-nodes.md"}, lines
    for page, words in lines:
        script = next(k for k, word in enumerate(words) if word.endswith(".py"))
        arguments = launch_command_parser().parse_args([*words[2:script], words[script]])
        arguments, defaults, _ = _validate_launch_command(arguments)
        if arguments.use_deepspeed:
            arguments.deepspeed_fields_from_accelerate_config = ",".join([*defaults.deepspeed_config,
                                                                         "mixed_precision"])
            launching.prepare_deepspeed_cmd_env(arguments)
        else:
            launching.prepare_multi_gpu_env(arguments)
        machines = int(words[words.index("--num_machines") + 1]) if "--num_machines" in words else 1
        if machines > 1:
            rank = int(words[words.index("--machine_rank") + 1])
            assert (arguments.nnodes, arguments.node_rank) == (str(machines), rank), (page, words)
            endpoint = arguments.rdzv_endpoint or f"{arguments.master_addr}:{arguments.master_port}"
            assert endpoint.split(":")[0] in ("10.0.0.1", "127.0.0.1"), (page, endpoint)
