"""Entry points behind scripts/train.py: one place that builds every object from the config."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from gpg_vl.models.base import load_policy
from gpg_vl.tasks import get_task
from gpg_vl.trainer import EvalSettings, RolloutSettings, TrainerSettings, train


def build_policy(model_cfg: DictConfig, device):
    return load_policy(
        model_cfg.name_or_path, family=model_cfg.family, dtype=model_cfg.dtype, min_pixels=model_cfg.min_pixels,
        max_pixels=model_cfg.max_pixels, trust_remote_code=model_cfg.trust_remote_code,
        attn_implementation=model_cfg.attn_implementation, device=device,
    )


def build_task(task_cfg: DictConfig):
    return get_task(task_cfg.name, **OmegaConf.to_container(task_cfg.options or {}, resolve=True))


def train_main(cfg: DictConfig) -> dict:
    from accelerate import Accelerator

    task = build_task(cfg.task)
    mixed = "bf16" if cfg.model.dtype in ("auto", "bfloat16") and _cuda() else "no"
    report_to = cfg.trainer.report_to
    accelerator = Accelerator(mixed_precision=mixed, project_dir=str(cfg.output_dir),
                              log_with=None if report_to == "none" else report_to)
    model_cfg = cfg.model
    if cfg.resume:  # the weights come from the checkpoint; the optimizer, data position and RNG follow in train()
        model_cfg = OmegaConf.merge(cfg.model, {"name_or_path": str(cfg.resume)})
    policy = build_policy(model_cfg, accelerator.device)
    container = OmegaConf.to_container(cfg, resolve=True)
    summary = train(
        policy, task,
        trainer=TrainerSettings(**container["trainer"]),
        rollout=RolloutSettings(**container["rollout"]),
        evaluation=EvalSettings(**container["eval"]),
        output_dir=cfg.output_dir, seed=cfg.seed, resume_from=cfg.resume, accelerator=accelerator,
        config=container,
    )
    if accelerator.is_main_process and summary.get("accuracy_before") is not None:
        print(f"accuracy before: {summary['accuracy_before']:.3f}  after: {summary.get('accuracy_after', 0):.3f}"
              f"  ({cfg.output_dir}/summary.json)")
    return summary


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
