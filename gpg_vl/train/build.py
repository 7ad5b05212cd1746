"""The objects a config names, built from its sections: the task (`task.*`, `data.*`), the judge it may ask
(`reward.judge.*`) and the policy of a model alias with its memory options (`model.*`), and the check that the task's
inputs suit the model (`require_inputs`). `setup` (gpg_vl/train/setup.py) and evaluation (gpg_vl/cli.py) call them;
tests replace them through this module (`gpg_vl.train.build.build_policy`)."""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from gpg_vl.config.schema import JudgeSettings, ModelSettings
from gpg_vl.data.mixture import Mixture
from gpg_vl.data.task import get_task
from gpg_vl.errors import UserError
from gpg_vl.models.load import load_policy
from gpg_vl.models.lora import adapter_base, adapter_folder, apply_lora, freeze_vision, load_adapter


def build_policy(model_cfg: DictConfig, device, seed: int = 0):
    """The policy of a model alias, with its memory options: LoRA (`model.lora.r > 0`, new adapters drawn from
    `seed`, the run's) and a frozen vision tower.

    A checkpoint holding a LoRA adapter loads its base model, then the adapter: trainable when LoRA is on
    (resuming), merged into the weights otherwise (evaluating).
    """
    lora = model_cfg.get("lora") or {}
    training_lora = int(lora.get("r") or 0) > 0
    if training_lora and lora.get("save") not in ("adapter", "merged"):
        raise UserError(f"unknown model.lora.save {lora.get('save')!r}; use adapter (the LoRA weights alone) "
                        "or merged (full weights in Hugging Face format).")
    name_or_path = model_cfg.name_or_path
    adapter = adapter_folder(name_or_path) if Path(str(name_or_path)).is_dir() else None
    if adapter is not None and not training_lora and (Path(name_or_path) / "config.json").is_file():
        adapter = None  # merged weights sit next to the adapter: evaluate them as they are
    if adapter is not None:
        name_or_path = adapter_base(adapter)
    policy = load_policy(ModelSettings(**OmegaConf.to_container(model_cfg, resolve=True)), device,
                         name_or_path=str(name_or_path))
    model = policy.model
    if adapter is not None:
        model = load_adapter(model, adapter, trainable=training_lora)
        if not training_lora:
            model = model.merge_and_unload()
    elif training_lora:
        model = apply_lora(model, r=int(lora.r), alpha=float(lora.alpha), dropout=float(lora.dropout),
                           target_modules=_plain(lora.target_modules), include_vision=bool(lora.include_vision),
                           vision_modules=policy.family.vision_modules(model),
                           target_parameters=_plain(lora.get("target_parameters")) or None, seed=seed)
    if model_cfg.get("freeze_vision"):
        freeze_vision(model, policy.family.vision_modules(model))
    return replace(policy, model=model, save_format=str(lora.save) if training_lora else "full")


def _plain(value):
    """A config list as a Python list (a string stays a string: a regular expression)."""
    return OmegaConf.to_container(value) if isinstance(value, DictConfig | ListConfig) else value


def build_task(task_cfg: DictConfig, data_cfg: DictConfig | None = None):
    """The task `task.*` names with its `data.*`; task=mix: the mixture of `task.mixture` (gpg_vl/data/mixture.py)."""
    options = OmegaConf.to_container(task_cfg.options, resolve=True) if task_cfg.options is not None else {}
    data_cfg = data_cfg or {}
    if task_cfg.name == "mix":
        from gpg_vl.data.mixture import build_mixture

        def plain(key):
            found = task_cfg.get(key)
            return OmegaConf.to_container(found, resolve=True) if isinstance(found, DictConfig) else found

        data = OmegaConf.to_container(data_cfg, resolve=True) if isinstance(data_cfg, DictConfig) else dict(data_cfg)
        return build_mixture(plain("mixture"), options, plain("rollout"), data=data, task_data=plain("data"),
                             teachers=plain("teacher"))
    return get_task(task_cfg.name, data_path=data_cfg.get("path"), image_root=data_cfg.get("image_root"),
                    allow_outside_paths=bool(data_cfg.get("allow_outside_paths", False)),
                    max_video_frames=data_cfg.get("max_video_frames"), **options)


def build_judge(reward_cfg: DictConfig | None, task, device):
    """Give `task` the judge `reward.judge.kind` names (gpg_vl/reward/judge.py's JUDGES), built on `device`, and
    return it: None for `none`, and for a task that never asks a judge (`uses_judge` false), which gets a
    warning instead of a judge that would only take memory. Called before the policy loads, so a judge that
    cannot be built fails first, in one sentence."""
    from gpg_vl.reward.judge import JUDGES, no_judge

    found = (reward_cfg or {}).get("judge")
    settings = JudgeSettings(**OmegaConf.to_container(found, resolve=True)) if found else JudgeSettings()
    builder = JUDGES.get(settings.kind)
    if builder is no_judge:
        return None
    if not getattr(task, "uses_judge", False):
        warnings.warn(f"reward.judge.kind={settings.kind} is set, but task {task.name!r} never asks a judge; it "
                      "is not built (unset reward.judge.kind).", UserWarning, stacklevel=2)
        return None
    task.judge = builder(settings, device)
    return task.judge


def require_inputs(task, model_cfg) -> None:
    """A task (or a mixture's) whose prompts hold video on a model that cannot read video (`model.*`): one sentence,
    before the model loads."""
    from gpg_vl.models.generic import model_video_refusal

    tasks = task.tasks if isinstance(task, Mixture) else {task.name: task}
    video = [name for name, task in tasks.items() if "video" in getattr(task, "inputs", ())]
    if not video:
        return
    refusal = model_video_refusal(model_cfg)
    if refusal:
        raise UserError(f"task {video[0]!r} prompts with video, and {refusal}")
