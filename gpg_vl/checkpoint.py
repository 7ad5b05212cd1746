"""Crash-safe checkpoints and exact resume.

A checkpoint folder (`checkpoint-<step>/`, or `final/`) holds
- the model and its processor in Hugging Face format, the weights as safetensors (with LoRA, the adapter or the
  merged weights, as `model.lora.save` says: `gpg_vl.models.lora.save_model`);
- `trainer_state.pt`: the step, the optimizer and LR scheduler states, every RNG state (python, numpy,
  torch, CUDA; one set per process), the data position and the run's counters. It holds only tensors,
  numbers, strings, lists and dicts, and is read with `torch.load(weights_only=True)`: loading a
  checkpoint never unpickles code;
- `checkpoint.json`, written last: `{"step": N}`, the mark of a complete checkpoint.

Writes are atomic: everything goes into `<name>.partial/`, each file is fsynced, then the folder is renamed
into place (and its parent fsynced). A kill at any moment, even in the middle of a save, leaves at most a
`.partial` folder, which `latest_checkpoint` ignores and `remove_partials` deletes; the newest complete
checkpoint stays usable. Only the last `keep` `checkpoint-<step>/` folders are kept.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from gpg_vl.errors import UserError
from gpg_vl.models.lora import save_model

STATE_FILE = "trainer_state.pt"
MARKER_FILE = "checkpoint.json"
PARTIAL = ".partial"
OLD = ".old"  # a folder being replaced: renamed aside, deleted once the new one is in place
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")


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


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` returned."""
    python = state["python"]
    random.setstate((int(python["version"]), tuple(int(v) for v in python["internal"].tolist()), python["gauss"]))
    numpy = state["numpy"]
    np.random.set_state(("MT19937", numpy["keys"].numpy().astype(np.uint32), int(numpy["position"]),
                         int(numpy["has_gauss"]), float(numpy["cached_gaussian"])))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------------------------
def save_checkpoint(path: Path, policy, model, optimizer, scheduler, stream, step: int, accelerator, *,
                    keep: int = 0, counters: dict | None = None) -> None:
    """Write a complete checkpoint to `path` atomically (see the module doc); every process calls it.

    The main process writes the files; the RNG states of every process are gathered into the trainer state.
    `keep > 0` deletes all but the newest `keep` `checkpoint-<step>/` folders next to `path`. Every process
    calls it at the same step (save_every and the final save depend on the step only), so each reaches every
    collective below.
    """
    from accelerate.utils import DistributedType, gather_object

    path = Path(path)
    accelerator.wait_for_everyone()  # collective: no process still uses the previous checkpoint folder
    # Collective under FSDP / ZeRO-3 (each process holds a shard): every process gathers the full weights.
    sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
    weights = accelerator.get_state_dict(model) if sharded else None
    optimizer_state = _full_optimizer_state(accelerator, model, optimizer)  # collective under FSDP
    rng = gather_object([rng_state()])  # collective: one entry per process, in rank order
    if accelerator.is_main_process:
        partial = path.with_name(path.name + PARTIAL)
        shutil.rmtree(partial, ignore_errors=True)
        if weights is None:
            save_model(accelerator.unwrap_model(model), partial, getattr(policy, "save_format", "full"))
        else:  # the weights gathered above (FSDP / DeepSpeed), saved in full
            accelerator.unwrap_model(model).save_pretrained(partial, state_dict=weights, safe_serialization=True)
        policy.processor.save_pretrained(partial)
        _write_trainer_state(partial, {
            "step": step, "optimizer": optimizer_state, "scheduler": scheduler.state_dict(),
            "data": stream.state_dict(), "rng": rng, "counters": counters or {}})
        (partial / MARKER_FILE).write_text(json.dumps({"step": step}))
        _fsync_tree(partial)
        _replace(partial, path)
        if keep > 0:
            for _, stale in sorted(_checkpoints(path.parent), key=lambda item: item[0])[:-keep]:
                remove_checkpoint(stale)
    accelerator.wait_for_everyone()  # collective: the checkpoint exists for every process once this returns


def _full_optimizer_state(accelerator, model, optimizer) -> dict | None:
    """The optimizer state as one process-count-free dict; None under DeepSpeed (the ZeRO optimizer keeps
    its own partitioned state: a resume there restarts the AdamW moments)."""
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


