"""Config values checked once, on the composed config, before anything loads.

Every per-key check is derived from the schema (gpg_vl/config/schema.py): a field's type says what kind of value
it holds (`| None`: null allowed) and its metadata (`meta`) the range or the choices. `check_values` applies
them (and the few rules that tie two keys together, `_cross_problems`) and fails with ONE sentence that names
every offending key, its value and what is allowed. So a wrong value fails before the model, the data or the
output folder is touched (`trainer.lr=abc` would otherwise fail after the model loaded, `eval.batch_size=0`
after training). `check_model_folder` reads a local model's config.json (with transformers, no weights) for the
same reason.

A key absent from the config (e.g. `trainer.*` in eval.yaml) is not checked.
"""

from __future__ import annotations

from dataclasses import Field
from functools import cache
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from gpg_vl.config.keys import Key, declared, key_of
from gpg_vl.config.rules import Rule, choices_of, rule_of, value_type
from gpg_vl.config.schema import EvalSchema, TrainSchema
from gpg_vl.errors import UserError


def rule_for(item: Field) -> Rule | None:
    """What a schema field allows, from its type and its metadata (None: its type says all, e.g. a free string)."""
    return rule_of(*value_type(item), key_of(item) or Key(""))


@cache
def rules(*schemas) -> dict[str, Rule]:
    """Every checked key of train.yaml and eval.yaml (dotted) and its rule, in the schema's order; `schemas`: the
    run's (with an out-of-tree engine's or tool's section), else the built-in TrainSchema and EvalSchema."""
    table = {}
    for schema in schemas or (TrainSchema, EvalSchema):
        for name, item in declared(schema):
            rule = rule_for(item)
            if rule is not None:
                table.setdefault(name, rule)
    return table


def _cross_problems(cfg: DictConfig) -> list[str]:
    """Rules that tie two keys together (each only when both keys hold allowed values)."""
    problems = []
    trainer = cfg.get("trainer") or {}
    plain = trainer.get("advantage") == "none" or trainer.get("baseline") == "none"  # (baseline: deprecated)
    if not plain and trainer.get("group_size") == 1:
        problems.append("trainer.group_size=1, allowed: an integer >= 2 with a group baseline (the group mean of "
                        "one completion is itself, so no group would carry signal; trainer.advantage=none allows 1)")
    if trainer.get("micro_batch_size") == 0 and trainer.get("micro_batch_tokens") == 0:
        problems.append("trainer.micro_batch_size=0 with trainer.micro_batch_tokens=0, allowed: micro_batch_size "
                        ">= 1, or micro_batch_tokens >= 1 to cut micro-batches by tokens")
    cache, limit = trainer.get("overlong_cache"), (cfg.get("rollout") or {}).get("max_new_tokens")
    if isinstance(cache, int) and isinstance(limit, int) and cache > limit:
        problems.append(f"trainer.overlong_cache={cache} above rollout.max_new_tokens={limit}, allowed: "
                        "overlong_cache <= max_new_tokens (DAPO's penalty ramps over the last overlong_cache tokens "
                        "before the length limit; 0 = off)")
    total, turns = (cfg.get("rollout") or {}).get("max_total_tokens"), (cfg.get("rollout") or {}).get("max_turns")
    if isinstance(cache, int) and isinstance(total, int) and isinstance(turns, int) and turns > 1 and cache > total:
        problems.append(f"trainer.overlong_cache={cache} above rollout.max_total_tokens={total} with rollout."
                        f"max_turns={turns}, allowed: overlong_cache <= max_total_tokens (a trajectory's generated "
                        "tokens are held to its own limit)")
    bounds = trainer.get("clip_cov_bounds")
    if bounds is not None and not (len(bounds) == 2 and all(isinstance(b, int | float) for b in bounds)
                                   and bounds[0] < bounds[1]):
        problems.append(f"trainer.clip_cov_bounds={list(bounds)}, allowed: [lower, upper] numbers with lower < upper")
    model = cfg.get("model") or {}
    low, high = model.get("min_pixels"), model.get("max_pixels")
    if isinstance(low, int) and isinstance(high, int) and low > high:
        problems.append(f"model.min_pixels={low} above model.max_pixels={high}, allowed: min_pixels <= max_pixels")
    return problems


