"""The vLLM engine, colocated: one `vllm.LLM` in every training process (`distributed_executor_backend=
"external_launcher"`, the launch's own processes), optionally tensor-parallel over groups of them.

- Prompts: the family renders the messages (the chat template writes ONE placeholder per image, before
  any processor expands it) and the tokenizer turns that text into `prompt_token_ids`; the images go
  beside them as `multi_modal_data`, as the family's processor receives them, and vLLM's own processor
  gets the family's min/max pixels. Processor-expanded ids would be expanded again (TRL #6294).
- Sampling: `n = G` per unique prompt (each image is encoded once), temperature, top_p, max tokens and
  ignore-EOS as the HF engine takes them; the family's suppressed ids (vision tokens; EOS too with
  ignore-EOS) are banned; `logprobs=0` with `logprobs_mode="processed_logprobs"` returns each sampled
  token's log-prob under the distribution it was drawn from, for the trainer's on-policy check.
- Weights: after every optimizer step `sync(model)` pushes the trainer's weights (models/weights.py:
  gathered, LoRA merged then unmerged, checkpoint names) into vLLM's model, then resets its prefix and
  multimodal caches (EasyR1 found the encoder cache leaking one entry per image per step).
- Memory: with sleep mode, vLLM sleeps (level 1: weights kept in CPU memory) while the update runs and
  wakes for the sync (weights) and the rollout (KV cache).

`vllm` is imported only when the engine is built: without a CUDA GPU or without the package,
`rollout.engine=vllm` fails in one sentence when the settings are built, before any model loads. The pure
parts (prompt building, sampling parameters, log-prob extraction) are tested on CPU with a fake LLM
(tests/integration/test_engines.py); the engine itself has not run on a GPU yet.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import Tensor

from gpg_vl.errors import UserError
from gpg_vl.rollout.engine import Correction, Engine, EnginePrompts, Sampling, register_engine
from gpg_vl.rollout.types import Rollout, completion_mask_from_eos

BANNED_BIAS = -100.0  # vLLM clamps logit biases to [-100, 100]: a banned token's probability is exp(-100) of others


# ---------------------------------------------------------------------------------------------
# pure parts (no vllm import)
# ---------------------------------------------------------------------------------------------
def prompt_requests(family, messages_batch: list[list[dict]]) -> list[dict]:
    """vLLM prompts: token ids with one placeholder per image (the rendered chat template, tokenized as
    text, never processor-expanded), and the images as the family's processor receives them."""
    requests = []
    for messages in messages_batch:
        ids = family.tokenizer(family.render(messages), add_special_tokens=False)["input_ids"]
        request = {"prompt_token_ids": list(ids)}
        images = family.engine_images(messages)
        if images:
            request["multi_modal_data"] = {"image": images}
        requests.append({**request, **video_data(family, messages, request.get("multi_modal_data", {}))})
    return requests


def video_data(family, messages: list[dict], multi_modal_data: dict) -> dict:
    """The video part of a vLLM request: each video as (frames [T, 3, h, w], metadata), the frames and metadata
    `encode` gives the trainer's processor, sampled already (`do_sample_frames=False`), as Qwen's vLLM recipe
    passes qwen-vl-utils' output. Empty for a prompt without video."""
    videos = family.engine_videos(messages)
    if not videos:
        return {}
    return {"multi_modal_data": {**multi_modal_data, "video": videos},
            "mm_processor_kwargs": {"do_sample_frames": False}}


def sampling_kwargs(family, sampling: Sampling, group_size: int) -> dict:
    """`vllm.SamplingParams` keywords for G completions per prompt, sampled as the HF engine samples."""
    banned = list(family.suppressed_ids) + (list(family.eos_ids) if sampling.ignore_eos else [])
    kwargs = {
        "n": group_size, "max_tokens": sampling.max_new_tokens, "logprobs": 0,
        "temperature": 0.0 if sampling.greedy else sampling.temperature,
        "top_p": 1.0 if sampling.greedy else sampling.top_p, "top_k": -1 if not sampling.greedy else 1,
        "ignore_eos": sampling.ignore_eos, "stop_token_ids": [] if sampling.ignore_eos else list(family.eos_ids),
        "skip_special_tokens": True, "detokenize": False,
    }
    if banned:
        kwargs["logit_bias"] = {int(token): BANNED_BIAS for token in sorted(set(banned))}
    return kwargs


