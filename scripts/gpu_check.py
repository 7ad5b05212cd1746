"""The GPU check: both rollout engines on models of real size, in one command, with nothing from the hub.

    pip install -e ".[vllm]"
    python scripts/gpu_check.py                 # about 5-8 minutes on one H100 / H200
    python scripts/gpu_check.py --models qwen2.5-vl-3b --steps 2

For each model (random weights, configs written below: a Qwen2.5-VL of about 3B and a Qwen3.5 of about 2B,
with the embedded tiny model's tokenizer and a processor of the family) and each engine (hf, vllm), it
trains a few steps in bf16 (B prompts x G completions of exactly --new-tokens tokens, a hash reward so
every group has signal, AdamW at lr 1e-6) and prints:

- seconds per step, split into rollout and update (the update includes the vLLM engine's weight sync);
- completion tokens per second of the rollout;
- the update's MFU: training FLOPs per token (gpg_vl/observe/perf.py) x tokens it computed / its seconds / the
  device's dense bf16 peak;
- the peak GPU memory torch allocated (vLLM's own pool is reported separately as the device's used memory);
- logp_mismatch (vLLM only): the mean and max over tokens of |vLLM's log-prob - the trainer's|;
- whether greedy decoding by vLLM after a weight sync gives the HF engine's (the trainer's) tokens.

With --server it also starts a real `vllm serve` on the model (VLLM_SERVER_DEV_MODE=1, --enable-scale-out,
--logprobs-mode processed_logprobs; the weight sync `disk`, the one the CPU suite runs against vLLM 0.32: safetensors
reloaded through /collective_rpc, each sync's version read back from /weight_info; --server-transfer nccl on a
second GPU checks vLLM's NCCL backend instead) and trains
the same steps through `rollout.engine=vllm_server` (docs/many-nodes.md): synchronously, and one step behind
(k = 1) where the trainer has the asynchronous pipeline (`trainer.max_staleness`); it prints the server's
generated tokens per second, the seconds of each weight sync and the log-prob gap (logp_mismatch); then the same
server as a distillation teacher (`teacher.urls`): which answer it gives (token ids on vLLM's V2 model runner,
else prompt_logprobs), its log-probs' gap to the trainer's scoring of sampled tokens, and the scoring's seconds:

    python scripts/gpu_check.py --models qwen2.5-vl-3b --engines hf --server

With --packing it also checks the packed update (trainer.packing=on: on CUDA in half precision, one varlen
flash-attention call per layer, gpg_vl/models/packing.py) on each model whose family packs: one sampled step, its
completions cut to lengths drawn from 8 to --new-tokens, updated from the same weights packed and padded; it prints
the two gradients' relative gap, each path's update seconds and their ratio (the same tokens, so the ratio of
tokens per second):

    python scripts/gpu_check.py --models qwen2.5-vl-3b --engines hf --packing

Without a CUDA GPU it stops in one sentence. It has not run on a GPU yet (see the README).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
import zlib
from pathlib import Path

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QWEN2_5_VL_3B = {  # Qwen/Qwen2.5-VL-3B-Instruct's published sizes
    "text_config": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                         "mrope_section": [16, 24, 24]}),
    "vision_config": dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                          fullatt_block_indexes=[7, 15, 23, 31], window_size=112, patch_size=14,
                          spatial_merge_size=2, temporal_patch_size=2, tokens_per_second=2),
}
QWEN3_5_2B = {  # about 2B: 24 layers in Qwen3.5's 3:1 Gated DeltaNet / full-attention pattern
    "text_config": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8,
                        num_key_value_heads=2, head_dim=256, vocab_size=151936, max_position_embeddings=32768,
                        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                        linear_num_key_heads=16, linear_num_value_heads=16,
                        layer_types=["linear_attention", "linear_attention", "linear_attention",
                                     "full_attention"] * 6,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                         "mrope_section": [11, 11, 10], "mrope_interleaved": True,
                                         "partial_rotary_factor": 0.25}),
    "vision_config": dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
                          patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304),
}
MODELS = {"qwen2.5-vl-3b": ("qwen2_5_vl", QWEN2_5_VL_3B), "qwen3.5-2b": ("qwen3_5", QWEN3_5_2B)}


def build(name: str, folder: Path):
    """(policy, folder): a random-weight bf16 model of real size on the GPU, its config and processor in
    `folder` (vLLM reads those; its weights come from the engine's first sync)."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    from gpg_vl.models.family import FAMILIES
    from gpg_vl.models.load import Policy
    from gpg_vl.models.tiny import build_tiny_family, tiny_model_path

    family_name, sizes = MODELS[name]
    tiny = tiny_model_path(family_name) if family_name != "qwen2_5_vl" else ROOT / "gpg_vl/assets/tiny-qwen2.5-vl"
    if not Path(tiny, "config.json").exists():
        build_tiny_family(tiny, family_name)
    config = AutoConfig.from_pretrained(tiny)
    config.text_config.update({k: v for k, v in sizes["text_config"].items()})
    config.vision_config.update(sizes["vision_config"])
    config.vision_config.out_hidden_size = config.text_config.hidden_size
    config.tie_word_embeddings = True
    processor = AutoProcessor.from_pretrained(tiny)
    config.save_pretrained(folder)
    processor.save_pretrained(folder)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    pixels = {"min_pixels": 56 * 56, "max_pixels": 224 * 224}
    family = FAMILIES[family_name](processor, model.config, **pixels)
    return Policy(model, processor, family, str(folder))


def rows(count: int, size: int) -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"id": f"gpu-{i}", "question": f"How many shapes? {i:03d}",
             "image": Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))} for i in range(count)]


