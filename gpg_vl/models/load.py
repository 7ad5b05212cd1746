"""Loading a model: a hub id, a local directory, an embedded or a tiny model, and the family that speaks for it.

The trainer sees a `Policy`: the model, its processor and its family (gpg_vl/models/family.py), which
turns chat messages into a `PromptBatch`, scores completions under the sampling distribution, and answers
every other model-specific question. Families are registered by name (`FAMILIES`, whose built-ins are imported
on first use): the Qwen-VL families (models/qwen.py) and the generic family for any other transformers
vision-language model (models/generic.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from gpg_vl.config.schema import ModelSettings
from gpg_vl.errors import UserError
from gpg_vl.models.family import BOX_FRAMES, FAMILIES, RAW_TEMPLATE, Family, family_for, get_family

ASSETS = Path(__file__).resolve().parents[1] / "assets"
EMBEDDED_PREFIX = "embedded:"
TINY_PREFIX = "tiny:"


@dataclass
class Policy:
    """The model being trained, its processor and its model family."""

    model: torch.nn.Module
    processor: object
    family: Family
    name_or_path: str
    save_format: str = "full"  # how checkpoints write the weights: full, or for LoRA adapter / merged


def resolve_path(name_or_path: str) -> str:
    """`embedded:<name>` means a model shipped in gpg_vl/assets, `tiny:<family>` a tiny random model of a
    family built on first use (gpg_vl.models.tiny); anything else is a hub id or a path."""
    if name_or_path.startswith(TINY_PREFIX):
        from gpg_vl.models.tiny import tiny_model_path, tiny_names

        family = name_or_path[len(TINY_PREFIX):]
        if family not in tiny_names():
            raise UserError(f"no tiny model of family {family!r}; known: {', '.join(tiny_names())}.")
        return str(tiny_model_path(family))
    if name_or_path.startswith(EMBEDDED_PREFIX):
        path = ASSETS / name_or_path[len(EMBEDDED_PREFIX):]
        if not (path / "config.json").is_file():
            raise UserError(f"the embedded model {name_or_path!r} is missing at {path}; "
                            "rebuild it with `python scripts/build_tiny.py`.")
        return str(path)
    return name_or_path


def load_policy(model: ModelSettings | str, device: torch.device | str = "cpu", *,
                setting: str = "model.name_or_path", **changes) -> Policy:
    """Load model + processor as `model` (the `model.*` settings, gpg_vl/config/schema.py) says, from a hub id or a
    local directory; a failed download is one sentence, which names `setting` (the key that gave the model).

    A name stands for `ModelSettings(name_or_path=name)`, and keywords change the settings' fields, so tests can
    write `load_policy("embedded:tiny-qwen2.5-vl", dtype="float32", max_pixels=50176)`. LoRA and
    `freeze_vision` are applied by the caller (gpg_vl/cli.py's `build_policy`); everything else is here.
    """
    from transformers import AutoModelForImageTextToText, AutoProcessor

    settings = ModelSettings(name_or_path=model) if isinstance(model, str) else model
    settings = replace(settings, **changes) if changes else settings
    if settings.box_frame not in (None, *BOX_FRAMES):
        raise UserError(f"unknown model.box_frame {settings.box_frame!r}; use one of {', '.join(BOX_FRAMES)} "
                        "(null = the family's).")
    path = resolve_path(str(settings.name_or_path))
    family = settings.family
    if family == "auto":
        family = family_for(_model_type_of(path, setting))
    family_class = get_family(family)  # a name, a model type (qwen3_vl_moe -> qwen3_vl), module:Name or file.py:Name
    dtype = settings.dtype
    if dtype == "auto":
        dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
    kwargs = {"trust_remote_code": settings.trust_remote_code}
    try:
        processor = AutoProcessor.from_pretrained(path, **kwargs)
        loaded = AutoModelForImageTextToText.from_pretrained(
            path, dtype=getattr(torch, dtype), attn_implementation=settings.attn_implementation, **kwargs)
    except OSError as error:
        raise unloadable(path, error, setting) from None
    loaded.to(device)
    _set_router_aux_loss(loaded, settings.router_aux_loss_coef)
    chosen = family_class(processor, loaded.config, min_pixels=settings.min_pixels, max_pixels=settings.max_pixels,
                          prompt_style=settings.prompt_style, raw_template=settings.raw_template or RAW_TEMPLATE,
                          enable_thinking=settings.enable_thinking, video_pixels=video_pixels(settings))
    if settings.box_frame:  # null = the family's own frame
        chosen.box_frame = settings.box_frame
    return Policy(model=loaded, processor=processor, family=chosen, name_or_path=path)


def video_pixels(settings: ModelSettings) -> dict:
    """The per-video pixel budgets of `model.video_*_pixels` (null: the image limits, or qwen-vl-utils' total)."""
    return {"min_pixels": settings.video_min_pixels or settings.min_pixels,
            "max_pixels": settings.video_max_pixels or settings.max_pixels,
            "total_pixels": settings.video_total_pixels}


def unloadable(path: str, error: Exception, setting: str = "model.name_or_path") -> UserError:
    """The one sentence for a model that could not be loaded (no network for a hub id, a broken folder)."""
    where = "local directory" if Path(path).exists() else "Hugging Face Hub id"
    first = (str(error).splitlines() or [""])[0][:160]
    return UserError(f"could not load the model {path!r} as a {where} ({first}); without network access, "
                     f"download it elsewhere and pass {setting}=/path/to/local/copy.")


def _model_type_of(path: str, setting: str = "model.name_or_path") -> str:
    """The model_type in a local model directory's config.json (the hub's, for a hub id)."""
    import json

    config = Path(path) / "config.json"
    if config.is_file():
        return json.loads(config.read_text()).get("model_type", "unknown")
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(path).model_type
    except (OSError, ValueError) as error:
        if isinstance(error, OSError) and not Path(path).exists():  # a hub id that cannot be reached
            raise unloadable(path, error, setting) from None
        raise UserError(f"{path!r} has no config.json, so its model family is unknown; "
                        f"set model.family= to one of {', '.join(FAMILIES.names())}.") from None


def _family_of(path: str) -> str:
    """The family of a local model directory, from its config.json's model_type (generic when unregistered)."""
    return family_for(_model_type_of(path))


def _set_router_aux_loss(model: torch.nn.Module, coef: float) -> None:
    """A mixture-of-experts model's router auxiliary loss: off by default (as TRL's GPG trainer), on with coef > 0."""
    for config in (model.config, getattr(model.config, "text_config", None)):
        if config is not None and hasattr(config, "router_aux_loss_coef"):
            config.router_aux_loss_coef = float(coef)
            config.output_router_logits = coef > 0
