"""Crash-safe checkpoints and exact resume.

A checkpoint folder (`checkpoint-<step>/`, or `final/`) holds
- the model and its processor in Hugging Face format, the weights as safetensors (with LoRA, the adapter or the
  merged weights, as `model.lora.save` says: `gpg_vl.models.lora.save_model`);
- `trainer_state.pt`: the step, the optimizer and LR scheduler states, every RNG state (python, numpy,
  torch, CUDA; one set per process), the data position and the run's counters. It holds only tensors,
  numbers, strings, lists and dicts, and is read with `torch.load(weights_only=True)`: loading a
  checkpoint never unpickles code;
- `checkpoint.json`, written last, the mark of a complete checkpoint: `{"step": N, "files": {name: {"size",
  "sha256"}}, "config": {...}}`, every other file's size and sha256 (`verify_checkpoint` checks them before a
  resume reads anything) and the settings the run was made with (a resume compares them: `compare_settings`).

Writes are atomic: everything goes into `<name>.partial/`, each file is fsynced, then the folder is renamed
into place (and its parent fsynced). A kill at any moment, even in the middle of a save, leaves at most a
`.partial` folder, which `latest_checkpoint` ignores and `remove_partials` deletes; the newest complete
checkpoint stays usable. Only the last `keep` `checkpoint-<step>/` folders are kept. A save that fails for
lack of space (or any other write error) removes its `.partial` folder and stops the run with one sentence
naming the newest intact checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from gpg_vl.errors import UserError
from gpg_vl.files import PARTIAL, write_atomic
from gpg_vl.models.lora import save_model
from gpg_vl.models.weights import checkpoint_conversions

STATE_FILE = "trainer_state.pt"
MARKER_FILE = "checkpoint.json"
SAMPLER_FILE = "sampler.safetensors"  # the older weights the steps in flight sample with (trainer.max_staleness >= 1)
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


ZERO_STATE = "zero"  # under DeepSpeed: the engine's own checkpoint (each process's optimizer partition, fp32 master)


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
        for _, stale in sorted(_checkpoints(path.parent), key=lambda item: item[0])[:-keep]:
            remove_checkpoint(stale)


# How writers other than the OS report a full disk: safetensors ("SafetensorError: ... No space left on
# device (os error 28)"), and torch.save, whose zip writer finds its file shorter than what it wrote
# ("RuntimeError: [enforce fail at inline_container.cc:...] . unexpected pos 123 vs 456" or "... file write failed").
_DISK_FULL = ("no space left on device", "disk quota exceeded")
_SHORT_WRITE = ("unexpected pos", "file write failed")


def write_failure(error: BaseException, subject: str = "it") -> str:
    """Why a write failed, for a sentence: "the disk is full (No space left on device)", "the write was cut short,
    most often by a full disk (...)", or "`subject` could not be written (...)". `error` is an OSError or what
    torch.save and safetensors raise (a RuntimeError, a SafetensorError), judged by its errno or message."""
    detail = (getattr(error, "strerror", None) or str(error) or type(error).__name__).strip().splitlines()
    detail = " ".join(line.strip() for line in detail)[-160:]
    if not isinstance(error, OSError):
        detail = f"{type(error).__name__}: {detail}"
    message = str(error).lower()
    if getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or any(m in message for m in _DISK_FULL):
        why = "the disk is full"
    elif any(m in message for m in _SHORT_WRITE):
        why = "the write was cut short, most often by a full disk"
    else:
        why = f"{subject} could not be written"
    return f"{why} ({detail.rstrip('.')})"


def unwritable(what: str, output_dir: Path, error: BaseException) -> UserError:
    """The one sentence for a run's file that could not be written (most often: the disk is full), naming
    the newest intact checkpoint, from which resume=auto continues."""
    intact = latest_checkpoint(output_dir)
    return UserError(f"could not {what} in {str(output_dir)!r}: {write_failure(error)}; "
                     f"the newest intact checkpoint is {intact or 'none (none was written)'}: free space or "
                     "fix the folder, then continue with resume=auto.")


@contextlib.contextmanager
def writing(what: str, output_dir: Path):
    """Write a run's file (metrics.jsonl, summary.json, curves, rollouts) inside this block: an OSError ends
    the run in `unwritable`'s sentence instead of a traceback (a checkpoint's save catches more: see
    `save_checkpoint`)."""
    try:
        yield
    except OSError as error:
        raise unwritable(what, Path(output_dir), error) from None


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
    return {file.relative_to(folder).as_posix(): {"size": file.stat().st_size, "sha256": _sha256(file)}
            for file in sorted(folder.rglob("*")) if file.is_file() and file.name != MARKER_FILE}


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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


def _newest_first(output_dir: str | os.PathLike) -> list[Path]:
    """The complete checkpoints in `output_dir`, newest first (a numbered one before `final/` of its step)."""
    output_dir = Path(output_dir)
    candidates = _checkpoints(output_dir) if output_dir.is_dir() else []
    final = output_dir / "final"
    if checkpoint_step(final) is not None:
        candidates.append((checkpoint_step(final), final))
    return [path for _, path in sorted(candidates, key=lambda item: (item[0], item[1].name != "final"), reverse=True)]


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in `output_dir` (`checkpoint-<step>/`, or `final/` when it is further on);
    `.partial` folders and folders without their marker are never chosen."""
    found = _newest_first(output_dir)
    return found[0] if found else None


