"""Crash-safe checkpoints: `save_checkpoint` writes one atomically (what a checkpoint folder holds:
gpg_vl/train/checkpoint/folder.py).

Writes are atomic: everything goes into `<name>.partial/`, each file is fsynced, then the folder is renamed
into place (and its parent fsynced). A kill at any moment, even in the middle of a save, leaves at most a
`.partial` folder, which `latest_checkpoint` ignores and `remove_partials` deletes; the newest complete
checkpoint stays usable. Only the last `keep` `checkpoint-<step>/` folders are kept. A save that fails for
lack of space (or any other write error) removes its `.partial` folder and stops the run with one sentence
naming the newest intact checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from gpg_vl.errors import UserError
from gpg_vl.files import PARTIAL
from gpg_vl.models.lora import save_model
from gpg_vl.models.weights import checkpoint_conversions
from gpg_vl.train.checkpoint.folder import (
    MARKER_FILE,
    OLD,
    SAMPLER_FILE,
    STATE_FILE,
    ZERO_STATE,
    file_sha256,
    numbered_checkpoints,
    remove_checkpoint,
    unwritable,
)


# ---------------------------------------------------------------------------------------------
# RNG states as tensors and numbers (weights_only-loadable)
# ---------------------------------------------------------------------------------------------
def rng_state() -> dict:
    """This process's python, numpy, torch and CUDA RNG states, as tensors and numbers."""
    version, internal, gauss = random.getstate()
    _, keys, position, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


# ---------------------------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------------------------
def save_checkpoint(path: Path, learner, stream, step: int, *, keep: int = 0, counters: dict | None = None,
                    config: dict | None = None, record: dict | None = None, in_flight: dict | None = None) -> None:
    """Write a complete checkpoint of `learner` (gpg_vl/train/step/update.py: the policy, its prepared model,
    optimizer and schedule) and `stream` at `step` to `path` atomically (see the module doc); every process
    calls it.

    The main process writes the files; the RNG states of every process are gathered into the trainer state.
    `counters` (numbers) and `record` (the run's summary so far: its pre-training evaluation, its training
    time) go into the trainer state, `config` into checkpoint.json. `in_flight` (trainer.max_staleness >= 1,
    gpg_vl/train/step/pipeline.py's `state_dict`) regenerates the steps sampled ahead of the learner: the sampler's
    state goes into the trainer state (its data position replaces the stream's), the older weights it samples with
    into sampler.safetensors.
    `keep > 0` deletes all but the newest `keep` `checkpoint-<step>/` folders next to `path`. Every process
    calls it at the same step (save_every and the final save depend on the step only), so each reaches every
    collective below.
    """
    from accelerate.utils import DistributedType, gather_object

    policy, model, optimizer, scheduler = learner.policy, learner.model, learner.optimizer, learner.scheduler
    accelerator = learner.accelerator
    path = Path(path)
    accelerator.wait_for_everyone()  # collective: no process still uses the previous checkpoint folder
    # Collective under FSDP / ZeRO-3 (each process holds a shard): every process gathers the full weights.
    sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
    weights = accelerator.get_state_dict(model) if sharded else None
    optimizer_state = _full_optimizer_state(accelerator, model, optimizer)  # collective under FSDP
    rng = gather_object([rng_state()])  # collective: one entry per process, in rank order
    failure = None
    zero = accelerator.distributed_type == DistributedType.DEEPSPEED
    if zero:  # collective: every process writes its partition of the ZeRO optimizer state into the partial folder
        failure = _save_zero_state(accelerator, model, path)
    if accelerator.is_main_process and failure is None:
        state = {"step": step, "optimizer": optimizer_state, "scheduler": scheduler.state_dict(),
                 "data": stream.state_dict() if in_flight is None else in_flight["stream"], "rng": rng,
                 "counters": counters or {}, "record": record or {}}
        try:
            _write_checkpoint(path, accelerator.unwrap_model(model), policy, weights, state, config, keep,
                              fresh=not zero, in_flight=in_flight)
        except UserError as error:
            failure = error
    # collective, in place of a barrier: every process learns whether the save failed, so that all of them end
    # at once with the main process's sentence (not at the collective timeout, waiting for a process that left)
    said = _on_every_process(accelerator, None if failure is None else str(failure))
    if failure is not None:
        raise failure
    if said is not None:
        raise UserError(said)


