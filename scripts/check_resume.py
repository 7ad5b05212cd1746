"""Check exact resume: a run killed with SIGKILL and resumed with resume=auto ends where an uninterrupted run does.

    python scripts/check_resume.py                                   # task=shapes model=tiny, 6 steps, kill after 3
    python scripts/check_resume.py --steps 8 --kill-after 5 --output-dir runs/resume-check trainer.lr=1e-3

It runs scripts/train.py in subprocesses, on CPU:
1. `uninterrupted/`: N steps, a checkpoint after every step;
2. `resumed/`: the same job, killed with SIGKILL after step K. By default the kill lands in the middle of the
   next save (checkpoint-(K+1) holds the weights but not yet its trainer state), so the run also dies during a
   save; `--kill-when between-steps` instead sends SIGKILL from outside as soon as checkpoint-K is complete;
3. `resumed/` again with resume=auto, up to step N.
Then it compares the final weights bitwise (sha256 over every safetensors tensor: name, dtype, shape, bytes) and
the metrics.jsonl lines of steps K+1..N without their timing fields, and checks that the resumed metrics.jsonl
holds every step once and that no `.partial` folder is left. Exit status 0 when everything holds.
Any further `key=value` arguments go to every training run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's gpg_vl, as for the runs below

from gpg_vl.train.checkpoint.folder import latest_checkpoint  # noqa: E402
from gpg_vl.train.loop import WALL_CLOCK_METRICS  # noqa: E402

TIMING = tuple(sorted(WALL_CLOCK_METRICS))
TINY = ["task=shapes", "model=tiny", "trainer.save_every=1", "trainer.eval_before=false", "trainer.eval_after=false",
        "trainer.batch_size=4", "trainer.group_size=4", "trainer.micro_batch_size=16", "rollout.max_new_tokens=24",
        "seed=0"]
# Runs scripts/train.py, but SIGKILLs itself while checkpoint-<argv[1]> is being written: after its weights,
# before its trainer state (a test hook that lives here, not in the trainer).
KILL_IN_SAVE = """
import os, runpy, signal, sys
import gpg_vl.train.checkpoint.save as checkpoint
kill_step, write = int(sys.argv[1]), checkpoint._write_trainer_state
def write_or_die(folder, state):
    if state["step"] == kill_step:
        os.kill(os.getpid(), signal.SIGKILL)
    write(folder, state)
checkpoint._write_trainer_state = write_or_die
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def weights_sha256(folder: Path) -> tuple[str, int]:
    """sha256 over every tensor of the folder's safetensors files (name, dtype, shape, raw bytes), and their count."""
    import torch
    from safetensors import safe_open

    digest, count = hashlib.sha256(), 0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as tensors:
            for name in sorted(tensors.keys()):
                tensor = tensors.get_tensor(name).contiguous()
                digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
                digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
                count += 1
    return digest.hexdigest(), count


def metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _train(args: list[str], log: Path, prefix: list[str] | None = None, threads: int = 1) -> subprocess.Popen:
    command = [sys.executable, *(prefix or []), str(ROOT / "scripts" / "train.py"), *args]
    environment = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with log.open("a") as handle:
        return subprocess.Popen(command, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, env=environment)


def _finish(process: subprocess.Popen, log: Path, what: str) -> None:
    if process.wait() != 0:
        raise RuntimeError(f"{what} failed (exit {process.returncode}); its output is in {log}:\n"
                           + log.read_text()[-3000:])