def hash_task(data: list[dict]):
    from gpg_vl.data.task import Task, image_question

    class HashTask(Task):
        name = "gpu-check"

        def __init__(self) -> None:
            super().__init__()
            self.reward_functions = {"hash": lambda text, _row: (zlib.crc32(text.encode()) % 1000) / 1000}

        def load(self, split: str) -> list[dict]:
            return data

        def messages(self, row: dict) -> list[dict]:
            return image_question(row["image"], row["question"])

    return HashTask()


def run_engine(policy, engine_name: str, args) -> dict:
    """A few training steps with one engine: timings, tokens, MFU, memory, logp_mismatch, greedy agreement."""
    from accelerate import Accelerator
    from transformers import get_scheduler

    from gpg_vl.config.schema import RolloutSettings, TrainerSettings
    from gpg_vl.data.stream import PromptStream
    from gpg_vl.models.scoring import choose_scoring_path
    from gpg_vl.observe import perf
    from gpg_vl.rollout.engine import Sampling, build_engine, encode_prompts
    from gpg_vl.train.step.sample import collect_valid_groups, local_counts, sample_attempt
    from gpg_vl.train.step.update import Learner, update

    data = rows(args.prompts * (args.steps + 2), 224)
    task = hash_task(data)
    staleness = {"max_staleness": args.staleness} if getattr(args, "staleness", 0) else {}
    rollout = RolloutSettings(engine=engine_name, max_new_tokens=args.new_tokens, ignore_eos=True,
                              vllm={"gpu_memory_utilization": args.gpu_memory_utilization},
                              vllm_server=getattr(args, "server_settings", None) or {})
    trainer = TrainerSettings(group_size=args.group_size, batch_size=args.prompts, lr=1e-6, beta_th=0.0,
                              max_attempts=1, gradient_checkpointing=False, reward_workers=1, **staleness)
    accelerator = Accelerator(mixed_precision="no")
    model = policy.model
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=trainer.lr)
    scheduler = get_scheduler("constant", optimizer)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    engine = build_engine(rollout, policy, accelerator=accelerator)
    path = choose_scoring_path(policy.family, model, share_prompt=True, share_vision=True)
    stream = PromptStream(data, seed=0)
    learner = Learner(policy, model, optimizer, scheduler, accelerator, trainer, temperature=rollout.temperature,
                      path=path, correction=engine.correction)
    text = policy.model.config.text_config
    weights = perf.linear_weights(policy.model, skip=("visual", "vision"))
    layers, width = perf.attention_shape(text)
    peak = perf.peak_bf16_flops(torch.cuda.get_device_name())
    records = []
    for step in range(args.steps + 1):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        collected = collect_valid_groups(
            lambda: sample_attempt(policy, task, stream, engine=engine, trainer=trainer, rollout=rollout,
                                   warn=print),
            local_counts,
            beta_th=0.0, batch_size=args.prompts, max_attempts=1)
        torch.cuda.synchronize()
        rolled = time.perf_counter()
        result = update(learner, collected.attempts)
        torch.cuda.synchronize()
        synced = time.perf_counter()
        engine.sync(model, step + 1)
        torch.cuda.synchronize()
        done = time.perf_counter()
        attempt = collected.attempts[0]
        prompt_tokens = int(attempt.prompts.inputs["attention_mask"].sum())
        completion = int(attempt.rollout.completion_mask.sum())
        computed = prompt_tokens * (1 if path.prompt_once else args.group_size) + completion
        context = attempt.prompts.inputs["input_ids"].shape[1] + args.new_tokens
        flops = perf.train_flops_per_token(weights, layers, width, context)
        free, total = torch.cuda.mem_get_info()
        records.append({"rollout_s": rolled - started, "update_s": done - rolled, "completion": completion,
                        "sync_s": done - synced,
                        "mfu": perf.mfu(flops, computed, done - rolled, peak) if peak else float("nan"),
                        "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "used_gib": (total - free) / 2**30,
                        "mismatch": (result.get("logp_mismatch_mean"), result.get("logp_mismatch_max"))})
        print(f"  {engine_name} step {step} ({'warm-up' if step == 0 else 'measured'}): rollout "
              f"{records[-1]['rollout_s']:.2f} s + update {records[-1]['update_s']:.2f} s", flush=True)
    measured = records[1:]
    mean = {key: float(np.mean([r[key] for r in measured]))
            for key in ("rollout_s", "update_s", "completion", "mfu", "sync_s")}
    summary = {**mean, "tokens_per_s": mean["completion"] / mean["rollout_s"],
               "peak_gib": max(r["peak_gib"] for r in measured), "used_gib": max(r["used_gib"] for r in measured)}
    if engine.returns_logps:
        summary["mismatch_mean"] = float(np.mean([r["mismatch"][0] for r in measured]))
        summary["mismatch_max"] = max(r["mismatch"][1] for r in measured)
        prompts = encode_prompts(policy, [task.messages(r) for r in data[:args.prompts]])
        greedy = Sampling(max_new_tokens=32, greedy=True)
        ours = engine.generate(prompts, 1, greedy).completion_ids.cpu()
        theirs = build_engine(RolloutSettings(), policy).generate(prompts, 1, greedy).completion_ids.cpu()
        width_ = min(ours.shape[1], theirs.shape[1])
        summary["greedy_rows_equal"] = int((ours[:, :width_] == theirs[:, :width_]).all(dim=1).sum())
        summary["greedy_rows"] = ours.shape[0]
    engine.sleep()  # the next engine's run gets the memory
    torch.cuda.empty_cache()
    return summary


