"""The built-in names a setting chooses from, and what the built-in losses declare, readable without importing
the modules that define them (those import torch, transformers or accelerate). So the config is read, typed and
checked in well under a second (docs/robustness.md, "Errors in a second"), and the heavy libraries load only
once it passed.

Every kind of plugin registers its built-ins one way: a table here, name -> "module:attr", which its registry
takes (`Registry(builtins=...)`) and imports on first use; the module's own decorator (`register_task`,
`register_engine`, ...) then finds its name in the table. A registry's names (`registered`) come from its module
when that module is imported, else from the tables here: nothing registers a plugin by name without importing the
registry's module first, so until then the built-ins are the whole list. tests/unit/test_config_light.py checks
every list here against its source (the registries, and the installed transformers' and accelerate's own lists).
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
    "vllm": "gpg_vl.rollout.vllm.colocated:VLLMEngine",
    "vllm_server": "gpg_vl.rollout.vllm.server:VLLMServerEngine",
}
# Where each built-in engine's and tool's settings are declared (the engine's `settings`, the tool's): light
# modules, so the config types and checks rollout.<engine>.* and rollout.tools.<tool>.* before torch loads.
ENGINE_SETTINGS = {
    "hf": "gpg_vl.rollout.settings:HFEngineSettings",
    "vllm": "gpg_vl.rollout.settings:VLLMEngineSettings",
    "vllm_server": "gpg_vl.rollout.settings:VLLMServerSettings",
}
# The built-in tools a task may offer (gpg_vl/rollout/multiturn/tools.py's TOOLS), and their settings.
TOOL_BUILTINS = {"zoom_in": "gpg_vl.rollout.multiturn.tools:zoom_in",
                 "python": "gpg_vl.rollout.multiturn.python_tool:python"}
TOOL_SETTINGS = {"zoom_in": "gpg_vl.rollout.settings:ZoomInSettings",
                 "python": "gpg_vl.rollout.settings:PythonToolSettings"}
FAMILY_BUILTINS = {
    "generic": "gpg_vl.models.generic:GenericFamily",
    "qwen2_5_vl": "gpg_vl.models.qwen:QwenVLFamily",
    "qwen2_vl": "gpg_vl.models.qwen:Qwen2VLFamily",
    "qwen3_vl": "gpg_vl.models.qwen:Qwen3VLFamily",
    "qwen3_5": "gpg_vl.models.qwen:Qwen3_5Family",
}
# The built-in tasks (gpg_vl_tasks is the tasks/ folder), advantage estimators and policy losses.
TASK_BUILTINS = {
    "classification": "gpg_vl_tasks.classification:Classification", "cvbench": "gpg_vl_tasks.cvbench:CVBench",
    "deepeyes": "gpg_vl_tasks.deepeyes:DeepEyes", "geoqa": "gpg_vl_tasks.geoqa:GeoQA", "gui": "gpg_vl_tasks.gui:Gui",
    "hrbench": "gpg_vl_tasks.hrbench:HRBench", "lisa": "gpg_vl_tasks.lisa:Lisa",
    "measure": "gpg_vl_tasks.measure:Measure", "motion": "gpg_vl_tasks.motion:Motion",
    "screenspot": "gpg_vl_tasks.screenspot:ScreenSpot", "screenspot_pro": "gpg_vl_tasks.screenspot_pro:ScreenSpotPro",
    "shapes": "gpg_vl_tasks.shapes:Shapes", "videor1": "gpg_vl_tasks.videor1:VideoR1",
    "vsibench": "gpg_vl_tasks.vsibench:VSIBench", "vstar": "gpg_vl_tasks.vstar:VStar", "zoom": "gpg_vl_tasks.zoom:Zoom",
}
ADVANTAGE_BUILTINS = {"group_mean": "gpg_vl.objective.advantages:group_mean_advantages",
                      "none": "gpg_vl.objective.advantages:raw_reward_advantages",
                      "std_normalized": "gpg_vl.objective.advantages:std_normalized_advantages"}
_LOSSES, _RECENT = "gpg_vl.objective.losses", "gpg_vl.objective.recent_losses"
LOSS_BUILTINS = {"bnpo": f"{_RECENT}:bnpo_loss", "cispo": f"{_RECENT}:cispo_loss", "dapo": f"{_LOSSES}:dapo_loss",
                 "gmpo": f"{_RECENT}:gmpo_loss", "gspo": f"{_RECENT}:gspo_loss", "luspo": f"{_RECENT}:luspo_loss",
                 "sapo": f"{_RECENT}:sapo_loss", "vespo": f"{_RECENT}:vespo_loss", "dr_grpo": f"{_LOSSES}:dr_grpo_loss",
                 "gpg": f"{_LOSSES}:policy_loss", "grpo": f"{_LOSSES}:grpo_loss"}
# The built-in off-policy corrections (trainer.correction): gpg_vl/objective/corrections.py's CORRECTIONS.
_CORRECTIONS = "gpg_vl.objective.corrections"
CORRECTION_BUILTINS = {"geo_reject": f"{_CORRECTIONS}:geo_reject", "none": f"{_CORRECTIONS}:no_correction",
                       "sequence_tis": f"{_CORRECTIONS}:sequence_tis", "token_tis": f"{_CORRECTIONS}:token_tis",
                       "topr": f"{_CORRECTIONS}:topr"}
# The built-in teacher losses (teacher.loss): gpg_vl/objective/teacher_losses.py's TEACHER_LOSSES.
_TEACHER = "gpg_vl.objective.teacher_losses"
TEACHER_LOSS_BUILTINS = {"jsd": f"{_TEACHER}:generalized_jsd", "reverse_kl": f"{_TEACHER}:teacher_advantages"}
# The built-in tool-use reward sets (task.options.rewards of the thinking-with-images tasks).
TOOL_REWARD_BUILTINS = {"accuracy": "gpg_vl.reward.tooluse:accuracy_rewards",
                        "deepeyes": "gpg_vl.reward.tooluse:deepeyes_rewards"}
# The built-in GUI grounding rewards (task.options.rewards of gui, screenspot, screenspot_pro).
_GUI = "gpg_vl.reward.gui"
GUI_REWARD_BUILTINS = {"gaussian_coverage": f"{_GUI}:gaussian_coverage_reward",
                       "gaussian_point": f"{_GUI}:gaussian_point_reward", "point_in_box": f"{_GUI}:point_in_box_reward"}
# The built-in prompt samplers (data.sampler): gpg_vl/data/samplers.py's SAMPLERS.
SAMPLER_BUILTINS = {"uniform": "gpg_vl.data.samplers:UniformSampler",
                    "difficulty": "gpg_vl.data.samplers:DifficultySampler"}
# The built-in judges (reward.judge.kind): builders registered in gpg_vl/reward/judge.py's JUDGES.
JUDGE_BUILTINS = {
    "none": "gpg_vl.reward.judge:no_judge",
    "endpoint": "gpg_vl.reward.judge:endpoint_judge",
    "local": "gpg_vl.reward.local_judge:local_judge",
}
# The built-in judge modes (reward.judge.mode): how a judge is asked and how its reply is read (JUDGE_MODES).
JUDGE_MODE_BUILTINS = {
    "verdict": "gpg_vl.reward.judge:verdict_mode",
    "scale": "gpg_vl.reward.judge_scale:scale_mode",
}
# the key each built-in judge cannot do without, and an example (JudgeSettings checks it with the config)
JUDGE_NEEDS = {"endpoint": ("url", "http://localhost:8000/v1, an OpenAI-compatible endpoint such as vllm serve's"),
               "local": ("model", "/models/Qwen2.5-VL-7B-Instruct, a model folder or hub id")}
# registry -> (its module, its attribute, the built-in names)
REGISTRIES = {
    "advantages": ("gpg_vl.objective", "ADVANTAGE_ESTIMATORS", tuple(ADVANTAGE_BUILTINS)),
    "losses": ("gpg_vl.objective", "POLICY_LOSSES", tuple(LOSS_BUILTINS)),
    "corrections": ("gpg_vl.objective.corrections", "CORRECTIONS", tuple(CORRECTION_BUILTINS)),
    "teacher_losses": ("gpg_vl.objective.teacher_losses", "TEACHER_LOSSES", tuple(TEACHER_LOSS_BUILTINS)),
    "engines": ("gpg_vl.rollout.engine", "ENGINES", tuple(ENGINE_BUILTINS)),
    "families": ("gpg_vl.models.family", "FAMILIES", tuple(FAMILY_BUILTINS)),
    "judges": ("gpg_vl.reward.judge", "JUDGES", tuple(JUDGE_BUILTINS)),
    "judge_modes": ("gpg_vl.reward.judge", "JUDGE_MODES", tuple(JUDGE_MODE_BUILTINS)),
    "tasks": ("gpg_vl.data.task", "TASKS", tuple(TASK_BUILTINS)),
    "samplers": ("gpg_vl.data.samplers", "SAMPLERS", tuple(SAMPLER_BUILTINS)),
    "tools": ("gpg_vl.rollout.multiturn.tools", "TOOLS", tuple(TOOL_BUILTINS)),
    "tool_rewards": ("gpg_vl.reward.tooluse", "TOOL_REWARDS", tuple(TOOL_REWARD_BUILTINS)),
    "gui_rewards": ("gpg_vl.reward.gui", "GUI_REWARDS", tuple(GUI_REWARD_BUILTINS)),
}
# what each built-in loss declares (gpg_vl/objective/registry.py's `register_policy_loss`): (needs, fixed aggregation)
LOSSES = {"gpg": ((), None), "grpo": (("old", "ref"), None), "dr_grpo": (("old",), "seq_mean_token_sum"),
          "dapo": (("old",), "token_mean"), "cispo": (("old",), "token_mean"), "bnpo": (("old",), "token_mean"),
          "gspo": (("old",), "seq_mean_token_mean"), "luspo": (("old",), "seq_token_sum"),
          "sapo": (("old",), "seq_mean_token_mean"), "vespo": (("old",), "token_mean"),
          "gmpo": (("old",), "seq_mean_token_mean")}
# gpg_vl/objective/aggregation.py's AGGREGATIONS
AGGREGATIONS = ("seq_mean_token_mean", "seq_mean_token_sum", "seq_token_sum", "token_mean")
BASELINES = ("group_mean", "none")  # gpg_vl/objective/advantages.py's BASELINES (the deprecated trainer.baseline)
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