def check_values(cfg: DictConfig, *schemas) -> None:
    """Raise one UserError naming every config value outside what the schema allows (and the cross-key rules);
    `schemas`: the run's train and eval schemas when they hold a plugin's section."""
    problems = []
    for key, rule in rules(*schemas).items():
        value = OmegaConf.select(cfg, key, default=_ABSENT, throw_on_missing=False)
        if value is _ABSENT or isinstance(value, DictConfig | ListConfig):
            continue
        if not rule.allows(value):
            problems.append(f"{key}={value!r}, allowed: {rule.allowed()}")
    if not problems:
        problems = _cross_problems(cfg)
    if problems:
        raise UserError(f"bad config value{'s' if len(problems) > 1 else ''}: {'; '.join(problems)}.")


_ABSENT = object()


def check_model_folder(model_cfg: DictConfig) -> None:
    """For a local model folder (not a hub id): its config.json must load (valid JSON, fields of the right types,
    checked by transformers without reading weights), and `model.family` must agree with its model_type."""
    from gpg_vl.models.load import TINY_PREFIX, resolve_path

    name = str(model_cfg.name_or_path)
    if name.startswith(TINY_PREFIX):
        return  # built by gpg-vl itself, on first use
    folder = Path(resolve_path(name)).expanduser()
    config = folder / "config.json"
    if not config.is_file():
        return  # a hub id (downloaded later), or an adapter-only checkpoint (its base is checked when it loads)
    from transformers import AutoConfig

    try:
        loaded = AutoConfig.from_pretrained(str(folder), trust_remote_code=bool(model_cfg.get("trust_remote_code")))
    except Exception as error:  # invalid JSON, a field of the wrong type, an unknown model_type
        detail = " ".join(str(error).split())[:200]
        raise UserError(f"the model folder {str(folder)!r} has a config.json that transformers cannot read "
                        f"({type(error).__name__}: {detail}); restore the folder from its source, or fix "
                        "config.json.") from None
    family, model_type = str(model_cfg.get("family") or "auto"), getattr(loaded, "model_type", None)
    if family != "auto" and model_type in choices_of("families") and model_type != family:
        raise UserError(f"model.family={family} contradicts {str(config)!r}, whose model_type is {model_type!r}; "
                        f"set model.family={model_type} (or auto, to read it from config.json).")
    _check_model_files(folder)


PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model",
                   "spiece.model", "*.tiktoken")


def _check_model_files(folder: Path) -> None:
    """A local model folder needs safetensors weights (a pickled pytorch_model.bin runs code when it is read)
    and its tokenizer (without it the processor cannot turn the prompts' image placeholders into tokens)."""
    if not any(folder.glob("*.safetensors")):
        pickled = sorted(p.name for pattern in PICKLED_WEIGHTS for p in folder.glob(pattern))
        if pickled:
            raise UserError(f"the model folder {str(folder)!r} holds its weights only as {', '.join(pickled[:3])}, a "
                            "pickle, and reading a pickle runs whatever code it holds (transformers refuses it or "
                            "loads it weights-only), so gpg-vl does not read it: convert it to safetensors in a "
                            "trusted environment (AutoModelForImageTextToText.from_pretrained(folder)"
                            ".save_pretrained(folder)), or use a copy that ships model.safetensors.")
    if not any(any(folder.glob(pattern)) for pattern in TOKENIZER_FILES):
        raise UserError(f"the model folder {str(folder)!r} has no tokenizer files (tokenizer.json, "
                        "tokenizer_config.json or a vocabulary), so its prompts cannot be tokenized with their "
                        "image tokens: copy the tokenizer files from the model's source (the same hub repository) "
                        "into the folder.")