class KeepsGradient(torch.optim.SGD):
    """SGD at lr 0 that keeps the flattened gradient of its last step: the update runs, the weights stay."""

    def step(self, closure=None):
        self.grad = torch.cat([p.grad.detach().float().flatten() for group in self.param_groups
                               for p in group["params"] if p.grad is not None])
        return super().step(closure)


def packing_check(policy, args) -> dict:
    """--packing: one step sampled by the HF engine, its completions cut to lengths drawn from 8 to --new-tokens,
    updated from the same weights padded (trainer.packing=off) and packed (on): the gap between the two gradients,
    ||g_on - g_off|| / ||g_off||, and each path's update seconds over --steps after a warm-up (on CUDA in half
    precision the packed attention is one varlen flash-attention call per layer; elsewhere the CPU buckets)."""
    from dataclasses import replace

    from accelerate import Accelerator
    from transformers import get_scheduler

    sys.path.insert(0, str(ROOT / "scripts"))
    from benches.packing import drawn_lengths

    from gpg_vl.config.schema import RolloutSettings, TrainerSettings
    from gpg_vl.data.stream import PromptStream
    from gpg_vl.models.scoring import choose_scoring_path
    from gpg_vl.rollout.engine import build_engine
    from gpg_vl.train.step.sample import collect_valid_groups, local_counts, sample_attempt
    from gpg_vl.train.step.update import Learner, update

    cuda = next(policy.model.parameters()).is_cuda
    data = rows(args.prompts, 224)
    task = hash_task(data)
    rollout = RolloutSettings(engine="hf", max_new_tokens=args.new_tokens, ignore_eos=True)
    trainer = TrainerSettings(group_size=args.group_size, batch_size=args.prompts, lr=0.0, beta_th=0.0,
                              max_attempts=1, gradient_checkpointing=False, reward_workers=1, max_grad_norm=1e9)
    policy.model.train()
    collected = collect_valid_groups(
        lambda: sample_attempt(policy, task, PromptStream(data, seed=0), engine=build_engine(rollout, policy),
                               trainer=trainer, rollout=rollout, warn=print),
        local_counts, beta_th=0.0, batch_size=args.prompts, max_attempts=1)
    attempts = [drawn_lengths(a, f"8:{args.new_tokens}", 0) for a in collected.attempts]
    completion = sum(int(a.rollout.completion_mask.sum()) for a in attempts)
    result, gradients = {"completion": completion}, {}
    for mode in ("off", "on"):
        settings = replace(trainer, packing=mode)
        optimizer = KeepsGradient(policy.model.parameters(), lr=0.0)
        path = choose_scoring_path(policy.family, policy.model, share_prompt=True, share_vision=True, packing=mode)
        learner = Learner(policy, policy.model, optimizer, get_scheduler("constant", optimizer),
                          Accelerator(cpu=not cuda), settings, temperature=rollout.temperature, path=path)
        seconds = []
        for _ in range(args.steps + 1):
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            update(learner, attempts)
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - started)
        result[f"{mode}_s"], result[f"{mode}_path"] = float(np.mean(seconds[1:])), path.describe()
        gradients[mode] = optimizer.grad
    result["gradient_gap"] = float((gradients["on"] - gradients["off"]).norm() / gradients["off"].norm())
    return result


