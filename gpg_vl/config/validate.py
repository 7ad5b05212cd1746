"""Config values checked once, on the composed config, before anything loads.

`RULES` says, for each key, what is allowed; `check_values` applies it (and the few rules that tie two keys
together) and fails with ONE sentence that names every offending key, its value and what is allowed. Types and
ranges are both checked here, so a wrong value fails before the model, the data or the output folder is touched
(`trainer.lr=abc` would otherwise fail after the model loaded, `eval.batch_size=0` after training).
`check_model_folder` reads a local model's config.json (with transformers, no weights) for the same reason.

A key absent from the config (e.g. `trainer.*` in eval.yaml) is not checked.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from gpg_vl.errors import UserError


@dataclass(frozen=True)
class Rule:
    """What a key may hold: an integer or a number in a range, a bool, a string, or one of some names."""

    kind: str  # "int", "number", "bool", "str" or "choice"
    low: float | None = None  # inclusive lower bound (`above` for an exclusive one)
    above: float | None = None
    high: float | None = None  # inclusive upper bound
    optional: bool = False  # null is allowed
    choices: Callable[[], Iterable[str]] | tuple[str, ...] = ()
    note: str = ""  # why, appended to what is allowed
    references: bool = False  # a choice that also takes module:name / path.py:name (a plugin from outside)

    def allows(self, value) -> bool:
        if value is None:
            return self.optional
        if self.kind == "bool":
            return isinstance(value, bool)
        if self.kind == "str":
            return isinstance(value, str) and bool(value.strip())
        if self.kind == "choice":
            return isinstance(value, str) and (value in self.options() or (self.references and ":" in value))
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if self.kind == "int" and not isinstance(value, int):
            return False
        return (math.isfinite(value) and (self.low is None or value >= self.low)
                and (self.above is None or value > self.above) and (self.high is None or value <= self.high))

    def options(self) -> list[str]:
        return list(self.choices() if callable(self.choices) else self.choices)

    def allowed(self) -> str:
        if self.kind == "bool":
            text = "true or false"
        elif self.kind == "str":
            text = "a non-empty string"
        elif self.kind == "choice":
            outside = ", or module:name / path.py:name" if self.references else ""
            text = "one of " + ", ".join(self.options()) + outside
        else:
            bounds = [f">= {_number(self.low)}" if self.low is not None else "",
                      f"> {_number(self.above)}" if self.above is not None else "",
                      f"<= {_number(self.high)}" if self.high is not None else ""]
            text = ("an integer" if self.kind == "int" else "a number") + " " + " and ".join(b for b in bounds if b)
        text = text.strip() + (" or null" if self.optional else "")
        return f"{text} ({self.note})" if self.note else text


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def integer(low=None, high=None, *, optional=False, note="") -> Rule:
    return Rule("int", low=low, high=high, optional=optional, note=note)


def number(low=None, high=None, *, above=None, optional=False, note="") -> Rule:
    return Rule("number", low=low, above=above, high=high, optional=optional, note=note)


def one_of(choices, *, optional=False, note="", references=False) -> Rule:
    return Rule("choice", choices=choices, optional=optional, note=note, references=references)


BOOL = Rule("bool")
TEXT = Rule("str")


def _schedules() -> list[str]:
    from transformers import SchedulerType

    return [s.value for s in SchedulerType]


def _trackers() -> list[str]:
    from accelerate.utils import LoggerType

    return ["none", *(t.value for t in LoggerType)]


def _aggregations() -> list[str]:
    from gpg_vl.objective import AGGREGATIONS

    return sorted(AGGREGATIONS)


def _baselines() -> list[str]:
    from gpg_vl.objective import BASELINES

    return list(BASELINES)


def _engines() -> list[str]:
    from gpg_vl.rollout.engine import ENGINES

    return ENGINES.names()


def _decoders() -> list[str]:
    from gpg_vl.rollout.hf import DECODERS

    return list(DECODERS)


def _box_frames() -> list[str]:
    from gpg_vl.models.family import BOX_FRAMES

    return list(BOX_FRAMES)


def _segmenters() -> list[str]:
    from gpg_vl.reward.segment import SEGMENTERS

    return list(SEGMENTERS)


def _families() -> list[str]:
    from gpg_vl.models.family import FAMILIES

    return ["auto", *FAMILIES.names()]


RULES: dict[str, Rule] = {
    "output_dir": TEXT,
    "seed": integer(0, 2**31 - 1),
    "overwrite": BOOL,
    "model.family": one_of(_families, references=True),
    "model.prompt_style": one_of(("chat", "raw")),
    "model.dtype": one_of(("auto", "float32", "bfloat16", "float16")),
    "model.min_pixels": integer(1, optional=True),
    "model.max_pixels": integer(1, optional=True),
    "model.trust_remote_code": BOOL,
    "model.enable_thinking": BOOL,
    "model.box_frame": one_of(_box_frames, optional=True),
    "model.router_aux_loss_coef": number(0),
    "model.attn_implementation": one_of(("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"),
                                        optional=True),
    "model.freeze_vision": BOOL,
    "model.lora.r": integer(0),
    "model.lora.alpha": number(above=0),
    "model.lora.dropout": number(0, 1),
    "model.lora.include_vision": BOOL,
    "model.lora.save": one_of(("adapter", "merged")),
    "data.max_bad_fraction": number(0, 1),
    "trainer.max_steps": integer(1),
    "trainer.epochs": number(above=0, optional=True),
    "trainer.group_size": integer(1, note="at least 2 with a group baseline"),
    "trainer.batch_size": integer(1),
    "trainer.micro_batch_size": integer(0),
    "trainer.micro_batch_tokens": integer(0),
    "trainer.lr": number(above=0),
    "trainer.lr_schedule": one_of(_schedules),
    "trainer.warmup_steps": integer(0),
    "trainer.weight_decay": number(0),
    "trainer.max_grad_norm": number(above=0),
    "trainer.beta_th": number(0, 1),
    "trainer.max_attempts": integer(1),
    "trainer.max_completions": integer(1, optional=True),
    "trainer.std_normalize": Rule("bool", optional=True, note="deprecated: trainer.advantage"),
    "trainer.baseline": one_of(_baselines, optional=True, note="deprecated: trainer.advantage"),
    "trainer.ppo_epochs": integer(1),
    "trainer.ppo_mini_batch": integer(0, note="0 = the whole rollout"),
    "trainer.clip_low": number(0, 1),
    "trainer.clip_high": number(0, optional=True, note="null = clip_low"),
    "trainer.kl_coef": number(0),
    "trainer.overlong_cache": integer(0, note="0 = off"),
    "trainer.overlong_penalty": number(0),
    "trainer.age": BOOL,
    "trainer.aggregation": one_of(_aggregations),
    "trainer.gradient_checkpointing": BOOL,
    "trainer.share_vision": BOOL,
    "trainer.share_prompt": BOOL,
    "trainer.logits_chunk_tokens": integer(0),
    "trainer.save_every": integer(0, note="0 = only final/"),
    "trainer.keep_checkpoints": integer(0, note="0 = keep all"),
    "trainer.max_bad_steps": integer(0, note="0 = never stop"),
    "trainer.report_to": one_of(_trackers),
    "trainer.eval_before": BOOL,
    "trainer.eval_after": BOOL,
    "trainer.reward_workers": integer(1),
    "trainer.reward_budget_s": number(0, note="0 = no budget"),
    "trainer.log_rollouts_every": integer(0, note="0 = never"),
    "trainer.log_rollouts_groups": integer(1),
    "rollout.max_new_tokens": integer(1),
    "rollout.temperature": number(above=0, note="sampling needs it; the update's log-probs divide by it"),
    "rollout.top_p": number(high=1, above=0),
    "rollout.ignore_eos": BOOL,
    "rollout.max_prompt_tokens": integer(1),
    "rollout.prefill_once": Rule("bool", optional=True, note="deprecated: rollout.hf.prefill_once"),
    "rollout.static_cache": Rule("bool", optional=True, note="deprecated: rollout.hf.static_cache"),
    "rollout.engine": one_of(_engines, references=True),
    "rollout.hf.prefill_once": BOOL,
    "rollout.hf.static_cache": BOOL,
    "rollout.hf.reserve_cache": BOOL,
    "rollout.hf.decode": one_of(_decoders),
    "rollout.vllm.gpu_memory_utilization": number(0.01, 1),
    "rollout.vllm.tensor_parallel_size": integer(1),
    "rollout.vllm.enable_sleep_mode": BOOL,
    "rollout.vllm.max_model_len": integer(1, optional=True),
    "rollout.vllm.max_images": integer(1),
    "rollout.vllm.enforce_eager": BOOL,
    "rollout.vllm.max_logp_mismatch": number(0),
    "rollout.vllm.tis_cap": number(0, note="0 = off"),
    "rollout.vllm.seed": integer(0),
    "eval.split": Rule("str", optional=True),
    "eval.limit": integer(1, optional=True),
    "eval.batch_size": integer(1),
    "eval.max_new_tokens": integer(1, optional=True),
    "eval.reward_workers": integer(1),
    "eval.reward_budget_s": number(0, note="0 = no budget"),
    "segmenter": one_of(_segmenters),
    "segmenter_batch_size": integer(1),
}


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
    model = cfg.get("model") or {}
    low, high = model.get("min_pixels"), model.get("max_pixels")
    if isinstance(low, int) and isinstance(high, int) and low > high:
        problems.append(f"model.min_pixels={low} above model.max_pixels={high}, allowed: min_pixels <= max_pixels")
    return problems


def check_values(cfg: DictConfig) -> None:
    """Raise one UserError naming every config value outside what `RULES` allows (and the cross-key rules)."""
    problems = []
    for key, rule in RULES.items():
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
    from gpg_vl.models.load import FAMILIES, TINY_PREFIX, resolve_path

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
    if family != "auto" and model_type in FAMILIES and model_type != family:
        raise UserError(f"model.family={family} contradicts {str(config)!r}, whose model_type is {model_type!r}; "
                        f"set model.family={model_type} (or auto, to read it from config.json).")
