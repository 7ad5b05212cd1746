"""`scripts/bench.py --engines`: vLLM on CPU against the HF engine (rollout tokens per second and the whole step),
each (model, engine, threads) in a process of its own."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import torch

from benches.common import GpgRunner, build_model, make_rows
from gpg_vl.experiments import Meter
from gpg_vl.models.load import resolve_path

BENCH = Path(__file__).resolve().parents[1] / "bench.py"


def engine_model_dir(name: str, image_size: int, seed: int, folder: str) -> str:
    """The folder vLLM (and the trainer) load `name` from: the embedded tiny model, or the bench model saved."""
    if name == "tiny":
        return str(resolve_path("embedded:tiny-qwen2.5-vl"))
    if name != "bench":
        raise SystemExit(f"error: unknown --engine-models entry {name!r}; use tiny or bench.")
    model, processor = build_model(image_size, seed, torch.float32, "cpu")
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def engine_run(args, model: str, engine: str) -> None:
    """One (model, engine) at this process's thread count: its medians as one JSON line."""
    image_size, group_size = int(args.image_sizes.split(",")[0]), int(args.group_sizes.split(",")[0])
    torch.set_num_threads(int(args.threads))
    with tempfile.TemporaryDirectory() as folder:
        rows = make_rows(args.prompts * (args.warmup + args.steps), image_size, args.seed)
        runner = GpgRunner(args, rows, group_size, image_size, "default",
                           model_dir=engine_model_dir(model, image_size, args.seed, folder), rollout_engine=engine)
        meter = Meter(args.device)
        results = [runner.step(meter) for _ in range(args.warmup + args.steps)][args.warmup:]
    median = {key: statistics.median(r[key] for r in results)
              for key in ("step_s", "rollout_s", "update_s", "sync_s", "completion_tokens")}
    median["rollout_tokens_per_s"] = statistics.median(r["completion_tokens"] / r["rollout_s"] for r in results)
    print(json.dumps({"model": model, "engine": engine, "threads": int(args.threads), **median}), flush=True)


def engine_command(args, model: str, engine: str, threads: int) -> list[str]:
    return [sys.executable, str(BENCH), "--engine-run", model, engine, "--threads", str(threads),
            "--prompts", str(args.prompts), "--group-sizes", args.group_sizes, "--image-sizes", args.image_sizes,
            "--new-tokens", str(args.new_tokens), "--warmup", str(args.warmup), "--steps", str(args.steps),
            "--seed", str(args.seed), "--lr", str(args.lr)]


def main_engines(args) -> None:
    """Every (model, engine, threads) in a process of its own; one table."""
    print(f"B={args.prompts} x G={args.group_sizes}, {args.new_tokens} new tokens, {args.image_sizes} px; load average "
          f"{', '.join(f'{x:.1f}' for x in psutil.getloadavg())}", flush=True)
    lines = []
    for model in args.engine_models.split(","):
        for engine in args.engines.split(","):
            for threads in [int(t) for t in args.threads.split(",")]:
                env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
                       "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
                done = subprocess.run(engine_command(args, model, engine, threads), env=env, capture_output=True,
                                      text=True)
                if done.returncode != 0:
                    raise SystemExit(f"error: {model} / {engine} / {threads} threads failed:\n{done.stderr[-3000:]}")
                lines.append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(lines[-1], flush=True)
    print("\n| model | engine | threads | rollout tokens/s | step s (rollout + update + sync) |")
    print("|---|---|---|---|---|")
    for r in lines:
        print(f"| {r['model']} | {r['engine']} | {r['threads']} | {r['rollout_tokens_per_s']:.0f} | {r['step_s']:.2f} "
              f"({r['rollout_s']:.2f} + {r['update_s']:.2f} + {r['sync_s']:.2f}) |")
    print(f"load average at the end: {', '.join(f'{x:.1f}' for x in psutil.getloadavg())}")
