"""The settings, declared once: these dataclasses are both the trainer's settings and the schema that Hydra
checks the composed config against (registered in its ConfigStore as `train_schema` and `eval_schema`, the
first entry of configs/train.yaml's and configs/eval.yaml's defaults lists). Each field carries its type, its
default, its range or choices and its one-line meaning (`meta`); nothing else restates them:

- Hydra rejects an undeclared key or a value of the wrong type at composition, in one sentence
  (gpg_vl/config/compose.py);
- gpg_vl/config/validate.py derives every per-key value check from the metadata, before any model is loaded;
- scripts/gen_config_docs.py writes docs/configuration.md from it.

configs/*.yaml hold no copy of these defaults; model aliases and task configs set what differs.
`python scripts/train.py --cfg job` prints every setting with its value.

This module imports nothing heavy (no torch, no transformers), and neither do the settings' checks on built-in
names: choices that come from a registry or a library are named here (`choices="engines"`) and read in
gpg_vl/config/rules.py's `choices_of` from gpg_vl/config/names.py, which also holds what the built-in losses
declare; a plugin (`module:name`) is loaded to be checked.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any  # noqa: UP035  (OmegaConf reads typing.Optional, not `X | None`)

from gpg_vl.config.keys import as_sections, meta, with_sections
from gpg_vl.config.names import ENGINE_SETTINGS, JUDGE_NEEDS, LOSS_BUILTINS, TOOL_SETTINGS
from gpg_vl.config.teacher import TeacherSettings  # noqa: F401 (its section, `teacher.*`, is declared there)
from gpg_vl.errors import UserError
from gpg_vl.registry import load_reference

ALGORITHM_PRESETS = Path(__file__).resolve().parents[2] / "configs" / "algorithm"  # algorithm=<name>: <name>.yaml
# The choices read lazily (gpg_vl/config/rules.py's `choices_of`), and how the reference page names them.
CHOICE_SOURCES = {
    "schedules": "a transformers scheduler name (`transformers.SchedulerType`)",
    "trackers": "none, or an accelerate tracker (`accelerate.utils.LoggerType`)",
    "advantages": "a registered advantage estimator (`gpg_vl/objective/advantages.py`)",
    "baselines": "group_mean or none",
    "losses": "a registered policy loss (`gpg_vl/objective/`)",
    "corrections": "a registered off-policy correction (`gpg_vl/objective/corrections.py`)",
    "teacher_losses": "a registered teacher loss (`gpg_vl/objective/teacher_losses.py`): reverse_kl, jsd",
    "aggregations": "a loss aggregation (`gpg_vl/objective/aggregation.py`)",
    "engines": "a registered rollout engine (`gpg_vl/rollout/engine.py`)",
    "decoders": "loop or generate (`gpg_vl/rollout/hf.py`)",
    "families": "auto, or a registered model family (`gpg_vl/models/family.py`)",
    "box_frames": "a box frame (`gpg_vl/models/family.py`): relative-1000, resized-pixels, relative-1, none",
    "segmenters": "a segmenter (`gpg_vl/reward/segment.py`): box, sam, sam2",
    "judges": "a registered judge (`gpg_vl/reward/judge.py`): none, endpoint, local",
    "judge_modes": "a registered judge mode (`gpg_vl/reward/judge.py`): verdict, scale",
    "samplers": "a registered prompt sampler (`gpg_vl/data/samplers.py`): uniform, difficulty",
}


def loss_declaration(name: str) -> tuple[tuple[str, ...], str | None]:
    """(needs, fixed aggregation) of the loss `trainer.loss` names: a built-in's from names.LOSSES while
    gpg_vl.objective is not imported, else (and for `module:fn` / `path.py:fn`) the loss's own."""
    from gpg_vl.config import names

    if name in names.LOSSES and not names.imported("losses"):
        return names.LOSSES[name]
    from gpg_vl.objective import get_policy_loss, loss_needs

    loss = get_policy_loss(name)
    return loss_needs(loss), getattr(loss, "aggregation", None)