def completions_from_outputs(outputs, *, group_size: int, pad_id: int) -> tuple[Tensor, Tensor]:
    """(completion ids [B * G, C], the sampler's log-prob of each sampled token [B * G, C]) from vLLM's
    RequestOutputs: B of them, G completions each; rows right-padded with pad_id (log-prob 0)."""
    rows = []
    for output in outputs:
        if len(output.outputs) != group_size:
            raise RuntimeError(f"vLLM returned {len(output.outputs)} completions for a prompt, not {group_size}")
        rows += list(output.outputs)
    width = max([len(row.token_ids) for row in rows] + [1])
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    logps = torch.zeros((len(rows), width), dtype=torch.float32)
    for n, row in enumerate(rows):
        tokens = list(row.token_ids)
        ids[n, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        for t, (token, entry) in enumerate(zip(tokens, row.logprobs or [], strict=False)):
            logps[n, t] = entry[token].logprob  # logprobs=0: the sampled token's own entry
    return ids, logps


def engine_options(rollout, *, model_path: str, family, dtype: torch.dtype, seed: int) -> dict:
    """`vllm.LLM` keywords for a colocated engine in one training process."""
    settings = rollout.vllm
    return {
        "model": model_path, "tokenizer": model_path, "load_format": "dummy",  # weights come from sync()
        "distributed_executor_backend": "external_launcher", "tensor_parallel_size": settings.tensor_parallel_size,
        "gpu_memory_utilization": settings.gpu_memory_utilization, "enable_sleep_mode": settings.enable_sleep_mode,
        "max_model_len": settings.max_model_len or rollout.max_prompt_tokens + rollout.max_new_tokens,
        "enforce_eager": settings.enforce_eager, "dtype": str(dtype).removeprefix("torch."), "seed": seed,
        "logprobs_mode": "processed_logprobs", "limit_mm_per_prompt": {"image": settings.max_images},
        "mm_processor_kwargs": family.engine_processor_kwargs() or None,
    }


def missing(cuda: bool, installed: bool) -> str | None:
    """One sentence for what `rollout.engine=vllm` lacks here (None when it can run)."""
    if not cuda:
        return ("rollout.engine=vllm needs a CUDA GPU and none is visible here; run on a GPU machine "
                "(pip install -e \".[vllm]\") or use rollout.engine=hf.")
    if not installed:
        return ("rollout.engine=vllm needs the vllm package, which is not installed; run pip install -e \".[vllm]\" "
                "(vLLM 0.33, CUDA) or use rollout.engine=hf.")
    return None


# ---------------------------------------------------------------------------------------------
# the engine
# ---------------------------------------------------------------------------------------------
@register_engine
class VLLMEngine(Engine):
    """A colocated vLLM engine with its own copy of the weights, synced after every optimizer step."""

    name = "vllm"
    returns_logps = True

    @classmethod
    def unavailable(cls, rollout) -> str | None:
        if rollout.engine != cls.name:
            return None
        return missing(torch.cuda.is_available(), importlib.util.find_spec("vllm") is not None)

    def __init__(self, policy, rollout, *, accelerator=None, llm=None, sampling_params=None) -> None:
        """`llm` / `sampling_params`: a vllm.LLM and vllm.SamplingParams stand-in (tests); else vLLM's own."""
        self.policy, self.family, self.settings = policy, policy.adapter, rollout.vllm
        rank = accelerator.process_index if accelerator is not None else 0
        world = accelerator.num_processes if accelerator is not None else 1
        tp = self.settings.tensor_parallel_size
        if world % tp:
            raise UserError(f"rollout.vllm.tensor_parallel_size={tp} does not divide the {world} training processes; "
                            "set it to a divisor of the process count.")
        self.tp_group = None
        if tp > 1:  # each group of tp processes shares one engine: prompts gathered in, completions sliced out
            self.tp_group, _ = torch.distributed.new_subgroups(group_size=tp)
        if llm is None:
            from vllm import LLM, SamplingParams

            sampling_params = SamplingParams
            dtype = next(policy.model.parameters()).dtype
            llm = LLM(**engine_options(rollout, model_path=str(policy.name_or_path), family=self.family,
                                       dtype=dtype, seed=self.settings.seed + rank // tp))
        self.llm, self.sampling_params = llm, sampling_params
        self.asleep, self.weights_awake = False, False
        self.sync(policy.model)  # load_format="dummy": the trainer's weights, whatever their source

    # ---- the on-policy check --------------------------------------------------------------------
    @property
    def correction(self) -> Correction:
        return Correction(sampler_check=True, tis_cap=self.settings.tis_cap)

    def mismatch_warning(self, metrics: dict) -> str | None:
        limit = self.settings.max_logp_mismatch
        if metrics.get("logp_mismatch_mean", 0.0) > limit:
            return (f"the sampler's log-probs differ from the trainer's by {metrics['logp_mismatch_mean']:.4f} per "
                    f"token on average, over rollout.vllm.max_logp_mismatch={limit}: the rollout is off-policy; "
                    "check the weight sync and dtype, or set rollout.vllm.tis_cap=2.")
        return None

    # ---- rollout -------------------------------------------------------------------------------
    def generate(self, prompts: EnginePrompts, group_size: int, sampling: Sampling) -> Rollout:
        if prompts.messages is None:
            raise ValueError("the vLLM engine renders prompts from their messages; EnginePrompts.messages is None")
        requests = prompt_requests(self.family, prompts.messages)
        share = len(requests)
        if self.tp_group is not None:
            gathered = [None] * torch.distributed.get_world_size(self.tp_group)
            torch.distributed.all_gather_object(gathered, requests, group=self.tp_group)
            offset = sum(len(g) for g in gathered[:torch.distributed.get_rank(self.tp_group)])
            requests = [r for g in gathered for r in g]
        self.wake()
        params = self.sampling_params(**sampling_kwargs(self.family, sampling, group_size))
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        self.sleep()
        if self.tp_group is not None:
            outputs = outputs[offset:offset + share]
        ids, logps = completions_from_outputs(outputs, group_size=group_size, pad_id=self.family.pad_id)
        mask = completion_mask_from_eos(ids, self.family.eos_ids, ignore_eos=sampling.ignore_eos)  # [B * G, C]
        ids = ids.masked_fill(~mask, self.family.pad_id)
        logps = logps.masked_fill(~mask, 0.0)
        texts = self.family.tokenizer.batch_decode(ids, skip_special_tokens=True)
        device = self.policy.model.device
        return Rollout(completion_ids=ids.to(device), completion_mask=mask.to(device), texts=texts,
                       group_size=group_size, sampler_logps=logps.to(device))

    # ---- weights and memory ----------------------------------------------------------------------
    def sync(self, model) -> None:
        """Push the trainer's weights into vLLM's model, then drop every cache computed with the old ones."""
        from gpg_vl.models.weights import engine_weights, merged_lora

        if self.asleep and not self.weights_awake:
            self.llm.wake_up(tags=["weights"])
            self.weights_awake = True
        runner_model = _vllm_model(self.llm)
        with torch.no_grad(), merged_lora(model):
            runner_model.load_weights(engine_weights(model, self.family))
        for reset in ("reset_prefix_cache", "reset_mm_cache", "reset_encoder_cache"):  # those this vLLM has
            if callable(getattr(self.llm, reset, None)):
                getattr(self.llm, reset)()

    def sleep(self) -> None:
        if self.settings.enable_sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep, self.weights_awake = True, False

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"]) if self.weights_awake else self.llm.wake_up()
            self.asleep, self.weights_awake = False, False


def _vllm_model(llm):
    """The torch model inside a colocated (external_launcher) vLLM engine: V1's worker, or V0's runner."""
    worker = llm.llm_engine.model_executor.driver_worker
    worker = getattr(worker, "worker", worker)
    return worker.model_runner.model
