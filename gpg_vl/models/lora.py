"""Memory options of the policy model: LoRA adapters through PEFT, a frozen vision tower, and saving either.

- `apply_lora` wraps the model in a `peft.PeftModel` with LoRA on the language model's linear layers (and,
  with `target_parameters`, on parameter tensors such as a mixture-of-experts layer's fused expert
  weights); the vision tower (the modules its family names, `Family.vision_modules`) is excluded unless
  asked for, and every base weight is frozen.
- `freeze_vision` stops the vision tower's parameters from training (they then stay out of the optimizer).
- `save_model` writes a checkpoint's weights: the full model, the LoRA adapter alone (`adapter`), or the
  merged weights in Hugging Face format with the adapter beside them in `adapter/` (`merged`), so that a
  merged checkpoint still resumes exactly.
- `adapter_folder` finds the adapter of a checkpoint; `load_adapter` puts it back on its base model.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from gpg_vl.errors import UserError

LANGUAGE_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SAVE_FORMATS = ("full", "adapter", "merged")
ADAPTER_SUBFOLDER = "adapter"  # where a merged checkpoint keeps its adapter, for resuming


def vision_pattern(vision_modules: list[str]) -> str | None:
    """One regular expression matching every module inside the given vision-tower roots (None: no roots)."""
    if not vision_modules:
        return None
    return rf"({'|'.join(re.escape(name) for name in vision_modules)})(\..*)?"


def apply_lora(model: torch.nn.Module, *, r: int, alpha: float, dropout: float = 0.0,
               target_modules: str | list[str] = LANGUAGE_LINEARS, include_vision: bool = False,
               vision_modules: list[str] = (), target_parameters: list[str] | None = None, seed: int = 0):
    """`model` wrapped in a trainable LoRA `PeftModel`: rank `r`, scale `alpha / r`, on `target_modules`
    (module names, or one regular expression matched against full module names) and `target_parameters`
    (parameter names, e.g. `mlp.experts.gate_up_proj`); modules under `vision_modules` are left alone
    unless `include_vision`. The adapters' random initial values are drawn from `seed` (the run's), on a
    forked generator: the same seed gives the same adapters, and the process's own random state is untouched."""
    from peft import LoraConfig, get_peft_model

    if r <= 0:
        raise UserError(f"model.lora.r={r} is not a LoRA rank; give a positive rank (e.g. 16), or 0 to disable.")
    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                        target_parameters=list(target_parameters) if target_parameters else None,
                        exclude_modules=None if include_vision else vision_pattern(list(vision_modules)), bias="none")
    try:
        with torch.random.fork_rng(devices=list(range(torch.cuda.device_count()))):
            torch.manual_seed(seed)
            return get_peft_model(model, config)
    except ValueError as error:  # PEFT's "Target modules ... not found in the base model"
        raise UserError(f"model.lora.target_modules={targets!r} matches no layer of the model "
                        f"({str(error).splitlines()[0][:120]}); name linear layers such as "
                        f"{', '.join(LANGUAGE_LINEARS)}.") from None


def freeze_vision(model: torch.nn.Module, vision_modules: list[str]) -> int:
    """Set requires_grad=False on every parameter under the vision-tower roots `vision_modules` (as the
    family names them); returns how many tensors were frozen."""
    frozen = 0
    for module in {model.get_submodule(name) for name in vision_modules}:
        for parameter in module.parameters():
            parameter.requires_grad_(False)
            frozen += 1
    if frozen == 0:
        raise UserError("model.freeze_vision=true but the model family finds no vision tower in this model; "
                        "set model.freeze_vision=false.")
    return frozen


def adapter_folder(path: str | Path) -> Path | None:
    """The folder holding a checkpoint's LoRA adapter (itself, or its adapter/ subfolder), if it has one."""
    path = Path(path)
    for folder in (path, path / ADAPTER_SUBFOLDER):
        if (folder / "adapter_config.json").is_file():
            return folder
    return None


def adapter_base(folder: Path) -> str:
    """The base model an adapter was trained on, as recorded in its adapter_config.json."""
    base = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base:
        raise UserError(f"the adapter in {str(folder)!r} does not name its base model "
                        "(base_model_name_or_path in adapter_config.json); add it there.")
    return base


def load_adapter(model: torch.nn.Module, folder: Path, *, trainable: bool):
    """The base `model` with the adapter of `folder` on it (trainable to resume, or frozen to evaluate)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(model, folder, is_trainable=trainable)


def save_model(model: torch.nn.Module, path: Path, save_format: str = "full") -> None:
    """Write the weights of `model` to `path` as `save_format` says (see the module docstring)."""
    if save_format not in SAVE_FORMATS:
        raise UserError(f"unknown model.lora.save {save_format!r}; use one of {', '.join(SAVE_FORMATS[1:])}.")
    if save_format != "merged" or not hasattr(model, "peft_config"):
        model.save_pretrained(path, safe_serialization=True)  # a PeftModel writes its adapter alone
        return
    model.get_base_model().save_pretrained(path, state_dict=merged_state_dict(model), safe_serialization=True)
    model.save_pretrained(Path(path) / ADAPTER_SUBFOLDER, safe_serialization=True)


@torch.no_grad()
def merged_state_dict(model) -> dict[str, torch.Tensor]:
    """The base model's state dict with every LoRA delta added to its weight, under the base names.

    Computed out of place: the training model keeps its adapter unmerged, so saving never perturbs it
    (merging and unmerging in place would round the base weights).
    """
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            adapters = [a for a in module.active_adapters if a in module.lora_A]
            if adapters:
                deltas[f"{name}.base_layer.weight"] = sum(module.get_delta_weight(a) for a in adapters)
    merged = {}
    for key, value in base.state_dict().items():
        if ".lora_" in key:
            continue
        if key in deltas:
            value = value + deltas[key].to(value.dtype)
        merged[key.replace(".base_layer.", ".")] = value
    return merged
