"""Throughput: gpg-vl's trainer against TRL's GRPOTrainer on the same work, side by side in one process.

    pip install -e ".[bench]"       # TRL
    python scripts/bench.py --steps 5 --gpg-variants default,plain                 # the README's headline
    python scripts/bench.py --group-sizes 2,4,8,16 --image-sizes 224,448 --steps 2  # the scaling table
    python scripts/bench.py --steps 3 --gpg-variants default,no-share_prompt       # where gpg-vl's time goes
    python scripts/bench.py --family qwen3_5 --steps 3 --gpg-variants default,plain # Qwen3.5 (hybrid attention)
    python scripts/bench.py --video 8 --threads 2   # video prompts (8 frames): prompt-once against the plain path
    python scripts/bench.py --forwards teacher,teacher_apart,grpo2,grpo2_apart --threads 1,2  # pi_prox's forwards
    python scripts/bench.py --staleness 1 --steps 4 # the sampler beside the learner (k = 1) against the synchronous run
    ~/.cache/gpg-vl/vllm-cpu/bin/python scripts/bench.py --engines hf,vllm --threads 1,2  # vLLM on CPU against HF

With `--engines` (run by the vLLM CPU environment's python: scripts/vllm_cpu_env.sh) each engine's rollout tokens per
second (completion tokens over the rollout's seconds) and whole step (rollout, update, weight sync) are measured on
each model of `--engine-models` (tiny: the embedded ~3M Qwen2.5-VL; bench: the 26M model below, saved to a
temporary folder for vLLM to load) at each thread count of `--threads`, each combination in a process of its own
(vLLM binds its threads once per process: OMP_NUM_THREADS and VLLM_CPU_OMP_THREADS_BIND are set for it); the same B
prompts x G completions of --new-tokens tokens (EOS ignored) at --image-sizes; medians over --steps after --warmup.

With `--staleness K` the synchronous trainer (trainer.max_staleness = 0) and the asynchronous one (K: the sampler
thread of gpg_vl/train/step/pipeline.py beside the learner, each side on half of torch's threads) run in alternating
blocks of --warmup + --steps steps, at 2 threads and at 1 thread, in this process, then TRL's GRPOTrainer runs the
same work at each thread count; steps per second are over the measured steps of each block, and the learner's
idle fraction is its seconds waiting for a sampled step over its step time. Last, `side_by_side` times each side
alone (2 threads, 1 thread) and both side by side at one thread each, and prints the most that async / sync at 2
threads can reach on this machine: the synchronous step over half the two sides' least cost in core-seconds.

With `--video FRAMES` every prompt holds a clip of FRAMES frames (--image-sizes side, 2 fps, read once per
prompt as training reads it) instead of an image, and TRL, which has no video, is left out: gpg-vl's
default configuration (prefill-once rollout, prompt-once update with the video tower once per group) runs
beside its own plain path (every row prefilled, every sequence whole with its own video encoding), alternating.

The model is a random-weight Qwen2_5_VLForConditionalGeneration (text hidden 512 x 6 layers, vision
hidden 256 x depth 6, about 26M parameters) with the embedded tiny model's tokenizer and processor; with
`--family qwen3_5`, a Qwen3_5ForConditionalGeneration of the same sizes (Gated DeltaNet in layers 1-3 and
5-6, full attention in layer 4; 16-px patches) with the tiny Qwen3.5's processor and thinking template.
Both trainers get the same B prompts per step (same template, same image size, so the same token
counts), G completions each of exactly --new-tokens tokens (EOS cannot be sampled: gpg-vl's
rollout.ignore_eos, TRL's min_new_tokens), the same optimizer (AdamW) and learning rate, and one
optimizer step per rollout. TRL is configured as close to GPG as it allows: beta=0,
num_iterations=1, scale_rewards="none", loss_type="grpo", no vLLM, and no gradient checkpointing
(gpg-vl does not checkpoint either). The reward is a hash of the completion text, so every group has
differing rewards and gpg-vl forwards every group, as TRL does.

TRL drives the loop (its own `train()`); after each TRL step a callback runs one gpg-vl step (each
variant once, in a fresh order each round), so the two alternate and machine drift hits both alike.
Times are wall-clock seconds per optimizer step, with the process's CPU seconds beside them (robust
when other jobs share the machine). Memory is the peak resident set size (RSS) of the process during a
step, above its level when the step began (after returning freed heap pages to the system with
malloc_trim): the kernel's high-water mark, reset per step (see Meter). Both trainers also hold the
same persistent state (weights, gradients, AdamW moments), printed once. On CUDA the peak is
torch.cuda.max_memory_allocated during the step instead.
"""