def start_server(folder: Path, args) -> tuple[subprocess.Popen, dict]:
    """A real `vllm serve` on the model folder (weights: the trainer's, from the first sync), and the engine's
    rollout.vllm_server settings for it; waits for /health (one sentence and the log's tail if it never answers)."""
    second_gpu = torch.cuda.device_count() > 1
    backend = args.server_transfer
    if backend == "nccl" and not second_gpu:
        raise SystemExit("error: --server-transfer nccl needs a second GPU for the server (NCCL cannot join two "
                         "processes on one GPU); use --server-transfer disk.")
    transfer = Path(folder) / "transfer"
    port = 8017
    # the model folder's own weights at start (a dummy load leaves buffers no reload fills), the trainer's after
    # the first sync; `disk` is the sync the CPU suite runs against vLLM 0.32 (no --weight-transfer-config)
    command = ["vllm", "serve", str(folder), "--port", str(port), "--dtype", "bfloat16",
               "--max-model-len", "4096", "--gpu-memory-utilization", str(args.gpu_memory_utilization),
               "--limit-mm-per-prompt", '{"image": 2}', "--enforce-eager",
               "--mm-processor-kwargs", '{"min_pixels": 3136, "max_pixels": 50176}', "--enable-scale-out",
               "--logprobs-mode", "processed_logprobs",
               *(["--weight-transfer-config", '{"backend": "nccl"}'] if backend == "nccl" else [])]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "CUDA_VISIBLE_DEVICES": "1" if second_gpu else "0"}
    log = open(Path(folder) / "vllm-serve.log", "w")  # noqa: SIM115 (open while the server runs)
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    print(f"  started: {' '.join(command)} (weight transfer {backend})", flush=True)
    for _ in range(900):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):  # noqa: S310
                break
        except OSError:
            if server.poll() is not None:
                break
            time.sleep(1)
    else:
        server.kill()
    if server.poll() is not None:
        tail = (Path(folder) / "vllm-serve.log").read_text()[-3000:]
        raise SystemExit(f"error: vllm serve did not start (exit {server.returncode}); its log ends:\n{tail}")
    settings = {"urls": f"http://127.0.0.1:{port}", "weight_transfer": backend, "timeout_s": 600,
                "sync_timeout_s": 600, **({"transfer_dir": str(transfer)} if backend == "disk" else {})}
    return server, settings