def check(output_dir: Path, *, steps: int = 6, kill_after: int = 3, kill_when: str = "in-save",
          overrides: list[str] = (), threads: int = 1) -> dict:
    """Run the three jobs in `output_dir` and compare them; returns what was measured."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    common = [*TINY, f"trainer.max_steps={steps}", *overrides]
    full, resumed = output_dir / "uninterrupted", output_dir / "resumed"
    log = output_dir / "train.log"
    _finish(_train([*common, f"output_dir={full}"], log, threads=threads), log, "the uninterrupted run")

    if kill_when == "in-save":
        killed = _train([*common, f"output_dir={resumed}"], log, ["-c", KILL_IN_SAVE, str(kill_after + 1)],
                        threads=threads)
        killed.wait()
        how = f"SIGKILL while writing checkpoint-{kill_after + 1}"
    else:
        killed = _train([*common, f"output_dir={resumed}"], log, threads=threads)
        marker = resumed / f"checkpoint-{kill_after}" / "checkpoint.json"
        while not marker.exists() and killed.poll() is None:
            time.sleep(0.05)
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait()
        how = f"SIGKILL from outside once checkpoint-{kill_after} was complete"
    if killed.returncode != -signal.SIGKILL:
        raise RuntimeError(f"the run to kill ended with exit {killed.returncode}, not by SIGKILL; see {log}")
    left = sorted(path.name for path in resumed.iterdir())
    killed_steps = [m["step"] for m in metrics(resumed)] if (resumed / "metrics.jsonl").exists() else []
    start = latest_checkpoint(resumed)  # what resume=auto will continue from
    start_hash = weights_sha256(start)[0] if start is not None else None

    before = log.read_text()
    _finish(_train([*common, f"output_dir={resumed}", "resume=auto"], log, threads=threads), log,
            "the resumed run")
    said = [line for line in log.read_text()[len(before):].splitlines() if line.startswith("resumed from")]

    hashes = {name: weights_sha256(folder / "final") for name, folder in (("uninterrupted", full),
                                                                          ("resumed", resumed))}
    lines = {name: {m["step"]: {k: v for k, v in m.items() if k not in TIMING} for m in metrics(folder)}
             for name, folder in (("uninterrupted", full), ("resumed", resumed))}
    resumed_steps = [m["step"] for m in metrics(resumed)]
    later = range(kill_after + 1, steps + 1)
    return {
        "how": how, "left_after_kill": left, "steps_logged_before_kill": killed_steps,
        "resumed_from": said[0] if said else None,
        "sha256": {name: digest for name, (digest, _) in hashes.items()}, "tensors": hashes["resumed"][1],
        "weights_identical": hashes["uninterrupted"] == hashes["resumed"],
        "weights_trained": hashes["resumed"][0] != start_hash,  # the resumed steps changed the weights
        "groups_used": [lines["resumed"][s]["groups_used"] for s in sorted(lines["resumed"])],
        "metrics_identical_after_kill": all(lines["uninterrupted"].get(s) == lines["resumed"].get(s) for s in later),
        "metrics_identical_all": lines["uninterrupted"] == lines["resumed"],
        "resumed_steps": resumed_steps, "steps_once": resumed_steps == list(range(1, steps + 1)),
        "data_positions": [lines["resumed"][s]["data_position"] for s in sorted(lines["resumed"])],
        "partials_left": sorted(p.name for p in resumed.iterdir() if p.name.endswith(".partial")),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--kill-after", type=int, default=3)
    parser.add_argument("--kill-when", choices=("in-save", "between-steps"), default="in-save")
    parser.add_argument("--output-dir", default="outputs/check_resume")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads of each run (OMP_NUM_THREADS). Bitwise equality needs 1: with more, "
                             "a multithreaded CPU kernel on the prompt-once update path can round differently "
                             "from one run to the next (about 1e-8 relative), resumed or not")
    parser.add_argument("overrides", nargs="*", help="key=value settings for every training run")
    args = parser.parse_args(argv)
    if not 0 < args.kill_after < args.steps:
        parser.error("--kill-after must be between 1 and --steps - 1")
    result = check(Path(args.output_dir), steps=args.steps, kill_after=args.kill_after, kill_when=args.kill_when,
                   overrides=args.overrides, threads=args.threads)
    print(f"uninterrupted: {args.steps} steps; final weights sha256 {result['sha256']['uninterrupted']}")
    print(f"killed:        {result['how']}; metrics.jsonl had steps {result['steps_logged_before_kill']}; "
          f"left {', '.join(result['left_after_kill'])}")
    print(f"resumed:       {result['resumed_from']}; final weights sha256 {result['sha256']['resumed']}")
    print(f"weights ({result['tensors']} tensors): {'bitwise identical' if result['weights_identical'] else 'DIFFER'}"
          f"; {'changed' if result['weights_trained'] else 'UNCHANGED'} by the resumed steps (valid groups per step: "
          f"{result['groups_used']})")
    print(f"metrics steps {args.kill_after + 1}-{args.steps} without {', '.join(TIMING)}: "
          f"{'identical' if result['metrics_identical_after_kill'] else 'DIFFER'} "
          f"(all steps: {'identical' if result['metrics_identical_all'] else 'differ'})")
    print(f"resumed metrics.jsonl steps {result['resumed_steps']} ({'each once' if result['steps_once'] else 'NOT'}"
          f"); data positions {result['data_positions']}; .partial folders left: {result['partials_left'] or 'none'}")
    ok = result["weights_identical"] and result["weights_trained"] and result["metrics_identical_after_kill"] \
        and result["steps_once"] and not result["partials_left"]
    print("exact resume: " + ("OK" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