@dataclass
class TrainerSettings:
    """`trainer.*`: the optimisation, the GPG objective, the update's throughput paths, checkpoints."""

    max_steps: int = field(default=100, metadata=meta("optimizer steps", low=1))
    epochs: float | None = field(default=None, metadata=meta(
        "if set, passes over the train split (at B prompts per step) replace max_steps", above=0,
        note="a trainer.max_steps typed on the command line wins over a task's epochs"))
    group_size: int = field(default=8, metadata=meta(
        "G: completions sampled per prompt", low=1, note="at least 2 with a group baseline"))
    batch_size: int = field(default=8, metadata=meta("B: prompts per step, over all processes", low=1))
    micro_batch_size: int = field(default=16, metadata=meta(
        "sequences per forward/backward (gradient accumulation over the rest)", low=0))
    micro_batch_tokens: int = field(default=8192, metadata=meta(
        "micro-batches by forward tokens, padding counted, instead (0 = by micro_batch_size)", low=0))
    lr: float = field(default=1e-06, metadata=meta("AdamW learning rate (the paper's multimodal runs)", above=0))
    lr_schedule: str = field(default="constant", metadata=meta(
        "learning-rate schedule: constant, constant_with_warmup, cosine, linear, ...", choices="schedules"))
    warmup_steps: int = field(default=0, metadata=meta(
        "warm-up steps for *_with_warmup, cosine and linear schedules", low=0))
    weight_decay: float = field(default=0.0, metadata=meta("AdamW weight decay", low=0))
    max_grad_norm: float = field(default=1.0, metadata=meta("gradient clipping", above=0))
    beta_th: float = field(default=0.4, metadata=meta(
        "resample until this fraction of B groups has differing rewards (0 = never)", low=0, high=1))
    max_attempts: int = field(default=8, metadata=meta("most rollouts per step while resampling", low=1))
    max_completions: int | None = field(default=None, metadata=meta(
        "stop after this many sampled completions, resampled ones included (ablations)", low=1))
    max_sampled_tokens: int | None = field(default=None, metadata=meta(
        "stop once the policy has sampled this many tokens (generated only: no prompt or tool-observation tokens; "
        "resampled and T-GRPO's shuffled rollouts included); with max_completions, the first reached stops",
        low=1))
    advantage: str = field(default="group_mean", metadata=meta(
        "group_mean: r - mean(r) (GPG); std_normalized: (r - mean) / (sample std + 1e-4) (GRPO); none: r",
        choices="advantages", references=True))
    loss: str = field(default="gpg", metadata=meta(
        f"policy loss: {', '.join(sorted(LOSS_BUILTINS))} (the algorithm=<name> presets set their own)",
        choices="losses", references=True))
    ppo_epochs: int = field(default=1, metadata=meta(
        "mu: passes over each rollout (losses with a ratio: grpo, dr_grpo, dapo)", low=1))
    ppo_mini_batch: int = field(default=0, metadata=meta(
        "sequences per optimizer step, over all processes, a multiple of group_size (0 = the whole rollout)",
        low=0, note="0 = the whole rollout"))
    clip_low: float = field(default=0.2, metadata=meta("ratio clipped below at 1 - clip_low", low=0, below=1))
    clip_high: float | None = field(default=None, metadata=meta(
        "ratio clipped above at 1 + clip_high (null = clip_low; DAPO's clip-higher: 0.28)", low=0, below=1,
        note="null = clip_low"))
    kl_coef: float = field(default=0.0, metadata=meta(
        "beta: k3 KL to the frozen reference model (loss grpo; 0 = no reference model)", low=0))
    loss_options: dict = field(default_factory=dict, metadata=meta(
        "options of trainer.loss by name (a loss declares them as keyword arguments; clip_low, clip_high, kl_coef "
        "and max_tokens = rollout.max_new_tokens fill those not given here)"))
    overlong_cache: int = field(default=0, metadata=meta(
        "DAPO's overlong shaping: a reward penalty over the last this many tokens before rollout.max_new_tokens "
        "(a trajectory: its generated tokens before rollout.max_total_tokens; 0 = off)", low=0, note="0 = off"))
    overlong_penalty: float = field(default=1.0, metadata=meta(
        "the penalty at the length limit (it grows linearly over overlong_cache tokens)", low=0))
    std_normalize: bool | None = field(default=None, metadata=meta(
        "deprecated: trainer.advantage=std_normalized (one warning)", note="deprecated: trainer.advantage"))
    baseline: str | None = field(default=None, metadata=meta(
        "deprecated: trainer.advantage=group_mean or none (one warning)", choices="baselines",
        note="deprecated: trainer.advantage"))
    age: bool = field(default=True, metadata=meta(
        "AGE: loss = mean over valid groups (alpha = B/(B-M)); false = over all B (alpha 1)"))
    aggregation: str = field(default="seq_mean_token_mean", metadata=meta(
        "seq_mean_token_mean; token_mean (mean over all tokens of the batch); seq_mean_token_sum (token sums "
        "over max_new_tokens: Dr. GRPO); seq_token_sum (token sums, mean over sequences: LUSPO)",
        choices="aggregations"))
    gradient_checkpointing: bool = field(default=False, metadata=meta("trade compute for memory on large models"))
    share_vision: bool = field(default=True, metadata=meta(
        "encode each prompt's images once per group in the update (false = once per sequence)"))
    share_prompt: bool = field(default=True, metadata=meta(
        "run each prompt once per group in the update, completions on its cache (false = per sequence; off "
        "under gradient_checkpointing, FSDP and ZeRO-3)"))
    packing: str = field(default="off", metadata=meta(
        "run each micro-batch as one padding-free row, prompts once per group (auto: where the model can)",
        choices=("auto", "on", "off"), note="docs/packing.md"))
    logits_chunk_tokens: int = field(default=1024, metadata=meta(
        "score completions through the output layer this many tokens at a time (0 = all at once)", low=0))
    save_every: int = field(default=0, metadata=meta(
        "write checkpoint-<step>/ every N steps (0 = only final/)", low=0, note="0 = only final/"))
    keep_checkpoints: int = field(default=2, metadata=meta(
        "how many checkpoint-<step>/ folders to keep", low=0, note="0 = keep all"))
    max_bad_steps: int = field(default=10, metadata=meta(
        "stop after this many steps in a row with a NaN/inf loss or gradient (0 = never)", low=0,
        note="0 = never stop"))
    reward_workers: int = field(default=4, metadata=meta(
        "completions of a step scored at once (threads; math checks run in child processes)", low=1))
    reward_budget_s: float = field(default=60.0, metadata=meta(
        "reward time per step; completions not scored by then score 0 (reward_timeouts; 0 = no budget)", low=0,
        note="0 = no budget"))
    report_to: str = field(default="none", metadata=meta(
        "none, tensorboard or wandb (through accelerate's trackers)", choices="trackers"))
    log_rollouts_every: int = field(default=10, metadata=meta(
        "write rollouts/step-<N>.json (and send them to the tracker) every N steps and at step 1 (0 = never)",
        low=0, note="0 = never"))
    log_rollouts_groups: int = field(default=8, metadata=meta(
        "groups (prompt, images, G completions, rewards, advantages) recorded per logged step", low=1))
    max_staleness: int = field(default=0, metadata=meta(
        "k: step n samples with the weights after step max(0, n-1-k), beside the learner (0 = synchronous)", low=0,
        note="0 = synchronous"))
    correction: str = field(default="none", metadata=meta(
        "off-policy correction of the loss: none, token_tis, sequence_tis, geo_reject, topr", choices="corrections",
        references=True))
    correction_options: dict = field(default_factory=dict, metadata=meta(
        "options of trainer.correction by name (token_tis / sequence_tis: cap; geo_reject: delta)"))
    top_entropy_quantile: float = field(default=1.0, metadata=meta(
        "rho: only the tokens in the top rho of entropy in each micro-batch give gradient (TRL's; 0.2 = the 80/20 "
        "result; 1 = every token)", above=0, high=1, note="docs/distillation.md#entropy"))
    clip_cov_ratio: float = field(default=0.0, metadata=meta(
        "verl's Clip-Cov: the share of counted tokens per micro-batch, drawn among those whose covariance term "
        "(A - mean A)(log pi - mean log pi) lies within clip_cov_bounds, that give no gradient (0 = off; verl: 2e-4)",
        low=0, high=1, note="docs/distillation.md#entropy"))
    clip_cov_bounds: list = field(default_factory=lambda: [1.0, 5.0], metadata=meta(
        "Clip-Cov's [lower, upper] covariance band (verl's clip_cov_lb, clip_cov_ub)"))
    eval_before: bool = field(default=True, metadata=meta("evaluate the held-out split before training"))
    eval_after: bool = field(default=True, metadata=meta("evaluate the held-out split after training"))
    eval_every: int = field(default=0, metadata=meta(
        "evaluate the held-out split every N steps during training, with the learner's current weights, into that "
        "step's metrics as eval_<metric> (0 = never; the last step is left to eval_after when it is on)", low=0,
        note="0 = never"))

    def __post_init__(self) -> None:
        from gpg_vl.config import names

        # an unknown variant, or a contradiction between keys, fails before any work; a built-in name is read
        # from gpg_vl/config/names.py (no torch), a plugin (`module:fn`, or a registry already imported) from its
        # registry, and the deprecated keys through gpg_vl/objective/advantages.py (their one warning)
        if self.baseline is not None or self.std_normalize is not None:
            from gpg_vl.objective import advantage_from_deprecated

            self.advantage = advantage_from_deprecated(self.advantage, self.baseline, self.std_normalize)
        self.baseline = self.std_normalize = None
        if self.advantage not in names.REGISTRIES["advantages"][2] or names.imported("advantages"):
            from gpg_vl.objective import get_advantage

            get_advantage(self.advantage)
        needs, fixed = loss_declaration(self.loss)
        if self.aggregation not in names.AGGREGATIONS:
            raise UserError(f"unknown trainer.aggregation {self.aggregation!r}; valid options: "
                            f"{', '.join(names.AGGREGATIONS)}.")
        if fixed is not None and fixed != self.aggregation:
            preset = (f"algorithm={self.loss} sets both" if (ALGORITHM_PRESETS / f"{self.loss}.yaml").is_file()
                      else f"there is no algorithm={self.loss} preset: give both settings")
            raise UserError(f"trainer.loss={self.loss} aggregates as {fixed}; set trainer.aggregation={fixed} "
                            f"({preset}).")
        if self.kl_coef > 0 and "ref" not in needs:
            raise UserError(f"trainer.kl_coef={self.kl_coef} needs a loss with a KL term; trainer.loss={self.loss} "
                            "has none: set trainer.loss=grpo or trainer.kl_coef=0.")
        if self.ppo_mini_batch % self.group_size:
            raise UserError(f"trainer.ppo_mini_batch={self.ppo_mini_batch} is not a multiple of trainer.group_size="
                            f"{self.group_size}; mini-batches hold whole groups.")
        if self.correction_options or self.correction not in names.REGISTRIES["corrections"][2] or \
                names.imported("corrections"):  # a name or option that is not built in: the registry answers
            from gpg_vl.objective.corrections import correction_options

            correction_options(self.correction, self.correction_options)
        if self.loss_options:  # an unknown option, or a value outside what the loss declares, fails here
            from gpg_vl.objective import get_policy_loss, loss_options

            loss_options(get_policy_loss(self.loss), dict(self.loss_options), {}, name=self.loss)
        if (self.ppo_epochs > 1 or self.ppo_mini_batch) and "old" not in needs:
            raise UserError(f"trainer.ppo_epochs / trainer.ppo_mini_batch take several optimizer steps per rollout, "
                            f"which needs a loss with a ratio to the rollout policy; trainer.loss={self.loss} has "
                            "none: set trainer.loss=grpo (or dr_grpo, dapo), or trainer.ppo_epochs=1 and "
                            "trainer.ppo_mini_batch=0.")

    @property
    def optimizer_steps_per_rollout(self) -> int:
        """mu x (B x G / mini-batch): the optimizer steps of a rollout whose groups are all valid."""
        sequences = self.batch_size * self.group_size
        return self.ppo_epochs * (-(-sequences // self.ppo_mini_batch) if self.ppo_mini_batch else 1)


# deprecated key -> the key that replaced it (one warning naming the new key; the old one still works)
ROLLOUT_ALIASES = {"prefill_once": "hf.prefill_once", "static_cache": "hf.static_cache",
                   "zoom_min_side": "tools.zoom_in.min_side", "zoom_max_aspect_ratio": "tools.zoom_in.max_aspect_ratio"}
ON_LIMIT = ("score", "mask")
MULTITURN_KEYS = ("max_turns", "max_images", "max_total_tokens", "on_limit", "tool_seconds")  # MultiTurnSettings'


def _sections(table: dict[str, str]) -> dict[str, type]:
    """name -> settings dataclass of the built-ins in `table` (gpg_vl/config/names.py: light modules only)."""
    return {name: load_reference(reference, "settings") for name, reference in table.items()}


@dataclass
class ToolSettings:
    """`rollout.tools.<tool>.*`: each tool's own settings, declared by the tool (`register_tool(..., settings=)`)."""


# one section per built-in tool with settings; an out-of-tree tool's is added with the config that uses it
ToolSettings = with_sections(ToolSettings, _sections(TOOL_SETTINGS))


@dataclass
class RolloutSettings:
    """`rollout.*`: sampling the G completions of each prompt, through the engine `engine` names; each engine's own
    settings under `rollout.<engine>.*`, each tool's under `rollout.tools.<tool>.*` (declared by the engine and
    the tool: gpg_vl/rollout/settings.py for the built-ins)."""

    engine: str = field(default="hf", metadata=meta(
        "hf (transformers, any device), vllm (colocated, CUDA; pip install -e \".[vllm]\") or vllm_server "
        "(stock `vllm serve` endpoints: rollout.vllm_server.*)", choices="engines",
        references=True))
    max_new_tokens: int = field(default=256, metadata=meta("completion length limit", low=1))
    temperature: float = field(default=1.0, metadata=meta(
        "sampling temperature (the update's log-probs use the same)", above=0,
        note="sampling needs it; the update's log-probs divide by it"))
    top_p: float = field(default=1.0, metadata=meta("nucleus sampling", above=0, high=1))
    ignore_eos: bool = field(default=False, metadata=meta("always generate max_new_tokens (benchmarks)"))
    max_prompt_tokens: int = field(default=4096, metadata=meta(
        "longer prompts are skipped with a warning, never truncated", low=1))
    max_turns: int = field(default=1, metadata=meta(
        "model segments per trajectory: > 1 lets the model call the task's tools (thinking with images) and "
        "continue after each observation; 1 = one completion per rollout", low=1))
    max_images: int = field(default=8, metadata=meta(
        "images the tools may add to one trajectory, in all (an observation past it ends the trajectory)", low=0))
    max_total_tokens: int = field(default=4096, metadata=meta(
        "tokens after the prompt of one trajectory (segments and observations), in all; each segment has at most "
        "max_new_tokens", low=1))
    on_limit: str = field(default="score", metadata=meta(
        "a trajectory cut by a limit (turns, images, tokens): score it as it is (DeepEyes) or mask its loss, "
        "keeping its reward in the group's mean (Mini-o3)", choices=ON_LIMIT))
    tool_seconds: float = field(default=10.0, metadata=meta(
        "time budget of one tool call; past it the call is an error observation", above=0))
    tools: ToolSettings = field(default_factory=ToolSettings)
    prefill_once: bool | None = field(default=None, metadata=meta(
        "deprecated: rollout.hf.prefill_once", note="deprecated: rollout.hf.prefill_once"))
    static_cache: bool | None = field(default=None, metadata=meta(
        "deprecated: rollout.hf.static_cache", note="deprecated: rollout.hf.static_cache"))
    zoom_min_side: int | None = field(default=None, metadata=meta(
        "deprecated: rollout.tools.zoom_in.min_side", note="deprecated: rollout.tools.zoom_in.min_side"))
    zoom_max_aspect_ratio: float | None = field(default=None, metadata=meta(
        "deprecated: rollout.tools.zoom_in.max_aspect_ratio",
        note="deprecated: rollout.tools.zoom_in.max_aspect_ratio"))

    def __post_init__(self) -> None:
        import warnings

        as_sections(self)  # RolloutSettings(**container): the sections arrive as plain dicts
        as_sections(self.tools)
        for old, new in ROLLOUT_ALIASES.items():
            value = getattr(self, old)
            if value is not None:  # the old key still works, with one warning that names the new one
                warnings.warn(f"rollout.{old} is deprecated; set rollout.{new}={str(value).lower()} instead.",
                              FutureWarning, stacklevel=2)
                *path, last = new.split(".")
                holder = self
                for part in path:
                    holder = getattr(holder, part)
                setattr(holder, last, value)
                setattr(self, old, None)


# one section per built-in engine (rollout.hf, rollout.vllm); an out-of-tree engine's is added with the config
RolloutSettings = with_sections(RolloutSettings, _sections(ENGINE_SETTINGS))


@dataclass
class EvalSettings:
    """`eval.*`: evaluation of the held-out split (during training, and by scripts/eval.py): greedy by default,
    or `samples` completions per row at `temperature` (mean@k, pass@k, maj@k: gpg_vl/train/eval/at_k.py)."""

    split: str | None = field(default=None, metadata=meta(
        "held-out split (null = the task's eval split)", nonempty=True))
    limit: int | None = field(default=None, metadata=meta("evaluate only the first N rows", low=1))
    batch_size: int = field(default=32, metadata=meta("prompts per greedy decoding batch", low=1))
    max_new_tokens: int | None = field(default=None, metadata=meta(
        "completion length limit (null = rollout.max_new_tokens)", low=1))
    reward_workers: int = field(default=4, metadata=meta("completions of a batch scored at once (threads)", low=1))
    reward_budget_s: float = field(default=120.0, metadata=meta(
        "reward time per decoding batch; completions not scored by then score 0 (reward_timeouts; 0 = no budget)",
        low=0, note="0 = no budget"))
    samples: int = field(default=1, metadata=meta(
        "completions per row (k): 1 = one greedy completion; more = mean@k, pass@k, maj@k and their standard "
        "errors, per benchmark and category", low=1))
    temperature: float | None = field(default=None, metadata=meta(
        "sampling temperature of the held-out completions (0 = greedy; null = greedy with samples=1, else "
        "rollout.temperature)", low=0, note="null: greedy for one sample"))

    def __post_init__(self) -> None:
        if self.samples > 1 and self.temperature == 0:
            raise UserError(f"eval.samples={self.samples} with eval.temperature=0 (greedy) decodes {self.samples} "
                            "identical completions; set eval.temperature above 0 (e.g. 1.0), or eval.samples=1.")


@dataclass
class LoraSettings:
    """`model.lora.*`: LoRA through PEFT (gpg_vl/models/lora.py)."""

    r: int = field(default=0, metadata=meta("LoRA rank; 0 = full fine-tuning", low=0))
    alpha: float = field(default=32.0, metadata=meta("LoRA scale is alpha / r", above=0))
    dropout: float = field(default=0.0, metadata=meta("dropout on the LoRA input", low=0, high=1))
    target_modules: Any = field(  # a list of names, or one regular expression
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        metadata=meta("the modules that get an adapter: a list of names, or one regular expression"))
    include_vision: bool = field(default=False, metadata=meta(
        "false = the vision tower gets no adapter (and stays frozen)"))
    target_parameters: Any = field(default_factory=list, metadata=meta(
        "parameter tensors to adapt too, e.g. [mlp.experts.gate_up_proj, mlp.experts.down_proj] (MoE experts)"))
    save: str = field(default="adapter", metadata=meta(
        "checkpoints hold the adapter alone, or merged = full weights in Hugging Face format",
        choices=("adapter", "merged")))


@dataclass
class ModelSettings:
    """`model.*`: which model (an alias, configs/model/<alias>.yaml, sets what differs from these defaults), how it
    is loaded (gpg_vl/models/load.py's `load_policy` takes these settings) and how it is trained."""

    name_or_path: str | None = field(default=None, metadata=meta(
        "hub id, local Hugging Face directory, embedded:<name> or tiny:<family>"))
    family: str = field(default="auto", metadata=meta(
        "auto = from the model's config.json (model_type); or a family name", choices="families",
        references=True))
    prompt_style: str = field(default="chat", metadata=meta(
        "chat (chat template) or raw (model.raw_template: base models)", choices=("chat", "raw")))
    enable_thinking: bool = field(default=True, metadata=meta(
        "false = the chat template's thinking off, where the template has that switch"))
    box_frame: str | None = field(default=None, metadata=meta(
        "the frame of the model's boxes (null = the family's)", choices="box_frames"))
    router_aux_loss_coef: float = field(default=0.0, metadata=meta(
        "mixture-of-experts router auxiliary loss (0 = off, as TRL's GPG)", low=0))
    dtype: str = field(default="auto", metadata=meta(
        "weights' dtype; auto = bfloat16 on a GPU that has it, else float32",
        choices=("auto", "float32", "bfloat16", "float16")))
    min_pixels: int | None = field(default=3136, metadata=meta(
        "images are resized to at least this many pixels", low=1))
    max_pixels: int | None = field(default=401408, metadata=meta(
        "and at most this many (the paper's setting)", low=1))
    video_min_pixels: int | None = field(default=None, metadata=meta(
        "video frames are resized to at least this many pixels each (null = min_pixels)", low=1))
    video_max_pixels: int | None = field(default=100352, metadata=meta(
        "and at most this many each (Video-R1's 128 x 28 x 28; null = max_pixels)", low=1))
    video_total_pixels: int | None = field(default=None, metadata=meta(
        "and at most this many over a video's frames together (null = qwen-vl-utils' budget)", low=1))
    trust_remote_code: bool = field(default=False, metadata=meta(
        "run code from the model repository (only if you trust it)"))
    attn_implementation: str | None = field(default="sdpa", metadata=meta(
        "attention kernel (null = transformers' choice)",
        choices=("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")))
    raw_template: str | None = field(default=None, metadata=meta(
        "prompt_style=raw: text around {prompt} (the question, images inline); null = R1-V's"))
    freeze_vision: bool = field(default=False, metadata=meta(
        "true = the vision tower is not trained (not in the optimizer)"))
    lora: LoraSettings = field(default_factory=LoraSettings)

    def __post_init__(self) -> None:
        if isinstance(self.lora, dict):  # ModelSettings(**container): the section arrives as a plain dict
            self.lora = LoraSettings(**self.lora)


@dataclass
class DataSettings:
    """`data.*`: where the task's data is read from, and how many bad rows a run tolerates."""

    path: str | None = field(default=None, metadata=meta(
        "a local copy of the task's data (file, folder of files, or save_to_disk folder); null = the task's hub copy"))
    image_root: str | None = field(default=None, metadata=meta(
        "where relative image paths in the data resolve (null = next to the data file)"))
    allow_outside_paths: bool = field(default=False, metadata=meta(
        "true: image paths may point outside the image root ('../x.png', absolute paths)"))
    max_bad_fraction: float = field(default=0.05, metadata=meta(
        "bad rows are skipped and counted; stop when more than this fraction of rows seen are bad", low=0, high=1))
    max_video_frames: int = field(default=16, metadata=meta(
        "the most frames sampled from one video of a prompt (Video-R1 trains on 16)", low=2))
    sampler: str = field(default="uniform", metadata=meta(
        "which prompts the stream draws: uniform (each row once per epoch, in a seeded order) or difficulty "
        "(prompts all-right or all-wrong on their last groups come back less often; gpg_vl/data/samplers.py)",
        choices="samplers", references=True))
    difficulty_keep: float = field(default=0.25, metadata=meta(
        "data.sampler=difficulty: the chance a settled prompt (pass rate 0 or 1 on its last groups) is drawn when "
        "its turn comes (else it waits for the next epoch)", above=0, high=1))
    difficulty_window: int = field(default=2, metadata=meta(
        "data.sampler=difficulty: the groups of a prompt its pass rate is read from (the most recent ones)", low=1))


@dataclass
class TaskSettings:
    """`task.*`: the task plugin (configs/task/<name>.yaml sets both)."""

    name: str | None = field(default=None, metadata=meta(
        "registered task name, or module:ClassName, or path/to/file.py:ClassName"))
    options: Any = field(default=None, metadata=meta(
        "keyword arguments of the task's constructor (task.options.<key>=; see the task's config); task=mix: "
        "each task's under its entry, task.options.<entry>.<key>="))
    mixture: Any = field(default=None, metadata=meta(
        "task=mix: the tasks trained together and their weights, {name: weight, ...} (a name, module:Class or "
        "file.py:Class; weights > 0, each task's share of the prompts is its weight over their sum)"))
    rollout: Any = field(default=None, metadata=meta(
        "task=mix: the rollout settings each task owns, task.rollout.<entry>.<key>= (max_new_tokens, max_turns, "
        "max_total_tokens, max_images, ...; default: its task config's)"))
    data: Any = field(default=None, metadata=meta(
        "task=mix: each task's data.path / data.image_root, task.data.<entry>.path="))
    teacher: Any = field(default=None, metadata=meta(
        "task=mix: each task's own teacher, task.teacher.<entry>.<key>= (the keys of teacher.*: model or urls, "
        "coef, loss, ...; over the run's teacher.*, which every task has otherwise)"))


@dataclass
class JudgeSettings:
    """`reward.judge.*`: the LLM judge a task asks where no rule scores an answer (a sentence ground truth:
    `deepeyes`); gpg_vl/reward/judge.py, docs/tasks.md#the-llm-judge."""

    kind: str = field(default="none", metadata=meta(
        "none (rows that need a judge are skipped and counted), endpoint (an OpenAI-compatible server at url, "
        "vllm serve included) or local (the model at model, on the run's device)", choices="judges",
        references=True))
    url: str | None = field(default=None, metadata=meta(
        "endpoint: the server's base URL, e.g. http://localhost:8000/v1"))
    model: str | None = field(default=None, metadata=meta(
        "endpoint: the model name the server serves (null = the first its /v1/models lists, else judge); local: a "
        "model folder or hub id"))
    timeout_s: float = field(default=30.0, metadata=meta(
        "endpoint: seconds a request may go unanswered (retried meanwhile) before the judge is down and the run "
        "stops at a checkpoint", above=0))
    api_key_env: str = field(default="OPENAI_API_KEY", metadata=meta(
        "endpoint: the environment variable holding a bearer token, sent when set", nonempty=True))
    batch_size: int = field(default=16, metadata=meta(
        "local: the most questions in one forward pass", low=1))
    mode: str = field(default="verdict", metadata=meta(
        "what the judge gives: verdict (yes or no: 1 or 0) or scale (a score on scale_min..scale_max, mapped to "
        "0..1; endpoint only)", choices="judge_modes", references=True))
    rubric: str | None = field(default=None, metadata=meta(
        "scale: the judge's prompt, a template with {question}, {reference}, {answer}, {low}, {high}, or a path "
        "to a text file holding one (null = the built-in rubric)"))
    scale_min: float = field(default=0.0, metadata=meta("scale: the lowest score the rubric allows (maps to 0)"))
    scale_max: float = field(default=10.0, metadata=meta(
        "scale: the highest score the rubric allows (maps to 1; above scale_min)"))
    max_tokens: int | None = field(default=None, metadata=meta(
        "endpoint: the most tokens the judge writes per answer (null: the mode's, 4 for verdict, 32 for scale)",
        low=1))
    concurrency: int = field(default=8, metadata=meta(
        "endpoint: the most requests in flight at once (a step's questions are sent together)", low=1))

    def __post_init__(self) -> None:
        key, example = JUDGE_NEEDS.get(self.kind, (None, ""))
        if key is not None and not getattr(self, key):  # refused with the config, before anything loads
            raise UserError(f"reward.judge.kind={self.kind} needs reward.judge.{key}, e.g. "
                            f"reward.judge.{key}={example}.")
        if not self.scale_max > self.scale_min:
            raise UserError(f"reward.judge.scale_max={self.scale_max} must be above reward.judge.scale_min="
                            f"{self.scale_min}; give the rubric's lowest and highest score, e.g. 0 and 10.")


@dataclass
class RewardSettings:
    """`reward.*`: reward settings of the run, whatever the task."""

    judge: JudgeSettings = field(default_factory=JudgeSettings)

    def __post_init__(self) -> None:
        if isinstance(self.judge, dict):  # RewardSettings(**container): the section arrives as a plain dict
            self.judge = JudgeSettings(**self.judge)


@dataclass
class TrainSchema:
    """configs/train.yaml as a whole: the top-level keys and the typed sections."""

    output_dir: str = field(default="outputs", metadata=meta(
        "metrics.jsonl, summary.json, curves.png, checkpoints (train.yaml: outputs/<task>/<time>)", nonempty=True))
    seed: int = field(default=0, metadata=meta(
        "seeds python, numpy, torch and the prompt order", low=0, high=2**31 - 1))
    resume: str | None = field(default=None, metadata=meta(
        "auto = the newest intact checkpoint in output_dir (if any), a checkpoint folder, or null"))
    overwrite: bool = field(default=False, metadata=meta(
        "true = a new run in an output_dir holding a previous run moves its files to previous-<time>/"))
    model: ModelSettings = field(default_factory=ModelSettings)
    task: TaskSettings = field(default_factory=TaskSettings)
    data: DataSettings = field(default_factory=DataSettings)
    trainer: TrainerSettings = field(default_factory=TrainerSettings)
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    eval: EvalSettings = field(default_factory=EvalSettings)
    reward: RewardSettings = field(default_factory=RewardSettings)
    teacher: TeacherSettings = field(default_factory=TeacherSettings)


@dataclass
class EvalSchema:
    """configs/eval.yaml as a whole (the first entry of its defaults list, `eval_schema`): the evaluation's own
    keys, and rollout.* as in training (the engine that decodes; rollout.max_new_tokens when
    eval.max_new_tokens is null). A task config's trainer.* defaults are accepted and ignored."""

    output_dir: str = field(default="outputs/eval", metadata=meta(
        "predictions.jsonl, metrics.json, predictions.html (eval.yaml: outputs/eval/<task>/<time>)", nonempty=True))
    seed: int = field(default=0, metadata=meta("seeds torch", low=0, high=2**31 - 1))
    predictions: str | None = field(default=None, metadata=meta(
        "a predictions.jsonl to re-score without loading the policy model"))
    segmenter: str = field(default="sam", metadata=meta(
        "lisa's mask metrics (gIoU, cIoU): sam (the paper's, SAM ViT-H), sam2, or box (the filled box: no model)",
        choices="segmenters"))
    segmenter_model: str | None = field(default=None, metadata=meta(
        "null = the segmenter's default checkpoint (facebook/sam-vit-huge, facebook/sam2.1-hiera-large); a hub id "
        "or a folder"))
    segmenter_batch_size: int = field(default=8, metadata=meta(
        "images (one box each) per segmenter forward pass", low=1))
    model: ModelSettings = field(default_factory=ModelSettings)
    task: TaskSettings = field(default_factory=TaskSettings)
    data: DataSettings = field(default_factory=DataSettings)
    trainer: Any = None
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    eval: EvalSettings = field(default_factory=EvalSettings)
    reward: RewardSettings = field(default_factory=RewardSettings)


def schemas_with(engines: dict[str, type] | None = None, tools: dict[str, type] | None = None):
    """(TrainSchema, EvalSchema) with the sections of out-of-tree engines (`rollout.<engine>`) and tools
    (`rollout.tools.<tool>`) a run uses: name -> the plugin's settings dataclass. The schemas themselves when
    there is none."""
    if not engines and not tools:
        return TrainSchema, EvalSchema
    rollout = with_sections(RolloutSettings, dict(engines or {}))
    if tools:
        rollout = with_sections(rollout, {"tools": with_sections(ToolSettings, tools)})
    return tuple(with_sections(schema, {"rollout": rollout}) for schema in (TrainSchema, EvalSchema))


def register_schema(train=TrainSchema, evaluation=EvalSchema) -> None:
    """Register the train and eval schemas (`schemas_with`'s for a run with plugin sections) with Hydra's
    ConfigStore as `train_schema` and `eval_schema` (each call replaces the last)."""
    from hydra.core.config_store import ConfigStore

    global _registered
    store = ConfigStore.instance()
    if _registered == (store, train, evaluation) and {"train_schema.yaml", "eval_schema.yaml"} <= set(store.repo):
        return  # already there: turning the dataclasses into configs again costs 0.15 s per call
    store.store(name="train_schema", node=train)
    store.store(name="eval_schema", node=evaluation)
    _registered = (store, train, evaluation)


_registered: tuple | None = None  # (ConfigStore, train schema, eval schema) as register_schema last left them
