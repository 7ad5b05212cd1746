"""How long the command line takes to refuse a bad key or value: each bad command line of
tests/integration/test_robustness.py and tests/integration/test_cli.py run as its own process, its CPU time
(user + system, from os.wait4) and wall time measured. Prints a Markdown table (docs/robustness.md, "Errors in a
second") and the machine it ran on.

    python scripts/config_latency.py            # every command once
    python scripts/config_latency.py --repeat 3 # the median of 3 runs of each
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (script, overrides): the bad values and keys the robustness and CLI tests refuse
COMMANDS = [
    ("train", ["trainer.lr=abc"]), ("train", ["trainer.lr=-1"]), ("train", ["trainer.group_size=0"]),
    ("train", ["trainer.group_size=2.5"]), ("train", ["trainer.group_size=1"]), ("train", ["trainer.max_steps=abc"]),
    ("train", ["trainer.max_steps=-5"]), ("train", ["trainer.epochs=abc"]), ("train", ["trainer.lr_schedule=bogus"]),
    ("train", ["trainer.aggregation=bogus"]), ("train", ["trainer.micro_batch_size=0", "trainer.micro_batch_tokens=0"]),
    ("train", ["trainer.max_attempts=0"]), ("train", ["trainer.report_to=bogus"]),
    ("train", ["trainer.keep_checkpoints=-1"]), ("train", ["trainer.save_every=-1"]),
    ("train", ["trainer.reward_budget_s=-1"]), ("train", ["rollout.max_new_tokens=-1"]),
    ("train", ["rollout.temperature=0"]), ("train", ["seed=abc"]), ("train", ["model.dtype=int8"]),
    ("train", ["eval.batch_size=0"]), ("train", ["trainer.lr=-1", "eval.batch_size=0"]),
    ("train", ["trainer.lrr=1"]), ("train", ["rollout.max_new_token=3"]), ("train", ["model=qwen9"]),
    ("train", ["task=nope"]), ("train", ["rollout.ignore_eos=maybe"]), ("train", ["trainer.beta_th=2"]),
    ("train", ["trainer.loss=bogus"]), ("train", ["trainer.kl_coef=0.1"]),
    ("train", ["algorithm=dapo", "trainer.overlong_cache=100", "rollout.max_new_tokens=12"]),
    ("eval", ["eval.batch_size=abc"]), ("eval", ["eval.reward_workers=0"]), ("eval", ["segmenter=mask"]),
    ("eval", ["rollout.hf.decode=fast"]), ("eval", ["eval.bogus=1"]),
]


def measure(script: str, overrides: list[str]) -> tuple[float, float, int, str]:
    """(CPU seconds, wall seconds, exit code, first line of stderr) of one command line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, f"scripts/{script}.py", *overrides], cwd=ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr = process.stderr.read()
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    first = (stderr.strip().splitlines() or [""])[0]
    return usage.ru_utime + usage.ru_stime, wall, process.returncode, first


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{model or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"load average {load}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=1, help="runs of each command (the median is shown)")
    args = parser.parse_args()
    print(f"machine: {machine()}\n")
    print("| command | CPU s | wall s | exit | first line of stderr |")
    print("|---|---:|---:|---:|---|")
    cpu_all = []
    for script, overrides in COMMANDS:
        runs = [measure(script, overrides) for _ in range(args.repeat)]
        cpu, wall = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        code, first = runs[-1][2], runs[-1][3]
        cpu_all.append(cpu)
        shown = first if len(first) <= 110 else first[:107] + "..."
        command = f"`{script}.py {' '.join(overrides)}`"
        shown = shown.replace("|", "/").replace("`", "'")  # a Markdown table cell
        print(f"| {command} | {cpu:.2f} | {wall:.2f} | {code} | {shown} |", flush=True)
    print(f"\n{len(COMMANDS)} commands: CPU s median {statistics.median(cpu_all):.2f}, max {max(cpu_all):.2f}")


if __name__ == "__main__":
    main()
