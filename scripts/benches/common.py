"""What every benchmark of scripts/bench.py shares: the bench model (random weights, Qwen2.5-VL or Qwen3.5 sizes), its
prompts and hash reward, gpg-vl's step (`GpgRunner`, one per variant of `VARIANTS`) and TRL's GRPOTrainer on the same
work."""

from __future__ import annotations

import tempfile
import time
import zlib
from dataclasses import replace

import numpy as np
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
from gpg_vl.train.step.sample import collect_valid_groups, local_counts, sample_attempt
from gpg_vl.train.step.update import Learner, build_optimizer, update

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
        self.synced = getattr(self, "synced", 0) + 1
        self.engine.sync(self.policy.model, self.synced)  # an engine with weights of its own (vLLM) takes them
        measured = meter.stop()
        attempt = collected.attempts[0]
        prompt_tokens = int(attempt.prompts.inputs["attention_mask"].sum()) * self.settings.group_size
        return {**measured, "rollout_s": rolled - started, "update_s": updated - rolled,
                "sync_s": measured["step_s"] - (updated - started),
                "completion_tokens": int(attempt.rollout.completion_mask.sum()), "prompt_tokens": prompt_tokens,
                "groups_used": collected.groups_valid}


def alternate_updates(arms: dict, attempts, meter: Meter, order, *, threads: int, rounds: int) -> dict[str, list]:
    """`rounds` updates of each arm (name -> learner) on the same `attempts`, the arms in a fresh order each round
    (`order`: a random.Random), timed as a training loop runs them (on the heap's reused pages); each round's wall
    seconds printed. Returns name -> the meter's records, one per round."""
    records: dict[str, list[dict]] = {name: [] for name in arms}
    for index in range(rounds):
        for name in order.sample(list(arms), len(arms)):
            meter.start(trim=False)
            update(arms[name], attempts)
            records[name].append(meter.stop())
        print(f"  {threads} threads, round {index + 1}: " + " | ".join(
            f"{name} {r[-1]['step_s']:.2f} s" for name, r in records.items()), flush=True)
    return records


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
