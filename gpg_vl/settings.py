"""The training settings, declared once: these dataclasses are both the trainer's settings and the schema
that Hydra checks the composed config against (registered in its ConfigStore as `train_schema`, the first
entry of configs/train.yaml's defaults list). configs/train.yaml holds no copy of these defaults; task
configs may override them. A key that is not declared here, or a value of the wrong type, fails at
composition with one sentence naming the key, the value and the expected type (gpg_vl/config.py); values
out of range fail when the settings are built, before any model is loaded.

`python scripts/train.py --cfg job` prints every setting with its value.
"""

from dataclasses import dataclass, field
from typing import Any  # noqa: UP035  (OmegaConf reads typing.Optional, not `X | None`)

from gpg_vl.errors import UserError

# (lowest, highest, what the key means) of the settings with a range; None = unbounded on that side.
TRAINER_RANGES = {
    "max_steps": (1, None), "group_size": (1, None), "batch_size": (1, None), "micro_batch_size": (1, None),
    "micro_batch_tokens": (0, None), "lr": (0.0, None), "warmup_steps": (0, None), "weight_decay": (0.0, None),
    "max_grad_norm": (0.0, None), "beta_th": (0.0, 1.0), "max_attempts": (1, None), "logits_chunk_tokens": (0, None),
    "save_every": (0, None), "keep_checkpoints": (1, None), "max_bad_steps": (0, None),
}
ROLLOUT_RANGES = {"max_new_tokens": (1, None), "temperature": (0.0, None), "top_p": (0.0, 1.0),
                  "max_prompt_tokens": (1, None)}
VLLM_RANGES = {"gpu_memory_utilization": (0.01, 1.0), "tensor_parallel_size": (1, None), "max_images": (1, None),
               "max_logp_mismatch": (0.0, None),
               "tis_cap": (0.0, None)}


def _check_ranges(section: str, settings, ranges: dict) -> None:
    """One sentence for the first setting outside its range."""
    for key, (low, high) in ranges.items():
        value = getattr(settings, key)
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = f"between {low} and {high}" if high is not None else f"at least {low}"
            raise UserError(f"{section}.{key}={value} is out of range; it must be {bounds}.")


@dataclass
class TrainerSettings:
    """`trainer.*`: the optimisation, the GPG objective, the update's throughput paths, checkpoints."""

    max_steps: int = 100                        # optimizer steps
    epochs: float | None = None              # if set, passes over the train split (at B prompts per step) replace max_steps
    group_size: int = 8                         # G: completions sampled per prompt
    batch_size: int = 8                         # B: prompts per step, over all processes
    micro_batch_size: int = 16                  # sequences per forward/backward (gradient accumulation over the rest)
    micro_batch_tokens: int = 8192              # micro-batches by forward tokens, padding counted, instead (0 = by micro_batch_size)
    lr: float = 1e-06                           # AdamW learning rate (the paper's multimodal runs)
    lr_schedule: str = 'constant'               # any transformers scheduler name: constant, constant_with_warmup, cosine, linear
    warmup_steps: int = 0                       # warm-up steps for *_with_warmup, cosine and linear schedules
    weight_decay: float = 0.0                   # AdamW weight decay
    max_grad_norm: float = 1.0                  # gradient clipping
    beta_th: float = 0.4                        # resample until this fraction of B groups has differing rewards (0 = never)
    max_attempts: int = 8                       # most rollouts per step while resampling
    max_completions: int | None = None       # stop after this many sampled completions, resampled ones included (ablations)
    std_normalize: bool = False                 # true = GRPO-style advantage (r - mean) / (std + 1e-4), for ablations
    baseline: str = 'group_mean'                # group_mean: advantage r - mean(r) (GPG); none: the raw reward r (plain PG)
    age: bool = True                            # AGE: loss = mean over valid groups (alpha = B/(B-M)); false = over all B (alpha 1)
    aggregation: str = 'seq_mean_token_mean'    # or token_mean (mean over all tokens of the batch)
    gradient_checkpointing: bool = False        # trade compute for memory on large models
    share_vision: bool = True                   # encode each prompt's images once per group in the update (false = once per sequence)
    share_prompt: bool = True                   # run each prompt once per group in the update, completions on its cache (false = per sequence; off under gradient_checkpointing, FSDP and ZeRO-3)
    logits_chunk_tokens: int = 1024             # score completions through the output layer this many tokens at a time (0 = all at once)
    save_every: int = 0                         # write checkpoint-<step>/ every N steps (0 = only final/)
    keep_checkpoints: int = 2                   # how many checkpoint-<step>/ folders to keep
    max_bad_steps: int = 10                     # stop after this many steps in a row with a NaN/inf loss or gradient (0 = never)
    report_to: str = 'none'                     # none, tensorboard or wandb (through accelerate's trackers)
    eval_before: bool = True                    # evaluate the held-out split before training
    eval_after: bool = True                     # and after

    def __post_init__(self) -> None:
        _check_ranges("trainer", self, TRAINER_RANGES)
        from gpg_vl.objective import estimator_name

        estimator_name(self.baseline, self.std_normalize)  # an unknown variant fails before any work


