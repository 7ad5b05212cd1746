"""Worker processes for tests/distributed/test_distributed.py, run as `python` (one process) or as the processes
of `accelerate launch` (the tests fork them with its environment: tests/helpers/procs.py).

    python tests/distributed/distributed_worker.py update OUT [--engine fsdp|fsdp_offload] [--float64]  # -> update()
    python tests/distributed/distributed_worker.py train OUT [--engine E] [--no-resume] -- key=value ...  # train()
    python tests/distributed/distributed_worker.py record OUT -- scripts/train.py key=value ...  # each rank observed
    python tests/distributed/distributed_worker.py fail_save OUT -- scripts/train.py key=value ...  # main's disk full

Several `update` and `train` jobs may share one launch, joined by `++` (each job's `--` ends at the next `++`):

    ... distributed_worker.py update OUT1 --engine fsdp ++ train OUT2 --engine fsdp -- key=value ...

A `record` job may come last (the script it runs ends the process group). Starting the processes (imports, the
process group, DeepSpeed's op) costs a small launch as much as its work, and the suite runs on 2 cores. Each
process writes OUT/rank<r>.json; `update` also writes OUT/<case>.pt (the final weights, main process); `record`
writes OUT/trained-<run folder>.pt (the weights before the final save, gathered).
`--engine fsdp` turns accelerate's FSDP2 on although the machine has no GPU: accelerate 1.15 enables FSDP
only for GPU-like devices (AcceleratorState keeps MULTI_CPU otherwise), while torch's FSDP2 itself runs on
CPU with gloo. The switch sets the state fields accelerate sets on a GPU machine (AcceleratorState.__init__).
`--engine fsdp_offload` is FSDP2 with its CPU offload policy (parameters, gradients and the optimizer step on
CPU): configs/accelerate/fsdp_offload.yaml.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import runpy
import sys
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch

GROUP_SIZE = 3
# Rewards of 8 groups (G = 3): groups 2, 5 and 7 are invalid (equal rewards), the others valid.
REWARDS = [[1.0, 0.0, 0.5], [0.0, 1.0, 1.0], [1.0, 1.0, 1.0], [0.2, 0.9, 0.4],
           [1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.5, 1.0, 0.0], [0.3, 0.3, 0.3]]
# Which groups each of 2 processes holds, per attempt (a step may have several attempts: resampling).
# With one process, that process holds all of them, in the same attempts.
CASES = {
    "even": [[[0, 2], [1, 3]], [[4, 6], [5, 7]]],  # like PromptStream.next_local: 3 valid groups against 2
    "uneven": [[[0, 1, 2], [3]], [[4, 5, 6, 7], []]],  # 4 valid groups against 1, and an attempt with no prompt
    "one_without_valid": [[[0, 1, 3], [2]], [[4, 6], [5, 7]]],  # process 1: invalid groups only
    "one_without_prompts": [[[0, 1, 2, 3], []], [[4, 5, 6, 7], []]],  # process 1: no prompt at all
    # GRPO over 2 epochs with a KL to the frozen reference: old and reference log-probs are scored too, and
    # process 1 holds fewer micro-batches (placeholders keep FSDP's collective forwards in step)
    "grpo_uneven": [[[0, 1, 2], [3]], [[4, 5, 6, 7], []]],
    # the top 20% of entropy only, one micro-batch per attempt: its threshold over both processes' tokens (TRL
    # gathers them) is one process's; process 1 has one micro-batch fewer (its last gather alone)
    "entropy_uneven": [[[0, 1, 2], [3]], [[4, 5, 6, 7], []]],
}
LOSSES = {"grpo_uneven": {"loss": "grpo", "ppo_epochs": 2, "kl_coef": 0.04, "clip_low": 0.2, "age": False},
          "entropy_uneven": {"top_entropy_quantile": 0.2, "micro_batch_size": 64}}


def make_accelerator(engine: str):
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, InitProcessGroupKwargs

    # A collective that never completes fails after 120 s instead of hanging the test run.
    timeout = timedelta(seconds=120)
    if engine.startswith("zero"):  # launched with configs/accelerate/zero2.yaml / zero3.yaml: DeepSpeed on gloo
        accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timeout)])
        config = accelerator.state.deepspeed_plugin.deepspeed_config
        config["gradient_clipping"] = 0.0  # plain SGD without clipping, as one process runs it (run_update)
        config["train_micro_batch_size_per_gpu"] = 1  # bookkeeping, as the trainer's _check_engine sets it
        return accelerator
    accelerator = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=timeout)])
    if engine.startswith("fsdp") and accelerator.num_processes > 1:
        accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap", state_dict_type="FULL_STATE_DICT",
            reshard_after_forward=True, cpu_offload=engine == "fsdp_offload")
        if engine == "fsdp_offload":  # no CUDA here to pin host memory for; on GPUs accelerate pins it
            from torch.distributed.fsdp import CPUOffloadPolicy

            accelerator.state.fsdp_plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)
        accelerator.state.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # as AcceleratorState.__init__ does
    return accelerator


def fixed_rollouts(policy, task):
    """8 prompts of the shapes task, G completions each with known tokens, lengths and rewards."""
    from gpg_vl.models.batch import PromptBatch
    from gpg_vl.objective import group_advantages

    rows = task.load(task.train_split)[:len(REWARDS)]
    prompts: PromptBatch = policy.family.encode([task.messages(r) for r in rows], ids=[str(i) for i in range(8)])
    generator = torch.Generator().manual_seed(1)
    count, width = len(rows) * GROUP_SIZE, 7
    vocab = policy.model.get_input_embeddings().num_embeddings
    allowed = torch.tensor([t for t in range(vocab) if t not in policy.family.suppressed_ids])
    ids = allowed[torch.randint(len(allowed), (count, width), generator=generator)]  # [8 * G, 7]
    lengths = torch.randint(1, width + 1, (count,), generator=generator)  # [8 * G]
    mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)  # [8 * G, 7]
    ids = ids.masked_fill(~mask, policy.family.pad_id)
    rewards = torch.tensor(REWARDS)  # [8, G]
    advantages, valid = group_advantages(rewards)
    return rows, prompts, ids, mask, rewards, advantages, valid


def attempt_for(groups, rows, prompts, ids, mask, rewards, advantages, valid):
    from gpg_vl.rollout.types import Rollout
    from gpg_vl.train.step.sample import Attempt

    if not groups:
        empty = torch.zeros(0, GROUP_SIZE)
        return Attempt([], None, None, empty, {}, empty, torch.zeros(0, dtype=torch.bool))
    sequences = [b * GROUP_SIZE + g for b in groups for g in range(GROUP_SIZE)]
    rollout = Rollout(ids[sequences], mask[sequences], [""] * len(sequences), GROUP_SIZE)
    return Attempt([rows[b] for b in groups], prompts.select(groups), rollout, rewards[groups], {},
                   advantages[groups], valid[groups])


def full_weights(accelerator, model) -> dict[str, torch.Tensor]:
    state = accelerator.get_state_dict(model)  # collective under FSDP / ZeRO-3: called by every process
    return {k: v.detach().cpu().clone() for k, v in (state or {}).items()}  # ZeRO-3: the main process's only


def digest(weights: dict[str, torch.Tensor]) -> str:
    sha = hashlib.sha256()
    for name in sorted(weights):
        sha.update(name.encode())
        sha.update(weights[name].float().contiguous().numpy().tobytes())
    return sha.hexdigest()


def run_update(out: Path, engine: str, dtype: str, cases: list[str] | None = None) -> None:
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import FSDPModule
    from transformers import get_scheduler

    from gpg_vl import get_task
    from gpg_vl.config.schema import TrainerSettings
    from gpg_vl.models.load import Policy, load_policy
    from gpg_vl.models.scoring import choose_scoring_path
    from gpg_vl.train.step.reference import build_reference, place_reference
    from gpg_vl.train.step.update import Learner, update

    accelerator = make_accelerator(engine)
    rank, world = accelerator.process_index, accelerator.num_processes
    task = get_task("shapes", train_size=16, test_size=4)
    # Plain SGD without clipping: the weights then move by exactly lr x the gradient, so a gradient off by
    # any factor (a missing x num_processes, a local normalizer) shows. AdamW's first step (g / |g|) and
    # clipping to a norm would both hide a wrong scale; the trainer's own optimizer is tested elsewhere.
    settings = TrainerSettings(group_size=GROUP_SIZE, micro_batch_size=4, lr=0.1, max_grad_norm=1e9)
    results = {"world": world, "engine": str(accelerator.distributed_type), "cases": {}}
    for case, attempts_by_process in CASES.items():
        if cases and case not in cases:
            continue
        torch.manual_seed(0)
        policy = load_policy("embedded:tiny-qwen2.5-vl", dtype=dtype, min_pixels=3136, max_pixels=50176)
        fixed = fixed_rollouts(policy, task)
        mine = [sum(share, []) if world == 1 else share[rank] for share in attempts_by_process]
        attempts = [attempt_for(sorted(groups), *fixed) for groups in mine]
        model = policy.model
        initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        case_settings = replace(settings, **LOSSES.get(case, {}))
        reference = build_reference(model, case_settings, None, resuming=False)  # the initial weights, frozen
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=settings.lr)
        scheduler = get_scheduler("constant", optimizer)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        policy = Policy(accelerator.unwrap_model(model), policy.processor, policy.family, policy.name_or_path)
        results["offload"] = sorted({type(group.offload_policy).__name__ for module in model.modules()
                                     if hasattr(module, "_get_fsdp_state")
                                     for group in module._get_fsdp_state()._fsdp_param_groups})
        reference = place_reference(reference, accelerator)  # sharded like the policy under FSDP2
        if reference is not None and accelerator.distributed_type == DistributedType.FSDP:
            results["reference_sharded"] = isinstance(reference.model, FSDPModule)
        path = choose_scoring_path(policy.family, model, share_prompt=case_settings.share_prompt,
                                   share_vision=case_settings.share_vision)
        learner = Learner(policy, model, optimizer, scheduler, accelerator, case_settings, temperature=1.0, path=path,
                          reference=reference)
        metrics = [update(learner, attempts) for _ in range(2)]
        weights = full_weights(accelerator, model)
        if accelerator.is_main_process:
            torch.save(weights, out / f"{case}.pt")
        # (ZeRO-3 loads the model partitioned: `initial` holds empty shards there, so no change is measured)
        moved = max(float((weights[k] - initial[k]).abs().max()) for k in weights) \
            if weights and engine != "zero3" else None
        results["cases"][case] = {"metrics": metrics, "sha256": digest(weights) if weights else None,
                                  "largest_change": moved}
        accelerator.free_memory()
    (out / f"rank{rank}.json").write_text(json.dumps(results, indent=1))


def run_train(out: Path, engine: str, overrides: list[str], *, resume: bool = True) -> None:
    """train() end to end (rollouts, update, evaluation, checkpoints) into OUT/a, then (`resume`) again into OUT/b
    resumed from OUT/a/checkpoint-1: a resume on the same number of processes must end on the same weights."""
    from omegaconf import OmegaConf

    from gpg_vl.config.compose import load_config
    from gpg_vl.config.schema import EvalSettings, RolloutSettings, TrainerSettings
    from gpg_vl.train.build import build_policy, build_task
    from gpg_vl.train.loop import RunSettings, setup_policy, train
    from gpg_vl.train.step.reference import needs_reference

    accelerator = make_accelerator(engine)
    result = {"engine": str(accelerator.distributed_type), "saves": {}}
    seen = count_saves({})
    runs = (("a", []), ("b", [f"resume={out / 'a' / 'checkpoint-1'}"]))
    for run, extra in runs if resume else runs[:1]:
        cfg = load_config("train", [*overrides, f"output_dir={out / run}", *extra])
        model_cfg = OmegaConf.merge(cfg.model, {"name_or_path": str(cfg.resume)}) if cfg.resume else cfg.model
        container = OmegaConf.to_container(cfg, resolve=True)
        settings = RunSettings(TrainerSettings(**container["trainer"]), RolloutSettings(**container["rollout"]),
                               EvalSettings(**container["eval"]), output_dir=cfg.output_dir, seed=cfg.seed,
                               resume_from=cfg.resume, config=container)
        # a KL loss scores the initial weights: a resumed run gets them rebuilt, as the command line does
        reference = build_policy(cfg.model, accelerator.device).model if cfg.resume and needs_reference(
            settings.trainer) else None
        seen["saves"] = 0
        result[run] = train(setup_policy(build_policy(model_cfg, accelerator.device), build_task(cfg.task, cfg.data),
                                         settings, accelerator=accelerator, reference=reference))
        result["saves"][run] = seen["saves"]
        accelerator.free_memory()  # forget run a's model: a real run prepares one (FSDP2 allows one at a time)
    (out / f"rank{accelerator.process_index}.json").write_text(json.dumps(result, indent=1, default=str))


def gathered(parameter: torch.nn.Parameter):
    """A ZeRO-3 parameter (partitioned: it has a ds_id) whole inside the block; any other as it is."""
    if hasattr(parameter, "ds_id"):
        import deepspeed

        return deepspeed.zero.GatheredParameters([parameter], modifier_rank=None)
    return contextlib.nullcontext()


def count_saves(seen: dict) -> dict:
    """Count this process's model saves in seen["saves"] from now on."""
    from transformers import PreTrainedModel

    seen["saves"] = 0
    save_pretrained = PreTrainedModel.save_pretrained

    def counted_save(self, *args, **kwargs):
        seen["saves"] += 1
        return save_pretrained(self, *args, **kwargs)

    PreTrainedModel.save_pretrained = counted_save
    return seen