def server_runs(policy, folder: Path, args) -> list[tuple[str, dict]]:
    """The synchronous run through the server, then k = 1 where the trainer schedules it (else one line)."""
    from gpg_vl.config.schema import TrainerSettings

    server, args.server_settings = start_server(folder, args)
    results = []
    try:
        for staleness in (0, 1):
            if staleness and "max_staleness" not in TrainerSettings.__dataclass_fields__:
                print("  k=1: this trainer has no asynchronous pipeline (trainer.max_staleness); skipped")
                continue
            args.staleness = staleness
            results.append((f"vllm_server k={staleness}", run_engine(policy, "vllm_server", args)))
        from gpg_vl.config.schema import RolloutSettings
        from gpg_vl.rollout.engine import build_engine

        build_engine(RolloutSettings(engine="vllm_server", max_prompt_tokens=2048, max_new_tokens=args.new_tokens,
                                     vllm_server=args.server_settings), policy)  # the server holds the trainer's
        check = teacher_check(policy, args.server_settings["urls"], rows(args.prompts, 224), args.group_size,
                              args.new_tokens)
        print(f"  teacher.urls: asked by {'token ids (V2 runner)' if check['by_ids'] else 'prompt_logprobs'}; "
              f"log-prob gap to the trainer's scoring mean {check['gap_mean']:.2e}, max {check['gap_max']:.2e} "
              f"over {check['tokens']} tokens; {check['sequences']} sequences scored in {check['seconds']:.2f} s",
              flush=True)
    finally:
        server.kill()
        server.wait()
    return results