@dataclass
class HFEngineSettings:
    """`rollout.hf.*`: the Hugging Face engine (gpg_vl/engines/hf.py), sampling with the trained model itself."""

    prefill_once: bool = True                   # prefill each prompt once and fork its cache G ways (false = prefill all B x G rows)
    static_cache: bool = False                  # preallocate the decoding cache (no reallocation per token)
    decode: str = 'loop'                        # loop: gpg-vl's own decode loop over the model's forward; generate: transformers' generate


@dataclass
class VLLMEngineSettings:
    """`rollout.vllm.*`: the vLLM engine (gpg_vl/engines/vllm.py), colocated: one engine in every training process."""

    gpu_memory_utilization: float = 0.4         # the share of GPU memory vLLM takes for weights and its KV cache
    tensor_parallel_size: int = 1               # processes that shard one engine (within the training processes)
    enable_sleep_mode: bool = True              # free vLLM's memory while the update runs (sleep level 1, woken per rollout)
    max_model_len: int | None = None         # prompt + completion tokens vLLM plans for (null = rollout's max_prompt_tokens + max_new_tokens)
    max_images: int = 4                         # most images in one prompt (vLLM plans its encoder memory for them)
    enforce_eager: bool = False                 # no CUDA graphs (slower decoding, faster start, less memory)
    max_logp_mismatch: float = 0.05             # warn once when a step's mean |vLLM log-prob - trainer log-prob| is above this
    tis_cap: float = 0.0                        # > 0: token-level truncated importance weight min(p_trainer / p_vllm, cap) multiplies the loss (0 = off)
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
        _check_ranges("rollout", self, ROLLOUT_RANGES)
        _check_ranges("rollout.vllm", self.vllm, VLLM_RANGES)
        from gpg_vl.engines import require_engine

        require_engine(self)  # an unknown engine, or vllm without a GPU or the package: one sentence, before any model


@dataclass
class EvalSettings:
    """`eval.*`: greedy evaluation of the held-out split during training."""

    split: str | None = None                 # held-out split (null = the task's eval split)
    limit: int | None = None                 # evaluate only the first N rows
    batch_size: int = 32                        # prompts per greedy decoding batch
    max_new_tokens: int | None = None        # null = rollout.max_new_tokens

@dataclass
class TrainSchema:
    """configs/train.yaml as a whole: the typed sections above, and the untyped ones (a model alias, a task
    and its constructor's options, the data paths) whose keys the model and task groups declare."""

    output_dir: str = "outputs"
    seed: int = 0
    resume: str | None = None
    model: Any = None
    task: Any = None
    data: Any = None
    trainer: TrainerSettings = field(default_factory=TrainerSettings)
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    eval: EvalSettings = field(default_factory=EvalSettings)


def register_schema() -> None:
    """Register `TrainSchema` with Hydra's ConfigStore as `train_schema` (idempotent)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="train_schema", node=TrainSchema)