def keep_final_weights(out: Path, seen: dict) -> None:
    """Before a run's final save, write the trained weights as every process holds them, gathered parameter by
    parameter (ZeRO-3: deepspeed.zero.GatheredParameters), apart from the save's own gathering:
    OUT/trained-<run folder>.pt (main process); seen["engine"] names the distributed type."""
    import gpg_vl.train.loop as trainer

    save_checkpoint = trainer.save_checkpoint

    def gathered_then_saved(path, learner, *args, **kwargs):
        if Path(path).name == "final":
            seen["engine"] = str(learner.accelerator.distributed_type)
            trained = {}
            for name, parameter in learner.policy.model.named_parameters():
                with gathered(parameter):  # collective under ZeRO-3: every process, in the same order
                    trained[name] = parameter.detach().clone()
            if learner.accelerator.is_main_process:
                torch.save(trained, out / f"trained-{Path(path).parent.name}.pt")
        return save_checkpoint(path, learner, *args, **kwargs)

    trainer.save_checkpoint = gathered_then_saved


def run_recorded(out: Path, script: str, arguments: list[str]) -> None:
    """Run `script` as __main__ and write what THIS process computed: each step's global counts, its own sampled
    completions, reward statistics and update results, and how many times it saved a model."""
    import os

    import gpg_vl.train.loop as trainer
    import gpg_vl.train.step.pipeline as pipeline

    seen = {"collected": [], "sampled": [], "step_metrics": [], "update": []}

    def wrap(name, key, record, module=trainer):
        original = getattr(module, name)

        def recorded(*args, **kwargs):
            value = original(*args, **kwargs)
            seen[key].append(record(value))
            return value

        setattr(module, name, recorded)

    wrap("collect_valid_groups", "collected", lambda c: {
        "groups_sampled": c.groups_sampled, "groups_valid": c.groups_valid, "valid_fractions": c.valid_fractions,
        "attempts": len(c.attempts)}, pipeline)  # the sampling stage (gpg_vl/train/step/pipeline.py) collects
    wrap("collect_valid_groups", "sampled", lambda c: [  # this process's own completions, per attempt
        a.rollout.completion_ids.tolist() if a.rollout is not None else [] for a in c.attempts], pipeline)
    wrap("step_metrics", "step_metrics", dict)
    wrap("update", "update", dict)
    count_saves(seen)
    keep_final_weights(out, seen)
    sys.argv = [script, *arguments]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        if exit_.code not in (None, 0):
            raise
    finally:
        (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(seen, indent=1))