def verify_checkpoint(path: Path) -> str | None:
    """What is wrong with a complete checkpoint's files against the sizes and sha256 its checkpoint.json
    records (None: nothing; a checkpoint from before those records is taken as it is)."""
    try:
        files = json.loads((Path(path) / MARKER_FILE).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return f"its {MARKER_FILE} cannot be read"
    for name, expected in (files or {}).items():
        file = Path(path) / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != expected.get("size"):
            return f"{name} has {size} bytes, {expected.get('size')} were written"
        if _sha256(file) != expected.get("sha256"):
            return f"{name} does not match the sha256 it was written with"
    return None


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


def resolve_resume(resume, output_dir: str | os.PathLike, warn=print) -> Path | None:
    """The checkpoint that `resume=` names: None (start afresh), `auto` (the newest checkpoint in `output_dir`
    that is complete and intact, None when there is none; each damaged newer one is named in a warning) or a
    checkpoint folder, which must be complete and intact."""
    if resume is None or str(resume) in ("", "null", "none", "None"):
        return None
    if str(resume) == "auto":
        for path in _newest_first(output_dir):
            problem = verify_checkpoint(path)
            if problem is None:
                return path
            warn(f"warning: resume=auto skips {path}, which is damaged ({problem}); it falls back to an older one.")
        return None
    path = Path(str(resume)).expanduser()
    if checkpoint_step(path) is None:
        raise UserError(f"resume={str(resume)!r} is not a complete checkpoint (a folder with {MARKER_FILE} and "
                        f"{STATE_FILE}, e.g. {Path(output_dir) / 'checkpoint-100'}); pass one, or resume=auto to "
                        "continue from the newest one in output_dir.")
    problem = verify_checkpoint(path)
    if problem is not None:
        raise UserError(f"resume={str(resume)!r} is damaged ({problem}); pass an intact checkpoint, or resume=auto "
                        "to continue from the newest intact one in output_dir.")
    return path


# Settings a checkpoint cannot be resumed under when they change: the weights, optimizer state or data order it
# holds would no longer mean what they meant (a different model or family, other LoRA or frozen parameters,
# other group or batch sizes, another task or seed). Any other change is reported and applies from then on.
FIXED_SETTINGS = ("task.name", "seed", "model.name_or_path", "model.family", "model.freeze_vision",
                  "model.lora.r", "model.lora.alpha", "model.lora.dropout", "model.lora.target_modules",
                  "model.lora.include_vision", "trainer.group_size", "trainer.batch_size")
_NOT_SETTINGS = ("output_dir", "resume", "overwrite")  # where and how this run starts, not what it trains


def compare_settings(path: Path, config: dict) -> list[str]:
    """Compare `config` (the resumed run's, resolved) with the one checkpoint `path` was made with: one sentence
    naming the key and both values for a change of a `FIXED_SETTINGS` key; else the other changes, as
    'key: old -> new' (empty for a checkpoint that records no settings)."""
    try:
        recorded = json.loads((Path(path) / MARKER_FILE).read_text()).get("config") or {}
    except (OSError, ValueError, AttributeError):
        recorded = {}
    if not recorded:
        return []
    before, after = _flatten(recorded), _flatten(config)
    for key in ("model.family",):  # `auto` means the checkpoint's own model_type
        before[key], after[key] = (_family(before.get(key), path), _family(after.get(key), path))
    for key in ("model.name_or_path",):  # the same local folder, however it is written
        before[key], after[key] = _where(before.get(key)), _where(after.get(key))
    changed = [key for key in sorted(set(before) | set(after))
               if before.get(key) != after.get(key) and not key.startswith(_NOT_SETTINGS)]
    for key in changed:
        if key in FIXED_SETTINGS:
            raise UserError(f"{path} was made with {key}={before.get(key)!r}, this run sets {key}={after.get(key)!r}; "
                            f"a resume keeps it (set {key}={before.get(key)!r}), or start a new run in another "
                            "output_dir from the checkpoint's weights (model.name_or_path=<checkpoint>).")
    return [f"{key}: {before.get(key)!r} -> {after.get(key)!r}" for key in changed]


def _flatten(config: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _family(value, checkpoint: Path):
    if value not in (None, "auto"):
        return value
    try:
        return json.loads((Path(checkpoint) / "config.json").read_text()).get("model_type", value)
    except (OSError, ValueError, AttributeError):
        return value


def _where(value):
    path = Path(str(value)).expanduser()
    return str(path.resolve()) if value is not None and path.exists() else value


_STATE_KEYS = ("step", "optimizer", "scheduler", "data", "rng")


def load_trainer_state(path: Path, optimizer, scheduler, stream, *, accelerator=None, model=None,
                       counters: dict | None = None, record: dict | None = None) -> int:
    """Restore optimizer, scheduler, data position and this process's RNG states from a checkpoint; returns
    its step. `counters` and `record`, when given, are updated with the run's saved ones. Every process calls
    it (under FSDP it is collective: each process loads its shard of the optimizer state)."""
    file = Path(path) / STATE_FILE
    try:
        state = torch.load(file, weights_only=True, map_location="cpu")
    except Exception as error:  # unpickling refused (an old or foreign file), truncated file
        raise UserError(f"cannot read the trainer state {str(file)!r} ({str(error).splitlines()[0][:160]}); "
                        "resume from a checkpoint written by this version of gpg-vl.") from None
    missing = [key for key in _STATE_KEYS if not isinstance(state, dict) or key not in state]
    if missing:
        raise UserError(f"the trainer state {str(file)!r} lacks {', '.join(missing)}; it was not written by "
                        "gpg-vl's save_checkpoint (or was edited): resume from another checkpoint.")
    try:
        return _restore(state, path, optimizer, scheduler, stream, accelerator, model, counters, record)
    except (KeyError, TypeError, ValueError, IndexError) as error:  # a foreign or edited state, other parameters
        raise UserError(f"the trainer state {str(file)!r} does not fit this run ({type(error).__name__}: "
                        f"{str(error).splitlines()[0][:160] if str(error) else 'no detail'}); resume with the "
                        "settings it was made with, or from another checkpoint.") from None


def _restore(state, path, optimizer, scheduler, stream, accelerator, model, counters, record) -> int:
    """`load_trainer_state` once the state's keys are checked."""
    if accelerator is not None and accelerator.is_fsdp2:  # collective: every process loads its shard
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer.optimizer, state["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
    elif state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
    elif accelerator is not None:
        _load_zero_state(Path(path), accelerator, model)
    scheduler.load_state_dict(state["scheduler"])
    stream.load_state_dict(state["data"])
    rng, process_index = state["rng"], accelerator.process_index if accelerator is not None else 0
    set_rng_state(rng[process_index] if process_index < len(rng) else rng[0])
    if counters is not None:
        counters.update(state.get("counters", {}))
    if record is not None:
        record.update(state.get("record", {}))
    return int(state["step"])


def _sampler_state(folder: Path, in_flight: dict) -> dict:
    """Write the older weight versions of `in_flight` to folder/sampler.safetensors; the rest, for the state."""
    from safetensors.torch import save_file

    tensors = {f"{version}/{name}": value.detach().contiguous().cpu()
               for version, weights in in_flight["weights"].items() for name, value in weights.items()}
    save_file(tensors, folder / SAMPLER_FILE)
    return {"generator": in_flight["generator"], "counters": in_flight["counters"],
            "next_step": in_flight["next_step"], "max_staleness": in_flight["max_staleness"],
            "versions": sorted(in_flight["weights"])}


def load_in_flight(path: Path) -> dict | None:
    """What regenerates the steps a checkpoint had in flight (`save_checkpoint`'s `in_flight`, the weights as
    {version: {name: tensor}}), None when it holds none (saved with trainer.max_staleness=0)."""
    from safetensors.torch import load_file

    state = torch.load(Path(path) / STATE_FILE, weights_only=True, map_location="cpu").get("sampler")
    if state is None:
        return None
    weights = {int(version): {} for version in state["versions"]}
    for key, value in load_file(Path(path) / SAMPLER_FILE).items():
        version, name = key.split("/", 1)
        weights[int(version)][name] = value
    return {**state, "weights": weights}


def _load_zero_state(path: Path, accelerator, engine) -> None:
    """Under DeepSpeed (collective): each process loads its partition of the ZeRO optimizer state (and the
    engine's weights, the same values as the checkpoint's model) with the engine's own `load_checkpoint`. A
    checkpoint saved by another number of processes is refused in one sentence; one without the state (saved
    by an older gpg-vl) restarts AdamW's moments, with a warning."""
    from accelerate.utils import DistributedType

    folder = path / ZERO_STATE / ZERO_STATE
    if accelerator.distributed_type != DistributedType.DEEPSPEED or not folder.is_dir():
        accelerator.print(f"warning: {path} holds no optimizer state for this run (saved under DeepSpeed by an "
                          "older gpg-vl, or resumed without DeepSpeed); AdamW's moments restart from zero.")
        return
    saved = len(list(folder.glob("*optim_states.pt")))
    if saved != accelerator.num_processes:
        raise UserError(f"{path} holds the ZeRO optimizer state of {saved} processes, and DeepSpeed loads it on as "
                        f"many only; resume with --num_processes {saved}.")
    engine.load_checkpoint(str(path / ZERO_STATE), tag=ZERO_STATE, load_module_strict=False,
                           load_optimizer_states=True, load_lr_scheduler_states=False)


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
        write_atomic(metrics_file, "".join(line + "\n" for line in kept))
    return dropped
