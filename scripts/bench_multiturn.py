"""Multi-turn rollout throughput: observations prefilled onto the cache (incremental) against a re-prefill of
the whole conversation every turn (naive), on a tiny model, in one run.

    python scripts/bench_multiturn.py                           # tiny Qwen2.5-VL, 1 and 2 threads
    python scripts/bench_multiturn.py --family qwen3_vl --turns 4 --prompts 4 --group-size 4

Every trajectory but the last of each group is steered (scripted segments) to call zoom_in on each turn but
the last, so each one takes `--turns` turns with a crop per call; the last of each group decodes freely.
Prints generated tokens per second (the loss-masked tokens of every trajectory) for each mode, and their
ratio, measured alternately in one process.
"""

from __future__ import annotations

import argparse
import time

import torch
from PIL import Image

from gpg_vl.models.load import load_policy
from gpg_vl.models.tiny import tiny_model_path
from gpg_vl.rollout.engine import EnginePrompts, Sampling
from gpg_vl.rollout.multiturn.decoding import generate_trajectories, incremental_unsupported
from gpg_vl.rollout.multiturn.trajectory import MultiTurnSettings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="qwen2_5_vl", help="a tiny model (tiny:<family>)")
    parser.add_argument("--prompts", type=int, default=2, help="B")
    parser.add_argument("--group-size", type=int, default=4, help="G")
    parser.add_argument("--turns", type=int, default=3, help="max_turns")
    parser.add_argument("--new-tokens", type=int, default=100, help="max new tokens per segment")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", default="1,2", help="torch CPU threads, comma-separated")
    args = parser.parse_args()
    policy = load_policy(str(tiny_model_path(args.family)), family="auto", dtype="float32")
    family = policy.family
    messages = [[{"role": "user", "content": [
        {"type": "image", "image": Image.new("RGB", (args.image_size, args.image_size), (40 * b, 90, 0))},
        {"type": "text", "text": f"What is in image {b}? Look closely."}]}] for b in range(args.prompts)]
    prompts = EnginePrompts(family.encode(messages), messages)
    box = [round(v) for v in family.to_model_frame((8, 8, args.image_size - 8, args.image_size // 2),
                                                    prompts.batch.image_sizes[0][0])]
    call = f'<tool_call>{{"name": "zoom_in", "arguments": {{"bbox_2d": {box}}}}}</tool_call>'
    if family.tool_call_format == "xml":
        call = f"<tool_call><function=zoom_in><parameter=bbox_2d>{box}</parameter></function></tool_call>"
    call_ids = family.tokenizer(call, add_special_tokens=False)["input_ids"]
    if len(call_ids) >= args.new_tokens:
        parser.error(f"--new-tokens must exceed the scripted call's {len(call_ids)} tokens")

    def scripted(row: int, turn: int):
        return call_ids if row % args.group_size != args.group_size - 1 and turn < args.turns - 1 else None

    sampling = Sampling(max_new_tokens=args.new_tokens, greedy=True)
    note = incremental_unsupported(policy.model)
    if note:
        print(f"note: {args.family} runs naive in both modes ({note})")
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        seconds, tokens, turns = {"incremental": 0.0, "naive": 0.0}, {}, {}
        for _ in range(args.repeats):
            for mode in seconds:
                settings = MultiTurnSettings(max_turns=args.turns, hf_multiturn=mode, max_total_tokens=100_000)
                started = time.perf_counter()
                rollout = generate_trajectories(policy, prompts, group_size=args.group_size, sampling=sampling,
                                                settings=settings, tools=("zoom_in",), scripted=scripted)
                seconds[mode] += time.perf_counter() - started
                tokens[mode] = int(rollout.loss_mask.sum())
                turns[mode] = sum(t.turns for t in rollout.trajectories) / len(rollout.trajectories)
        rates = {mode: tokens[mode] * args.repeats / seconds[mode] for mode in seconds}
        print(f"{args.family} B={args.prompts} G={args.group_size} turns={turns['incremental']:.2f} "
              f"threads={threads}: incremental {rates['incremental']:.0f} tok/s, naive {rates['naive']:.0f} tok/s, "
              f"ratio {rates['incremental'] / rates['naive']:.2f}x")


if __name__ == "__main__":
    main()