def run_failing_save(script: str, arguments: list[str]) -> None:
    """Run `script` as __main__ with the main process's disk full when it writes a checkpoint's trainer state
    (every other process saves nothing itself): its exit status is the script's."""
    import errno
    import os

    from gpg_vl.train.checkpoint import save as checkpoint

    if os.environ.get("RANK", "0") == "0":
        def full(folder, state):
            raise OSError(errno.ENOSPC, "No space left on device")

        checkpoint._write_trainer_state = full
    sys.argv = [script, *arguments]
    runpy.run_path(script, run_name="__main__")


def run_job(mode: str, out: str, *rest: str) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    split = rest.index("--") if "--" in rest else len(rest)
    options, extra = rest[:split], list(rest[split + 1:])
    engine = options[options.index("--engine") + 1] if "--engine" in options else "default"
    if mode == "update":
        cases = options[options.index("--cases") + 1].split(",") if "--cases" in options else None
        run_update(out, engine, "float64" if "--float64" in options else "float32", cases)
    elif mode == "train":
        run_train(out, engine, extra, resume="--no-resume" not in options)
    elif mode == "record":
        run_recorded(out, extra[0], extra[1:])
    elif mode == "fail_save":
        run_failing_save(extra[0], extra[1:])
    else:
        raise SystemExit(f"unknown mode {mode!r}")


def main() -> None:
    jobs = [[]]
    for argument in sys.argv[1:]:
        if argument == "++":
            jobs.append([])
        else:
            jobs[-1].append(argument)
    for job in jobs:
        run_job(*job)
    if torch.distributed.is_initialized():  # the jobs' one process group, left for the last one
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