def teacher_check(policy, url: str, data: list[dict], group_size: int, new_tokens: int) -> dict:
    """The teacher on the server (`teacher.urls`, gpg_vl/train/teacher/server.py), the server holding `policy`'s
    weights: which answer the server gives (by token ids, vLLM's V2 model runner, renormalized without the vision
    placeholders, or by prompt_logprobs), the gap between its log-probs of sampled tokens and the trainer's own
    scoring of them (placeholders left out of the normalizer), and the seconds the scoring took."""
    from gpg_vl.config.schema import RolloutSettings, TeacherSettings, TrainerSettings
    from gpg_vl.rollout.engine import Sampling, build_engine, encode_prompts
    from gpg_vl.train.step.micro_batch import MicroBatch
    from gpg_vl.train.teacher.local import frozen_teacher
    from gpg_vl.train.teacher.server import connect_teacher

    task = hash_task(data)
    messages = [task.messages(row) for row in data]
    settings = RolloutSettings(max_prompt_tokens=2048, max_new_tokens=new_tokens)
    text = getattr(policy.model.config, "text_config", None) or policy.model.config
    served = connect_teacher(TeacherSettings(urls=url, timeout_s=600), tokenizer=policy.family.tokenizer,
                             vocab_size=text.vocab_size, rollout=settings).bind(policy)
    prompts = encode_prompts(policy, messages)
    rollout = build_engine(settings, policy).generate(prompts, group_size, Sampling(max_new_tokens=new_tokens))
    index = [b for b in range(len(messages)) for _ in range(group_size)]
    chunk = MicroBatch(prompts.batch, index, rollout.completion_ids, rollout.completion_mask,
                       torch.zeros(len(index)))
    device = policy.model.device
    began = time.perf_counter()
    found = served.logps(policy.family, chunk, device, temperature=1.0, logits_chunk_tokens=0, messages=messages)
    seconds = time.perf_counter() - began
    was_training, trained = policy.model.training, [p.requires_grad for p in policy.model.parameters()]
    teacher = frozen_teacher(policy.model, policy.family, TeacherSettings(model="in process"), TrainerSettings())
    expected = teacher.logps(policy.family, chunk, device, temperature=1.0, logits_chunk_tokens=0)
    for parameter, flag in zip(policy.model.parameters(), trained, strict=True):  # the policy as it was
        parameter.requires_grad_(flag)
    policy.model.train(was_training)
    mask = rollout.completion_mask.to(device).bool()
    gap = (found.float() - expected.float()).abs()[mask]
    return {"by_ids": served.by_ids, "gap_mean": float(gap.mean()), "gap_max": float(gap.max()),
            "seconds": seconds, "sequences": len(index), "tokens": int(mask.sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated: {', '.join(MODELS)}")
    parser.add_argument("--engines", default="hf,vllm")
    parser.add_argument("--prompts", type=int, default=4, help="B")
    parser.add_argument("--group-size", type=int, default=8, help="G")
    parser.add_argument("--new-tokens", type=int, default=256, help="completion length (EOS ignored)")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per engine (after one warm-up)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--server", action="store_true", help="also train through a real `vllm serve`")
    parser.add_argument("--server-transfer", default="disk", choices=["disk", "nccl"],
                        help="--server's weight sync: disk (the CPU suite's: /collective_rpc reload_weights) or nccl "
                             "(vLLM's weight-transfer backend; needs a second GPU for the server)")
    parser.add_argument("--packing", action="store_true",
                        help="also check the packed update (varlen flash attention) against the padded one")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: gpu_check.py needs a CUDA GPU and none is visible here; run it on a GPU machine "
              "(pip install -e \".[vllm]\").", file=sys.stderr)
        raise SystemExit(2)
    engines = args.engines.split(",")
    if ("vllm" in engines or args.server) and importlib.util.find_spec("vllm") is None:
        print("error: the vllm package is not installed; run pip install -e \".[vllm]\" or pass --engines hf.",
              file=sys.stderr)
        raise SystemExit(2)
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29517"}.items():
        os.environ.setdefault(key, value)  # vLLM's external_launcher reads the launch's process group
    torch.backends.cuda.matmul.allow_tf32 = True
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, B={args.prompts} x G={args.group_size}, "
          f"{args.new_tokens} new tokens, 224 px")
    table, packed = [], []
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory(prefix="gpg-vl-gpu-check-") as folder:
            policy = build(name, Path(folder))
            size = sum(p.numel() for p in policy.model.parameters()) / 1e9
            print(f"\n== {name}: {size:.2f}B parameters (random, bf16)")
            for engine in engines:
                table.append((name, engine, run_engine(policy, engine, args)))
            if args.server:
                table += [(name, engine, result) for engine, result in server_runs(policy, Path(folder), args)]
            if args.packing:
                why = policy.family.packing_unsupported(policy.model)
                packed.append((name, why or packing_check(policy, args)))
            del policy
            torch.cuda.empty_cache()
    print("\n| model | engine | s/step | rollout s | update s (sync s) | completion tok/s | update MFU | peak GiB "
          "(torch) | device used GiB | logp_mismatch mean / max | greedy vLLM = trainer |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, engine, s in table:
        mismatch = f"{s['mismatch_mean']:.4f} / {s['mismatch_max']:.3f}" if "mismatch_mean" in s else "-"
        greedy = f"{s['greedy_rows_equal']}/{s['greedy_rows']} rows" if "greedy_rows" in s else "-"
        print(f"| {name} | {engine} | {s['rollout_s'] + s['update_s']:.2f} | {s['rollout_s']:.2f} | "
              f"{s['update_s']:.2f} ({s['sync_s']:.2f}) | {s['tokens_per_s']:.0f} | {100 * s['mfu']:.1f}% | "
              f"{s['peak_gib']:.1f} | {s['used_gib']:.1f} | {mismatch} | {greedy} |")
    if packed:
        print_packing(packed)


def print_packing(packed: list[tuple[str, dict | str]]) -> None:
    """--packing's table: a family that cannot pack says why."""
    print("\n| model | packed update s | padded update s | packed / padded (tok/s) | gradient gap |")
    print("|---|---|---|---|---|")
    for name, s in packed:
        if isinstance(s, str):
            print(f"| {name} | does not pack: {s} | | | |")
            continue
        print(f"| {name} | {s['on_s']:.3f} | {s['off_s']:.3f} | {s['off_s'] / s['on_s']:.2f}x | "
              f"{s['gradient_gap']:.2e} |")
        print(f"  paths: packed = {s['on_path']}; padded = {s['off_path']}")


if __name__ == "__main__":
    main()
