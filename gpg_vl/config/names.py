"""The built-in names a setting chooses from, and what the built-in losses declare, readable without importing
the modules that define them (those import torch, transformers or accelerate). So the config is read, typed and
checked in well under a second (docs/robustness.md, "Errors in a second"), and the heavy libraries load only
once it passed.

A registry's names (`registered`) come from its module when that module is imported, else from the built-in
names here: nothing registers a plugin by name without importing the registry's module first, so until then
the built-ins are the whole list. tests/unit/test_config_light.py checks every list here against its source
(the registries, and the installed transformers' and accelerate's own lists).
"""

from __future__ import annotations

import sys

# transformers.SchedulerType, in its order (trainer.lr_schedule)
SCHEDULES = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
             "inverse_sqrt", "reduce_lr_on_plateau", "cosine_with_min_lr", "cosine_warmup_with_min_lr",
             "warmup_stable_decay", "greedy")
# accelerate.utils.LoggerType, in its order (trainer.report_to, after "none")
TRACKERS = ("all", "aim", "tensorboard", "wandb", "trackio", "comet_ml", "mlflow", "clearml", "dvclive", "swanlab")

# The built-in rollout engines and model families, each imported on first use: declared here alone (the
# registries in gpg_vl/rollout/engine.py and gpg_vl/models/family.py take these tables).
ENGINE_BUILTINS = {
    "hf": "gpg_vl.rollout.hf:HFEngine",
    "vllm": "gpg_vl.rollout.vllm:VLLMEngine",
}
FAMILY_BUILTINS = {
    "generic": "gpg_vl.models.generic:GenericFamily",
    "qwen2_5_vl": "gpg_vl.models.qwen:QwenVLAdapter",
    "qwen2_vl": "gpg_vl.models.qwen:Qwen2VLAdapter",
    "qwen3_vl": "gpg_vl.models.qwen:Qwen3VLAdapter",
    "qwen3_5": "gpg_vl.models.qwen:Qwen3_5Adapter",
}
# The built-in judges (reward.judge.kind): builders registered in gpg_vl/reward/judge.py's JUDGES.
JUDGE_BUILTINS = {
    "none": "gpg_vl.reward.judge:no_judge",
    "endpoint": "gpg_vl.reward.judge:endpoint_judge",
    "local": "gpg_vl.reward.local_judge:local_judge",
}
# the key each built-in judge cannot do without, and an example (JudgeSettings checks it with the config)
JUDGE_NEEDS = {"endpoint": ("url", "http://localhost:8000/v1, an OpenAI-compatible endpoint such as vllm serve's"),
               "local": ("model", "/models/Qwen2.5-VL-7B-Instruct, a model folder or hub id")}
# registry -> (its module, its attribute, the built-in names)
REGISTRIES = {
    "advantages": ("gpg_vl.objective", "ADVANTAGE_ESTIMATORS", ("group_mean", "none", "std_normalized")),
    "losses": ("gpg_vl.objective", "POLICY_LOSSES", ("bnpo", "dapo", "dr_grpo", "gmpo", "gpg", "grpo", "gspo", "luspo",
                                                     "sapo", "vespo")),
    "engines": ("gpg_vl.rollout.engine", "ENGINES", tuple(ENGINE_BUILTINS)),
    "families": ("gpg_vl.models.family", "FAMILIES", tuple(FAMILY_BUILTINS)),
    "judges": ("gpg_vl.reward.judge", "JUDGES", tuple(JUDGE_BUILTINS)),
}
# what each built-in loss declares (gpg_vl/objective.py's `register_policy_loss`): (needs, fixed aggregation)
LOSSES = {"gpg": ((), None), "grpo": (("old", "ref"), None), "dr_grpo": (("old",), "seq_mean_token_sum"),
          "dapo": (("old",), "token_mean"), "bnpo": (("old",), "token_mean"), "gspo": (("old",), "seq_mean_token_mean"),
          "luspo": (("old",), "seq_token_sum"), "sapo": (("old",), "seq_mean_token_mean"),
          "vespo": (("old",), "token_mean"), "gmpo": (("old",), "seq_mean_token_mean")}
# gpg_vl/objective.py's AGGREGATIONS
AGGREGATIONS = ("seq_mean_token_mean", "seq_mean_token_sum", "seq_token_sum", "token_mean")
BASELINES = ("group_mean", "none")  # gpg_vl/objective.py's BASELINES (the deprecated trainer.baseline)
DECODERS = ("loop", "generate")  # gpg_vl/rollout/hf.py
BOX_FRAMES = ("relative-1000", "resized-pixels", "relative-1", "none")  # gpg_vl/models/family.py
SEGMENTERS = ("box", "sam", "sam2")  # gpg_vl/reward/segment.py


def registered(registry: str) -> list[str]:
    """The names `registry` (a key of REGISTRIES) holds now: the registry's own list once its module is
    imported (plugins registered by name included), else the built-in names."""
    module, attribute, builtins = REGISTRIES[registry]
    loaded = getattr(sys.modules.get(module), attribute, None)
    return loaded.names() if loaded is not None else sorted(builtins)


def imported(registry: str) -> bool:
    """Whether the module holding `registry` is imported (then it, not the list here, answers)."""
    module, attribute, _ = REGISTRIES[registry]
    return getattr(sys.modules.get(module), attribute, None) is not None


def loss_declaration(name: str) -> tuple[tuple[str, ...], str | None]:
    """(needs, fixed aggregation) of the loss `trainer.loss` names: a built-in's from the table above while
    gpg_vl/objective.py is not imported, else (and for `module:fn` / `path.py:fn`) the loss's own."""
    if name in LOSSES and not imported("losses"):
        return LOSSES[name]
    from gpg_vl.objective import get_policy_loss, loss_needs

    loss = get_policy_loss(name)
    return loss_needs(loss), getattr(loss, "aggregation", None)


# The multi-turn keys' defaults (rollout.max_turns, ...): read by the schema and by rollout/trajectory.py's
# MultiTurnSettings, which is what the engines take.
MULTITURN_DEFAULTS = {"max_turns": 1, "max_images": 8, "max_total_tokens": 4096, "on_limit": "score",
                      "tool_seconds": 10.0, "zoom_min_side": 30, "zoom_max_aspect_ratio": 100.0,
                      "hf_multiturn": "incremental"}
ON_LIMIT = ("score", "mask")
MULTITURN_MODES = ("incremental", "naive")