def _save_zero_state(accelerator, engine, path: Path) -> UserError | None:
    """Under DeepSpeed (collective): the main process starts `<path>.partial`, then every process writes its
    partition of the ZeRO optimizer state (AdamW's moments and the fp32 master weights) into its `zero/` folder
    with the engine's own `save_checkpoint`, which a resume on as many processes loads back. The main process's
    failure, or None (another process's failure reaches it through DeepSpeed's own collectives)."""
    partial = path.with_name(path.name + PARTIAL)
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    try:
        engine.save_checkpoint(str(partial / ZERO_STATE), tag=ZERO_STATE, save_latest=False,
                               exclude_frozen_parameters=True)
    except Exception as error:  # noqa: BLE001  a full disk, most often
        if accelerator.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)
        return unwritable(f"save {path.name}", path.parent, error)
    return None


def _on_every_process(accelerator, message: str | None) -> str | None:
    """The main process's `message`, broadcast to every process (collective with several processes)."""
    if accelerator.num_processes == 1:
        return message
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([message], from_process=0)[0]


def _write_checkpoint(path: Path, model, policy, weights, state: dict, config: dict | None, keep: int, *,
                      fresh: bool = True, in_flight: dict | None = None) -> None:
    """The main process's part of `save_checkpoint`: the files into `<path>.partial` (started afresh, or, not
    `fresh`, holding the ZeRO state already), then renamed to `path`; the oldest checkpoints past `keep`
    removed; with `in_flight`, the sampler's state and weights too. A failure removes the partial folder and
    raises `unwritable`'s sentence."""
    partial = path.with_name(path.name + PARTIAL)
    try:
        if fresh:
            shutil.rmtree(partial, ignore_errors=True)
        if weights is None:
            save_model(model, partial, getattr(policy, "save_format", "full"))
        else:  # the weights gathered by every process (FSDP / DeepSpeed), saved in full
            with checkpoint_conversions(model):
                model.save_pretrained(partial, state_dict=weights, safe_serialization=True)
        policy.processor.save_pretrained(partial)
        if in_flight is not None:
            state = {**state, "sampler": _sampler_state(partial, in_flight)}
        _write_trainer_state(partial, state)
        (partial / MARKER_FILE).write_text(json.dumps({"step": state["step"], "files": _manifest(partial),
                                                       "config": config or {}}, default=str))
        _fsync_tree(partial)
        _replace(partial, path)
    except UserError:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    except Exception as error:  # an OSError, and what torch.save / safetensors raise for a short write
        shutil.rmtree(partial, ignore_errors=True)  # frees the space the failed save took
        raise unwritable(f"save {path.name}", path.parent, error) from None
    if keep > 0:
        for _, stale in sorted(numbered_checkpoints(path.parent), key=lambda item: item[0])[:-keep]:
            remove_checkpoint(stale)


def _full_optimizer_state(accelerator, model, optimizer) -> dict | None:
    """The optimizer state as one process-count-free dict; None under DeepSpeed (the ZeRO optimizer's own
    partitioned state is saved by the engine: `_save_zero_state`)."""
    from accelerate.utils import DistributedType

    if accelerator.is_fsdp2:  # collective: every process contributes its shard, every one gets the whole
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer.optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return None
    return optimizer.state_dict()  # DDP / one process: the same on every process


def _write_trainer_state(folder: Path, state: dict) -> None:
    torch.save(state, folder / STATE_FILE)


def _manifest(folder: Path) -> dict[str, dict]:
    """Size and sha256 of every file under `folder` (its marker aside), by relative path."""
    return {file.relative_to(folder).as_posix(): {"size": file.stat().st_size, "sha256": file_sha256(file)}
            for file in sorted(folder.rglob("*")) if file.is_file() and file.name != MARKER_FILE}


def _replace(partial: Path, path: Path) -> None:
    """Rename `partial` to `path`; an existing `path` is moved aside first and deleted afterwards."""
    old = path.with_name(path.name + OLD)
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    partial.rename(path)
    _fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def _fsync_tree(folder: Path) -> None:
    for file in folder.rglob("*"):
        if file.is_file():
            descriptor = os.open(file, os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    if os.name == "nt":  # folders cannot be opened (nor need to be synced) there
        return
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _sampler_state(folder: Path, in_flight: dict) -> dict:
    """Write the older weight versions of `in_flight` to folder/sampler.safetensors; the rest, for the state."""
    from safetensors.torch import save_file

    tensors = {f"{version}/{name}": value.detach().contiguous().cpu()
               for version, weights in in_flight["weights"].items() for name, value in weights.items()}
    save_file(tensors, folder / SAMPLER_FILE)
    return {"generator": in_flight["generator"], "counters": in_flight["counters"],
            "next_step": in_flight["next_step"], "max_staleness": in_flight["max_staleness"],
            "versions": sorted(in_flight["weights"])}

