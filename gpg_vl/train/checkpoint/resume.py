"""Exact resume: the trainer state of a checkpoint restored (optimizer, schedule, data position, every RNG
state, counters), the settings compared with the ones it was made with, the steps it had in flight
(trainer.max_staleness >= 1), and metrics.jsonl cut back to its step. What a checkpoint folder holds:
gpg_vl/train/checkpoint/folder.py."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

from gpg_vl.errors import UserError
from gpg_vl.files import write_atomic
from gpg_vl.train.checkpoint.folder import MARKER_FILE, SAMPLER_FILE, STATE_FILE, ZERO_STATE


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