from __future__ import annotations

import argparse
import warnings

import torch
from benches.common import VARIANTS
from benches.engines import engine_run, main_engines
from benches.forwards import CONFIGURATIONS, main_forwards
from benches.packing import main_packing
from benches.pair import main_pair
from benches.staleness import main_staleness
from benches.video import main_video


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=2, help="B: prompts per step")
    parser.add_argument("--group-sizes", default="8", help="G values, comma-separated")
    parser.add_argument("--image-sizes", default="224", help="square image sides in pixels, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=64, help="completion length (EOS ignored)")
    parser.add_argument("--warmup", type=int, default=1, help="steps not measured")
    parser.add_argument("--steps", type=int, default=3, help="measured steps")
    parser.add_argument("--gpg-variants", default="default",
                        help=f"gpg-vl configurations run beside TRL, comma-separated: {', '.join(VARIANTS)}")
    parser.add_argument("--cache", default="default", choices=["default", "dynamic", "static"],
                        help="decoding cache of both trainers (default: each its own, gpg-vl's rollout.hf.static_cache "
                             "and reserve_cache, and transformers' dynamic cache for TRL; gpg-vl's dynamic cache "
                             "keeps its reserved room unless the variant no-reserve_cache says otherwise)")
    parser.add_argument("--family", default="qwen2_5_vl", choices=["qwen2_5_vl", "qwen3_5"],
                        help="the bench model's family (same sizes)")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", default="1", help="torch CPU threads (both trainers); with --packing, a "
                        "comma-separated list measured one after the other in this process")
    parser.add_argument("--packing", default="", help="measure the update alone under these trainer.packing modes "
                        "(comma-separated, e.g. on,off) on one sampled step, instead of the trainers")
    parser.add_argument("--forwards", default="", help="measure the update alone under these configurations "
                        f"(comma-separated: {', '.join(CONFIGURATIONS)}) on one sampled step, instead of the trainers")
    parser.add_argument("--lengths", default="", metavar="LOW:HIGH",
                        help="with --packing: cut each completion to a length drawn uniformly from LOW:HIGH")
    parser.add_argument("--zoom", action="store_true",
                        help="with --packing: one step of +experiment=zoom-tiny (multi-turn) instead of the bench's")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--staleness", type=int, default=0, metavar="K",
                        help="the asynchronous trainer at trainer.max_staleness=K against the synchronous one and TRL")
    parser.add_argument("--engines", default="", help="rollout engines to measure against each other (hf, vllm; "
                        "comma-separated): rollout tokens/s and the whole step, per model and thread count")
    parser.add_argument("--engine-models", default="tiny,bench", help="with --engines: tiny, bench (comma-separated)")
    parser.add_argument("--engine-run", nargs=2, metavar=("MODEL", "ENGINE"), help=argparse.SUPPRESS)
    parser.add_argument("--video", type=int, default=0, metavar="FRAMES",
                        help="video prompts of FRAMES frames (even), gpg-vl against its plain path (TRL has no video)")
    args = parser.parse_args()
    if args.video and args.gpg_variants == "default":
        args.gpg_variants = "default,plain"
    args.gpg_variants = args.gpg_variants.split(",")
    unknown = [v for v in args.gpg_variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown --gpg-variants {unknown}; known: {', '.join(VARIANTS)}")
    args.torch_dtype = getattr(torch, args.dtype)
    warnings.filterwarnings("ignore", category=FutureWarning)  # deprecated argument names inside TRL
    if args.packing:
        return main_packing(args)
    if args.forwards:
        return main_forwards(args)
    if args.engine_run:
        return engine_run(args, *args.engine_run)
    if args.engines:
        return main_engines(args)
    torch.set_num_threads(int(args.threads))
    if args.video:
        return main_video(args)
    if args.staleness:
        return main_staleness(args)
    return main_pair(args)


if __name__ == "__main__":
    main()
