"""The training settings, declared once: these dataclasses are both the trainer's settings and the schema
that Hydra checks the composed config against (registered in its ConfigStore as `train_schema`, the first
entry of configs/train.yaml's defaults list). configs/train.yaml holds no copy of these defaults; task
configs may override them. A key that is not declared here, or a value of the wrong type, fails at
composition with one sentence naming the key, the value and the expected type (gpg_vl/config/compose.py); values
out of range fail right after, in gpg_vl/config/validate.py's table, before any model is loaded.

`python scripts/train.py --cfg job` prints every setting with its value.
"""

from dataclasses import dataclass, field
from typing import Any  # noqa: UP035  (OmegaConf reads typing.Optional, not `X | None`)

from gpg_vl.errors import UserError


@dataclass
class TrainerSettings:
    """`trainer.*`: the optimisation, the GPG objective, the update's throughput paths, checkpoints."""

    max_steps: int = 100                        # optimizer steps
    # if set, passes over the train split (at B prompts per step) replace max_steps
    epochs: float | None = None
    group_size: int = 8                         # G: completions sampled per prompt
    batch_size: int = 8                         # B: prompts per step, over all processes
    micro_batch_size: int = 16                  # sequences per forward/backward (gradient accumulation over the rest)
    # micro-batches by forward tokens, padding counted, instead (0 = by micro_batch_size)
    micro_batch_tokens: int = 8192
    lr: float = 1e-06                           # AdamW learning rate (the paper's multimodal runs)
    # any transformers scheduler name: constant, constant_with_warmup, cosine, linear
    lr_schedule: str = 'constant'
    warmup_steps: int = 0                       # warm-up steps for *_with_warmup, cosine and linear schedules
    weight_decay: float = 0.0                   # AdamW weight decay
    max_grad_norm: float = 1.0                  # gradient clipping
    # resample until this fraction of B groups has differing rewards (0 = never)
    beta_th: float = 0.4
    max_attempts: int = 8                       # most rollouts per step while resampling
    # stop after this many sampled completions, resampled ones included (ablations)
    max_completions: int | None = None
    # group_mean: r - mean(r) (GPG); std_normalized: (r - mean) / (sample std + 1e-4) (GRPO); none: r; or module:fn
    advantage: str = 'group_mean'
    # policy loss: gpg, grpo, dr_grpo, dapo, or module:fn (gpg_vl/objective.py); the algorithm=<name> presets set it
    loss: str = 'gpg'
    # mu: passes over each rollout (losses with a ratio: grpo, dr_grpo, dapo)
    ppo_epochs: int = 1
    # sequences per optimizer step, over all processes, a multiple of group_size (0 = the whole rollout)
    ppo_mini_batch: int = 0
    clip_low: float = 0.2                       # ratio clipped below at 1 - clip_low
    # ratio clipped above at 1 + clip_high (null = clip_low; DAPO's clip-higher: 0.28)
    clip_high: float | None = None
    # beta: k3 KL to the frozen reference model (loss grpo; 0 = no reference model)
    kl_coef: float = 0.0
    # options of trainer.loss by name (a loss declares them as keyword arguments; clip_low, clip_high, kl_coef
    # above and max_tokens = rollout.max_new_tokens fill those not given here)
    loss_options: dict = field(default_factory=dict)
    # DAPO's overlong shaping: a reward penalty over the last this many tokens before rollout.max_new_tokens (0 = off)
    overlong_cache: int = 0
    # the penalty at the length limit (it grows linearly over overlong_cache tokens)
    overlong_penalty: float = 1.0
    std_normalize: bool | None = None        # deprecated: trainer.advantage=std_normalized (one warning)
    baseline: str | None = None              # deprecated: trainer.advantage=group_mean or none (one warning)
    # AGE: loss = mean over valid groups (alpha = B/(B-M)); false = over all B (alpha 1)
    age: bool = True
    # or token_mean (mean over all tokens of the batch), seq_mean_token_sum (token sums over max_new_tokens: Dr. GRPO)
    aggregation: str = 'seq_mean_token_mean'
    gradient_checkpointing: bool = False        # trade compute for memory on large models
    # encode each prompt's images once per group in the update (false = once per sequence)
    share_vision: bool = True
    # run each prompt once per group in the update, completions on its cache (false = per sequence; off under
    # gradient_checkpointing, FSDP and ZeRO-3)
    share_prompt: bool = True
    # score completions through the output layer this many tokens at a time (0 = all at once)
    logits_chunk_tokens: int = 1024
    save_every: int = 0                         # write checkpoint-<step>/ every N steps (0 = only final/)
    keep_checkpoints: int = 2                   # how many checkpoint-<step>/ folders to keep
    # stop after this many steps in a row with a NaN/inf loss or gradient (0 = never)
    max_bad_steps: int = 10
    # completions of a step scored at once (threads; math checks run in child processes)
    reward_workers: int = 4
    # reward time per step; completions not scored by then score 0 (reward_timeouts; 0 = no budget)
    reward_budget_s: float = 60.0
    report_to: str = 'none'                     # none, tensorboard or wandb (through accelerate's trackers)
    # write rollouts/step-<N>.json (and send them to the tracker) every N steps and at step 1 (0 = never)
    log_rollouts_every: int = 10
    # groups (prompt, images, G completions, rewards, advantages) recorded per logged step
    log_rollouts_groups: int = 8
    eval_before: bool = True                    # evaluate the held-out split before training
    eval_after: bool = True                     # and after

    def __post_init__(self) -> None:
        from gpg_vl.objective import (
            AGGREGATIONS,
            advantage_from_deprecated,
            get_advantage,
            get_policy_loss,
            loss_aggregation,
            loss_needs,
        )

        # an unknown variant, or a contradiction between keys, fails before any work
        self.advantage = advantage_from_deprecated(self.advantage, self.baseline, self.std_normalize)
        self.baseline = self.std_normalize = None
        get_advantage(self.advantage)
        loss = get_policy_loss(self.loss)
        if self.aggregation not in AGGREGATIONS:
            raise UserError(f"unknown trainer.aggregation {self.aggregation!r}; valid options: "
                            f"{', '.join(AGGREGATIONS)}.")
        if loss_aggregation(loss, self.aggregation) != self.aggregation:
            raise UserError(f"trainer.loss={self.loss} aggregates as {loss_aggregation(loss, self.aggregation)}; set "
                            f"trainer.aggregation={loss_aggregation(loss, self.aggregation)} (algorithm={self.loss} "
                            "sets both).")
        if self.kl_coef > 0 and "ref" not in loss_needs(loss):
            raise UserError(f"trainer.kl_coef={self.kl_coef} needs a loss with a KL term; trainer.loss={self.loss} "
                            "has none: set trainer.loss=grpo or trainer.kl_coef=0.")
        if self.ppo_mini_batch % self.group_size:
            raise UserError(f"trainer.ppo_mini_batch={self.ppo_mini_batch} is not a multiple of trainer.group_size="
                            f"{self.group_size}; mini-batches hold whole groups.")
        if (self.ppo_epochs > 1 or self.ppo_mini_batch) and "old" not in loss_needs(loss):
            raise UserError(f"trainer.ppo_epochs / trainer.ppo_mini_batch take several optimizer steps per rollout, "
                            f"which needs a loss with a ratio to the rollout policy; trainer.loss={self.loss} has "
                            "none: set trainer.loss=grpo (or dr_grpo, dapo), or trainer.ppo_epochs=1 and "
                            "trainer.ppo_mini_batch=0.")

    @property
    def optimizer_steps_per_rollout(self) -> int:
        """mu x (B x G / mini-batch): the optimizer steps of a rollout whose groups are all valid."""
        sequences = self.batch_size * self.group_size
        return self.ppo_epochs * (-(-sequences // self.ppo_mini_batch) if self.ppo_mini_batch else 1)


@dataclass
class HFEngineSettings:
    """`rollout.hf.*`: the Hugging Face engine (gpg_vl/rollout/hf.py), sampling with the trained model itself."""

    # prefill each prompt once and fork its cache G ways (false = prefill all B x G rows)
    prefill_once: bool = True
    # preallocate the decoding cache (no reallocation per token; a cache that cannot be, e.g. one holding
    # linear-attention recurrent states, stays dynamic); exact, but not measured faster on CPU (README, Throughput)
    static_cache: bool = False
    # reserve the dynamic cache's room for the whole completion once (each token is written in place instead
    # of the cache being copied per token; the same attention, exact); it holds from the start the memory a
    # completion of max_new_tokens would take; static_cache takes precedence
    reserve_cache: bool = True
    # loop: gpg-vl's own decode loop over the model's forward; generate: transformers' generate
    decode: str = 'loop'


@dataclass
class VLLMEngineSettings:
    """`rollout.vllm.*`: the vLLM engine (gpg_vl/rollout/vllm.py), colocated: one engine in every training process."""

    gpu_memory_utilization: float = 0.4         # the share of GPU memory vLLM takes for weights and its KV cache
    tensor_parallel_size: int = 1               # processes that shard one engine (within the training processes)
    # free vLLM's memory while the update runs (sleep level 1, woken per rollout)
    enable_sleep_mode: bool = True
    # prompt + completion tokens vLLM plans for (null = rollout's max_prompt_tokens + max_new_tokens)
    max_model_len: int | None = None
    max_images: int = 4                         # most images in one prompt (vLLM plans its encoder memory for them)
    enforce_eager: bool = False                 # no CUDA graphs (slower decoding, faster start, less memory)
    # warn once when a step's mean |vLLM log-prob - trainer log-prob| is above this
    max_logp_mismatch: float = 0.05
    # > 0: token-level truncated importance weight min(p_trainer / p_vllm, cap) multiplies the loss (0 = off)
    tis_cap: float = 0.0
    seed: int = 0                               # vLLM's sampling seed (each process adds its rank)


ROLLOUT_ALIASES = {"prefill_once": "hf.prefill_once", "static_cache": "hf.static_cache"}  # deprecated -> new key


@dataclass
class RolloutSettings:
    """`rollout.*`: sampling the G completions of each prompt, through the engine `engine` names."""

    engine: str = 'hf'                          # hf (transformers, any device) or vllm (CUDA; pip install -e ".[vllm]")
    max_new_tokens: int = 256                   # completion length limit
    temperature: float = 1.0                    # sampling temperature (the update's log-probs use the same)
    top_p: float = 1.0                          # nucleus sampling
    ignore_eos: bool = False                    # always generate max_new_tokens (benchmarks)
    max_prompt_tokens: int = 4096               # longer prompts are skipped with a warning, never truncated
    hf: HFEngineSettings = field(default_factory=HFEngineSettings)
    vllm: VLLMEngineSettings = field(default_factory=VLLMEngineSettings)
    prefill_once: bool | None = None         # deprecated: rollout.hf.prefill_once
    static_cache: bool | None = None         # deprecated: rollout.hf.static_cache

    def __post_init__(self) -> None:
        import warnings

        if isinstance(self.hf, dict):  # RolloutSettings(**container): the sections arrive as plain dicts
            self.hf = HFEngineSettings(**self.hf)
        if isinstance(self.vllm, dict):
            self.vllm = VLLMEngineSettings(**self.vllm)
        for old, new in ROLLOUT_ALIASES.items():
            value = getattr(self, old)
            if value is not None:  # the old key still works, with one warning that names the new one
                warnings.warn(f"rollout.{old} is deprecated; set rollout.{new}={str(value).lower()} instead.",
                              FutureWarning, stacklevel=2)
                setattr(self.hf, new.split(".")[1], value)
                setattr(self, old, None)
        from gpg_vl.rollout.engine import require_engine

        require_engine(self)  # an unknown engine, or vllm without a GPU or the package: one sentence, before any model


@dataclass
class EvalSettings:
    """`eval.*`: greedy evaluation of the held-out split during training."""

    split: str | None = None                 # held-out split (null = the task's eval split)
    limit: int | None = None                 # evaluate only the first N rows
    batch_size: int = 32                        # prompts per greedy decoding batch
    max_new_tokens: int | None = None        # null = rollout.max_new_tokens
    reward_workers: int = 4                     # completions of a batch scored at once (threads)
    # reward time per decoding batch; completions not scored by then score 0 (reward_timeouts; 0 = no budget)
    reward_budget_s: float = 120.0

@dataclass
class TrainSchema:
    """configs/train.yaml as a whole: the typed sections above, and the untyped ones (a model alias, a task
    and its constructor's options, the data paths) whose keys the model and task groups declare."""

    output_dir: str = "outputs"
    seed: int = 0
    resume: str | None = None
    overwrite: bool = False
    model: Any = None
    task: Any = None
    data: Any = None
    trainer: TrainerSettings = field(default_factory=TrainerSettings)
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    eval: EvalSettings = field(default_factory=EvalSettings)


@dataclass
class EvalSchema:
    """configs/eval.yaml as a whole (the first entry of its defaults list, `eval_schema`): the evaluation's own
    keys, and rollout.* as in training (the engine that decodes; rollout.max_new_tokens when
    eval.max_new_tokens is null). A task config's trainer.* defaults are accepted and ignored."""

    output_dir: str = "outputs/eval"
    seed: int = 0
    predictions: str | None = None           # a predictions.jsonl to re-score without loading the policy model
    segmenter: str = "sam"                      # lisa's mask metrics: sam, sam2 or box
    segmenter_model: str | None = None       # null = the segmenter's default checkpoint; a hub id or a folder
    segmenter_batch_size: int = 8               # images (one box each) per segmenter forward pass
    model: Any = None
    task: Any = None
    data: Any = None
    trainer: Any = None
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    eval: EvalSettings = field(default_factory=EvalSettings)


def register_schema() -> None:
    """Register `TrainSchema` and `EvalSchema` with Hydra's ConfigStore as `train_schema` and `eval_schema`
    (idempotent)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="train_schema", node=TrainSchema)
    ConfigStore.instance().store(name="eval_schema", node=EvalSchema)