def _replace(partial: Path, path: Path) -> None:
    """Rename `partial` to `path`; an existing `path` is moved aside first and deleted afterwards."""
    old = path.with_name(path.name + OLD)
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    partial.rename(path)
    _fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint folder: renamed aside first, so that a kill during the deletion never leaves a
    half-deleted folder that still looks complete."""
    old = path.with_name(path.name + OLD)
    shutil.rmtree(old, ignore_errors=True)
    path.rename(old)
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


# ---------------------------------------------------------------------------------------------
# find + load
# ---------------------------------------------------------------------------------------------
def checkpoint_step(path: Path) -> int | None:
    """The step of a complete checkpoint folder; None when `path` is not one (partial, missing, foreign)."""
    path = Path(path)
    if path.name.endswith((PARTIAL, OLD)) or not (path / STATE_FILE).is_file():
        return None
    try:
        return int(json.loads((path / MARKER_FILE).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete `checkpoint-<step>/` folders in `folder`."""
    found = []
    for child in Path(folder).glob("checkpoint-*"):
        if _CHECKPOINT.fullmatch(child.name) and checkpoint_step(child) is not None:
            found.append((checkpoint_step(child), child))
    return found


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in `output_dir` (`checkpoint-<step>/`, or `final/` when it is further on);
    `.partial` folders and folders without their marker are never chosen."""
    output_dir = Path(output_dir)
    candidates = _checkpoints(output_dir) if output_dir.is_dir() else []
    final = output_dir / "final"
    if checkpoint_step(final) is not None:
        candidates.append((checkpoint_step(final), final))
    if not candidates:
        return None
    return max(candidates, key=lambda item: (item[0], item[1].name != "final"))[1]


def later_checkpoints(output_dir: str | os.PathLike, step: int) -> list[Path]:
    """The complete checkpoints in `output_dir` past `step` (`final/` included): a run resumed at `step` replaces
    them, and removes them first so that resume=auto never picks one of the abandoned continuation."""
    output_dir = Path(output_dir)
    found = [path for found_step, path in _checkpoints(output_dir) if found_step > step] if output_dir.is_dir() else []
    final_step = checkpoint_step(output_dir / "final")
    if final_step is not None and final_step > step:
        found.append(output_dir / "final")
    return found


def remove_partials(output_dir: str | os.PathLike) -> list[Path]:
    """Delete the `.partial` and `.old` folders an interrupted save left in `output_dir`; returns them."""
    output_dir = Path(output_dir)
    leftovers = [p for p in output_dir.glob("*") if p.is_dir() and p.name.endswith((PARTIAL, OLD))] \
        if output_dir.is_dir() else []
    for leftover in leftovers:
        shutil.rmtree(leftover, ignore_errors=True)
    return leftovers


def resolve_resume(resume, output_dir: str | os.PathLike) -> Path | None:
    """The checkpoint that `resume=` names: None (start afresh), `auto` (the newest complete checkpoint in
    `output_dir`, None when there is none) or a checkpoint folder, which must be complete."""
    if resume is None or str(resume) in ("", "null", "none", "None"):
        return None
    if str(resume) == "auto":
        return latest_checkpoint(output_dir)
    path = Path(str(resume)).expanduser()
    if checkpoint_step(path) is None:
        raise UserError(f"resume={str(resume)!r} is not a complete checkpoint (a folder with {MARKER_FILE} and "
                        f"{STATE_FILE}, e.g. {Path(output_dir) / 'checkpoint-100'}); pass one, or resume=auto to "
                        "continue from the newest one in output_dir.")
    return path


def load_trainer_state(path: Path, optimizer, scheduler, stream, *, accelerator=None, model=None,
                       counters: dict | None = None) -> int:
    """Restore optimizer, scheduler, data position and this process's RNG states from a checkpoint; returns
    its step. `counters`, when given, is updated with the run's saved counters. Every process calls it (under
    FSDP it is collective: each process loads its shard of the optimizer state)."""
    file = Path(path) / STATE_FILE
    try:
        state = torch.load(file, weights_only=True, map_location="cpu")
    except Exception as error:  # unpickling refused (an old or foreign file), truncated file
        raise UserError(f"cannot read the trainer state {str(file)!r} ({str(error).splitlines()[0][:160]}); "
                        "resume from a checkpoint written by this version of gpg-vl.") from None
    if accelerator is not None and accelerator.is_fsdp2:  # collective: every process loads its shard
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer.optimizer, state["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
    elif state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
    elif accelerator is not None:
        accelerator.print(f"warning: {path} holds no optimizer state (saved under DeepSpeed); AdamW's moments "
                          "restart from zero.")
    scheduler.load_state_dict(state["scheduler"])
    stream.load_state_dict(state["data"])
    rng, process_index = state["rng"], accelerator.process_index if accelerator is not None else 0
    set_rng_state(rng[process_index] if process_index < len(rng) else rng[0])
    if counters is not None:
        counters.update(state.get("counters", {}))
    return int(state["step"])


def truncate_metrics(metrics_file: Path, step: int) -> int:
    """Keep the lines of `metrics_file` up to `step` (a resumed run rewrites the later ones); returns how many
    were dropped. A line cut short by a kill is dropped too. The file is replaced atomically."""
    metrics_file = Path(metrics_file)
    if not metrics_file.is_file():
        return 0
    kept, dropped = [], 0
    for line in metrics_file.read_text().splitlines():
        try:
            record = json.loads(line)
            keep = int(record["step"]) <= step
        except (ValueError, KeyError, TypeError):
            keep = False
        if keep:
            kept.append(line)
        else:
            dropped += bool(line.strip())
    if dropped:
        partial = metrics_file.with_name(metrics_file.name + PARTIAL)
        partial.write_text("".join(line + "\n" for line in kept))
        os.replace(partial, metrics_file)
    return dropped
