"""Compute each prompt once per group, in both phases, and score completions without full-vocabulary logits.

A GPG step samples G completions of the same prompt (images included), then scores them. Peers repeat
the prompt G times in both phases. Here:

- rollout (gpg_vl/models/cache.py's `prefill_once`): the B distinct prompts are prefilled once (each image through
  the vision tower once, each prompt token through the language model once) and the cache is forked G ways by the
  family (`Family.fork_cache`: key/value layers and linear-attention states alike) before `generate`
  samples the completions;
- update (`prompt_once_hidden`): each distinct prompt runs forward once, with gradient; its cache is
  forked to its G sequences, and the completions run on top of it with explicit positions continuing
  the prompt's (the family's own rule, 1-D or multimodal). The gradient reaches the prompt's forward
  through the cache;
- scoring (`completion_logps`): the hidden states that predict completion tokens go through the output
  layer a chunk of tokens at a time, and the backward pass recomputes each chunk's logits, so fp32
  full-vocabulary logits are never held for all tokens at once.

The update scores through one function, `token_logps(family, model, ..., path=...)` (`token_logps_and_entropy`: the
same, with each position's entropy from the same logits), whose `ScoringPath` is
chosen once per run at setup (`choose_scoring_path`: packed, prompt-once, shared vision, or plain) and is required
afterwards; everything that depends on that choice (the forward, the micro-batch cost) reads the same path.
Calls go one way: the update calls scoring, and scoring asks the family's small protocol methods (`position_ids`,
`fork_cache`, `vision_features`, `logps_from_logits`, ...); the family never calls back into scoring.

Every function here gives, up to floating-point rounding, what the plain full-sequence forward gives;
tests/integration/test_fast_paths.py checks values, gradients and greedy tokens. Nothing here names a model family:
what differs between families is asked of the family (gpg_vl/models/family.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

import gpg_vl.distributed as distributed  # module access: tests replace forward_is_collective
from gpg_vl.errors import UserError
from gpg_vl.models.batch import COUNT_KEYS, PromptBatch, extend_per_token, per_token_keys, trim_left_padding, unwrap
from gpg_vl.models.cache import cache_keyword, cache_of
from gpg_vl.models.logits import completion_logps, logits_entropy
from gpg_vl.models.packing import pack_layout, pack_tokens, packed_segments, unpack_scored
from gpg_vl.models.router import weigh_router_tokens


# ---------------------------------------------------------------------------------------------
# the scoring path, chosen once per run
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ScoringPath:
    """How the update scores sequences. `prompt_once`: each distinct prompt runs once, its G completions on
    its forked cache; `shared_vision`: every sequence runs whole, its images encoded once per group;
    `wrapped`: the forward goes through the wrapper (FSDP / ZeRO-3 gather weights there), whole sequences."""

    prompt_once: bool = False
    shared_vision: bool = False
    wrapped: bool = False
    packed: bool = False  # one padding-free row per micro-batch (models/packing.py), prompts once with prompt_once
    # packed only where padding would add at least this share of the real tokens (trainer.packing=auto)
    min_padding: float = 0.0

    def describe(self) -> str:
        if self.packed:
            how = "each prompt once per group" if self.prompt_once else "each sequence whole"
            when = f", where padding would add {self.min_padding:.0%} or more" if self.min_padding else ""
            return f"packed (padding-free, one row per micro-batch{when}, {how})"
        if self.prompt_once:
            return "prompt-once (each prompt runs once per group, completions on its forked cache)"
        how = "through the wrapped model" if self.wrapped else "on the bare model"
        vision = "images encoded once per group" if self.shared_vision else "images encoded per sequence"
        return f"whole sequences {how}, {vision}"


def checkpointing(model: torch.nn.Module) -> bool:
    """Whether activation (gradient) checkpointing is on: it drops the key/value cache in training forwards."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # transformers >= 5.x name first
        if name in dir(type(model)):
            return bool(getattr(model, name))
    return False


PACKING_MODES = ("auto", "on", "off")
# trainer.packing=auto packs a micro-batch when padding would add at least this share of its real tokens: with
# none (equal lengths) the packed row is no faster than the padded forward (docs/results/throughput.md)
AUTO_MIN_PADDING = 0.1


def choose_scoring_path(family, model: torch.nn.Module, *, share_prompt: bool, share_vision: bool,
                        packing: str = "off", warn=None) -> ScoringPath:
    """The scoring path of a run: the fastest the settings allow that is exact for this family and engine.

    Prompt-once needs a cache in the training forward (no gradient checkpointing), the bare model's parts
    (not FSDP / ZeRO-3) and a family that forks its cache exactly; otherwise it steps aside, with one
    warning when the family is the reason. Shared vision needs a family whose model takes image features back.
    Packing (`packing` auto or on: models/packing.py) needs the bare model's parts, no gradient checkpointing
    (its recomputation would run outside the packed attention) and a family whose layers are all full
    attention (`Family.packing_unsupported`); `on` fails in one sentence where it cannot pack, `auto` steps aside,
    and packs only the micro-batches with padding to remove (`AUTO_MIN_PADDING`: train/step/micro_batch.py's
    `forward_cost`).
    """
    wrapped = distributed.forward_is_collective(model)
    bare = unwrap(model)
    prompt_once = share_prompt and not wrapped and not checkpointing(bare)
    reason = family.prompt_once_unsupported(bare) if prompt_once else None
    if reason:
        if warn is not None:
            warn(f"trainer.share_prompt=true steps aside for this model: {reason}; each sequence runs whole (same "
                 "result, more compute).")
        prompt_once = False
    shared = share_vision and family.shares_vision(bare)
    return ScoringPath(prompt_once=prompt_once, shared_vision=shared, wrapped=wrapped,
                       packed=_packs(family, bare, packing, wrapped),
                       min_padding=AUTO_MIN_PADDING if packing == "auto" else 0.0)


def _packs(family, bare: torch.nn.Module, packing: str, wrapped: bool) -> bool:
    """Whether the update packs (trainer.packing): see `choose_scoring_path`."""
    if packing not in PACKING_MODES:
        raise UserError(f"unknown trainer.packing {packing!r}; use one of {', '.join(PACKING_MODES)}.")
    if packing == "off":
        return False
    reason = ("the model's forward goes through FSDP / ZeRO-3" if wrapped else
              "gradient checkpointing recomputes the forward outside the packed attention" if checkpointing(bare)
              else family.packing_unsupported(bare))
    if reason and packing == "on":
        raise UserError(f"trainer.packing=on cannot pack this model: {reason}; set trainer.packing=auto (packs "
                        "where it can) or off.")
    return reason is None


SHARED_VISION = "gpg_shared_vision"  # model(..., gpg_shared_vision=(prompts, prompt_index)): see below


# ---------------------------------------------------------------------------------------------
# the one scoring function
# ---------------------------------------------------------------------------------------------
def token_logps(family, model, prompts: PromptBatch, prompt_index: list[int], completion_ids: Tensor,
                completion_mask: Tensor, *, path: ScoringPath, observations: list | None = None,
                temperature: float = 1.0, logits_chunk_tokens: int = 0) -> Tensor:
    """Log-probs [N, C] of `completion_ids` [N, C] under `model`; sequence n continues prompt `prompt_index[n]`.

    `path` (the run's, from `choose_scoring_path`) says how: packed runs the micro-batch as one padding-free row,
    each prompt once per group with prompt-once (`packed_hidden`); prompt-once runs each distinct prompt once, with
    gradient, its G sequences' completions on its forked cache (`prompt_once_hidden`); otherwise every sequence
    runs prompt + completion, and with shared vision each distinct prompt's images go through the vision tower
    once (with gradient), the G sequences reusing those features. `observations[n]` (multi-turn trajectories,
    rollout/multiturn/trajectory.py) puts trajectory n's observations (token types and images) in its forward on every
    path; `completion_mask` then covers every token of a trajectory (the loss mask is the caller's). Logits are
    computed for completion positions only; with `logits_chunk_tokens` > 0 that many tokens at a time, forward
    and backward. Suppressed tokens get -inf before the softmax, exactly as in sampling. The fast paths call the
    bare model's parts (the trainer averages gradients itself); under FSDP and ZeRO-3 the wrapped model runs
    whole sequences (images still encoded once per group, inside its forward) and full completion logits are
    computed. `token_logps_and_entropy` gives each position's entropy too, from the same logits. The model is
    unwrapped once per forward, here, and its bare parts passed down.
    """
    bare = unwrap(model)
    states = completion_states(family, model, prompts, prompt_index, completion_ids, completion_mask, path=path,
                               observations=observations, chunked=logits_chunk_tokens > 0, bare=bare)
    return _scores(family, bare, states, completion_ids, completion_mask, temperature=temperature,
                   logits_chunk_tokens=logits_chunk_tokens, entropy=False)


def token_logps_and_entropy(family, model, prompts: PromptBatch, prompt_index: list[int], completion_ids: Tensor,
                            completion_mask: Tensor, *, path: ScoringPath, observations: list | None = None,
                            temperature: float = 1.0, logits_chunk_tokens: int = 0) -> tuple[Tensor, Tensor]:
    """`token_logps`, and each position's entropy [N, C] (0 off `completion_mask`, no gradient) of the same sampling
    distribution, from the logits it computes anyway (chunk by chunk with `logits_chunk_tokens`): no extra forward."""
    bare = unwrap(model)
    states = completion_states(family, model, prompts, prompt_index, completion_ids, completion_mask, path=path,
                               observations=observations, chunked=logits_chunk_tokens > 0, bare=bare)
    return _scores(family, bare, states, completion_ids, completion_mask, temperature=temperature,
                   logits_chunk_tokens=logits_chunk_tokens, entropy=True)


def _scores(family, bare, states: tuple[Tensor | None, Tensor | None], completion_ids: Tensor,
            completion_mask: Tensor, *, temperature: float, logits_chunk_tokens: int, entropy: bool):
    """Log-probs [N, C] (with `entropy`, and entropies [N, C]) from `completion_states`' hidden states or logits;
    `bare`: the bare model (its output layer)."""
    hidden, logits = states
    if hidden is not None:
        return _hidden_logps(family, bare, hidden, completion_ids, completion_mask, temperature=temperature,
                             chunk_tokens=logits_chunk_tokens or hidden.shape[0] * hidden.shape[1], entropy=entropy)
    logps = family.logps_from_logits(logits, completion_ids, temperature=temperature)
    if not entropy:
        return logps
    with torch.no_grad():
        suppressed = logits.index_fill(-1, torch.tensor(family.suppressed_ids or [], dtype=torch.long,
                                                        device=logits.device), float("-inf"))
        return logps, logits_entropy(suppressed / temperature) * completion_mask.to(logps.dtype)


def completion_states(family, model, prompts: PromptBatch, prompt_index: list[int], completion_ids: Tensor,
                      completion_mask: Tensor, *, path: ScoringPath, observations: list | None = None,
                      chunked: bool = True, bare=None) -> tuple[Tensor | None, Tensor | None]:
    """(final hidden states [N, C, H], None), or where the path computes them whole (wrapped, or not `chunked` on
    the plain path) (None, logits [N, C, V] in float32): the states that predict each completion token, from one
    forward on `path` (see `token_logps`). `bare`: `model` unwrapped, where the caller has it."""
    bare = unwrap(model) if bare is None else bare
    chunked = chunked and not path.wrapped
    if path.packed:
        return packed_hidden(family, bare, prompts, prompt_index, completion_ids, completion_mask, observations,
                             prompt_once=path.prompt_once, shared_vision=path.shared_vision), None  # [N, C, H]
    if path.prompt_once:
        return prompt_once_hidden(family, bare, prompts, prompt_index, completion_ids, completion_mask,
                                  observations), None  # [N, C, H]
    shared = path.shared_vision and (prompts.has_images or prompts.has_videos) and observations is None
    sequences = trim_left_padding(prompts.select(prompt_index, drop=family.pixel_keys if shared else ()).inputs)
    if observations is None:
        full = extend_per_token(sequences, completion_ids, completion_mask)  # [N, P + C] per-token keys
    else:  # multi-turn: the observations' token types and images inside the completions
        full = with_observations(prompts, prompt_index, sequences, completion_ids, completion_mask, observations)
    if shared and path.wrapped:  # encoded inside the wrapped model's forward, see encode_shared_vision_in_forward
        encode_shared_vision_in_forward(model, family, bare)
        full[SHARED_VISION] = (prompts, prompt_index)
    elif shared:
        full["mm_encoder_outputs"] = family.vision_features(bare, prompts, prompt_index)
    positions = family.position_ids(bare, full)
    if positions is not None:
        full["position_ids"] = positions
    completion_length = completion_ids.shape[1]
    # the router loss's tokens, as on the prompt-once path: not the padding, not the last completion column
    mask = full["attention_mask"]
    weigh_router_tokens(bare, lambda: torch.cat([mask[:, :-1], mask[:, -1:] * 0], dim=1))
    if chunked:  # hidden states only; the output layer runs chunk by chunk
        return bare.model(**full, use_cache=False).last_hidden_state[:, -completion_length - 1:-1], None  # [N, C, H]
    outputs = (model if path.wrapped else bare)(**full, use_cache=False, logits_to_keep=completion_length + 1)
    return None, outputs.logits[:, :-1].float()  # [N, C, V]


def _hidden_logps(family, bare, hidden: Tensor, completion_ids: Tensor, completion_mask: Tensor, *,
                  temperature: float, chunk_tokens: int, entropy: bool = False):
    """Log-probs [N, C] from the final hidden states [N, C, H] through the output layer, in token chunks (with
    `entropy`, and the entropies [N, C])."""
    return completion_logps(hidden, bare.get_output_embeddings().weight, completion_ids, completion_mask.bool(),
                            suppressed_ids=family.suppressed_ids, temperature=temperature, chunk_tokens=chunk_tokens,
                            softcap=family.logit_softcap(bare), entropy=entropy)


def encode_shared_vision_in_forward(model: torch.nn.Module, family, bare: torch.nn.Module) -> None:
    """Let `model(...)` take `gpg_shared_vision=(prompts, prompt_index)` and encode those images itself.

    The shared vision features must be computed INSIDE the forward of whatever wraps the model
    (DDP, FSDP, DeepSpeed): FSDP all-gathers the root's parameters (the vision tower's patch embedding
    and merger among them) in its forward pre-hook, so encoding before calling the wrapper reads
    sharded weights; DDP prepares its gradient reducer in its forward. A forward pre-hook on the bare
    model runs inside the wrapper's forward and after FSDP's own pre-hook (FSDP prepends its hook).
    Under PEFT the bare model may be reached through its `forward` (PeftModelForCausalLM -> LoRA tuner ->
    `model.forward`), where no hook runs, or through its `__call__` (PeftModel): the hook goes on the tuner
    and on the bare model, and whichever runs first takes the keyword. Registered once per module; without
    the keyword the model behaves exactly as before.
    """
    inner = getattr(model, "module", model)  # `bare`: `model` unwrapped (`unwrap`)
    modules = [bare]
    if callable(getattr(inner, "get_base_model", None)):  # PEFT
        modules.insert(0, inner.base_model)

    def encode(_, args, kwargs):
        request = kwargs.pop(SHARED_VISION, None)
        if request is not None:
            kwargs["mm_encoder_outputs"] = family.vision_features(bare, *request)
        return args, kwargs

    for module in modules:
        if getattr(module, "_gpg_shared_vision_hook", None) is None:
            module._gpg_shared_vision_hook = module.register_forward_pre_hook(encode, with_kwargs=True)


# ---------------------------------------------------------------------------------------------
# multi-turn completions: observations (their token types and images) inside the completion
# ---------------------------------------------------------------------------------------------
def with_observations(prompts: PromptBatch, prompt_index: list[int], sequences: dict[str, Tensor],
                      completion_ids: Tensor, completion_mask: Tensor, observations: list) -> dict[str, Tensor]:
    """Full inputs [N, P + C]: `sequences` (the selected prompts [N, P]) followed by completions that hold
    observations. `observations[n]` is trajectory n (rollout/multiturn/trajectory.py: `observations`, the [start, end)
    of each observation in the completion, and `observation_inputs`, its processor outputs). Per-token keys
    (token types) take each observation's values; image keys list, per sequence in order, its prompt's
    images and then its observations' (the order in which the model meets their placeholders)."""
    full = extend_per_token(sequences, completion_ids, completion_mask)
    width = sequences["input_ids"].shape[1]
    token_keys = set(per_token_keys(full))
    for key in token_keys - {"input_ids", "attention_mask"}:
        for n, trajectory in enumerate(observations):
            for (start, end), extra in zip(trajectory.observations, trajectory.observation_inputs, strict=True):
                if key in extra:
                    full[key][n, width + start:width + end] = extra[key][0].to(full[key].device)
    # every key that is not per token: the prompt's image inputs (in `prompts.rows`, or one row per prompt when
    # each prompt has one image, e.g. GLM-4.1V's image_grid_thw)
    image_keys = [key for key in prompts.inputs if key not in token_keys]
    for trajectory in observations:
        for (start, end), extra in zip(trajectory.observations, trajectory.observation_inputs, strict=True):
            image_keys += [key for key, value in extra.items() if key not in image_keys and key not in token_keys
                           and tuple(value.shape) != (1, end - start)]
    for key in image_keys:
        parts = []
        for n, trajectory in enumerate(observations):
            if key in prompts.inputs:
                parts.append(prompts.select([prompt_index[n]]).inputs[key])
            parts += [extra[key] for extra in trajectory.observation_inputs if key in extra]
        device = sequences["input_ids"].device
        if key in COUNT_KEYS:  # images per sequence: the prompt's plus its observations'
            parts = [sum(p.to(device) for p in [prompts.select([prompt_index[n]]).inputs[key]] + [
                extra[key] for extra in trajectory.observation_inputs if key in extra])
                for n, trajectory in enumerate(observations)]
        full[key] = torch.cat([part.to(device) for part in parts], dim=0)
    return full


def observation_images(observations: list, device) -> dict[str, Tensor]:
    """The observations' image inputs of N trajectories, in sequence order (for a forward of completions only);
    keys that hold one value per completion token are left out."""
    images: dict[str, list[Tensor]] = {}
    for trajectory in observations:
        for (start, end), extra in zip(trajectory.observations, trajectory.observation_inputs, strict=True):
            for key, value in extra.items():
                if tuple(value.shape) != (1, end - start):
                    images.setdefault(key, []).append(value.to(device))
    return {key: torch.cat(values, dim=0) for key, values in images.items()}


# ---------------------------------------------------------------------------------------------
# update: the prompt once per group, the G completions on its cache
# ---------------------------------------------------------------------------------------------
def prompt_once_hidden(family, bare, prompts: PromptBatch, prompt_index: list[int], completion_ids: Tensor,
                       completion_mask: Tensor, observations: list | None = None) -> Tensor:
    """Final hidden states [N, C, H]; row n, column t is the state that predicts completion_ids[n, t].

    Each distinct prompt of `prompt_index` runs forward once (its images through the vision tower
    once) with gradient; its cache is indexed out to the sequences that continue it, and the
    completions (all but their last token, which predicts nothing) run on that cache. Column 0 is the
    prompt's last state (left padding puts every prompt's last token in the last column). With
    `observations` (multi-turn trajectories), the completions carry their observations' token types and
    images, and the positions come from the family's rule over each whole interleaved sequence. `bare`: the bare
    model (`unwrap`), whose parts run.
    """
    distinct = sorted(set(prompt_index))
    row_of = {prompt: row for row, prompt in enumerate(distinct)}
    expand = torch.tensor([row_of[p] for p in prompt_index], device=completion_ids.device)  # [N]
    inputs = trim_left_padding(prompts.select(distinct).inputs)
    prompt_ids, prompt_mask = inputs["input_ids"], inputs["attention_mask"]  # [B, P]
    width, length = prompt_ids.shape[1], completion_ids.shape[1]
    # positions of prompt + completion, from the family's rule on the full sequence
    completion_extra = {}
    if observations is None:
        filler = prompt_ids.new_full((len(distinct), length), family.pad_id)
        full = extend_per_token(inputs, filler, prompt_mask.new_ones(len(distinct), length))
        positions = family.position_ids(bare, full)  # [..., B, P + C]: [B, L], or [3, B, L] multimodal
        completion_positions = positions.index_select(-2, expand)[..., width:width + length - 1]
    else:  # each sequence's own observations decide its positions after the prompt
        sequences = {key: inputs[key][expand] for key in per_token_keys(inputs)}  # [N, P] each
        full = with_observations(prompts, prompt_index, sequences, completion_ids, completion_mask, observations)
        every = family.position_ids(bare, full)  # [..., N, P + C]
        first = [prompt_index.index(p) for p in distinct]
        positions = every.index_select(-2, torch.tensor(first, device=every.device))
        completion_positions = every[..., width:width + length - 1]
        completion_extra = {key: full[key][:, width:width + length - 1] for key in per_token_keys(full)
                            if key not in ("input_ids", "attention_mask")}
        completion_extra.update(observation_images(observations, completion_ids.device))
    # the router loss counts a prompt token once per sequence that continues it, as the plain path does
    weigh_router_tokens(bare, lambda: prompt_mask * torch.bincount(expand, minlength=len(distinct))[:, None])
    prompt_out = bare.model(**inputs, position_ids=positions[..., :width], use_cache=True)
    last = prompt_out.last_hidden_state[:, -1][expand].unsqueeze(1)  # [N, 1, H]
    if length == 1:
        return last
    cache = family.fork_cache(bare, cache_of(prompt_out), expand)  # [N, ...] per layer, still in the graph
    mask = torch.cat([prompt_mask[expand], completion_mask[:, :-1].to(prompt_mask.dtype)], dim=1)  # [N, P + C - 1]
    weigh_router_tokens(bare, lambda: completion_mask[:, :-1])
    completion_out = bare.model(input_ids=completion_ids[:, :-1], attention_mask=mask,
                                position_ids=completion_positions, use_cache=True,
                                **{cache_keyword(bare.model): cache}, **completion_extra)
    return torch.cat([last, completion_out.last_hidden_state], dim=1)  # [N, C, H]


# ---------------------------------------------------------------------------------------------
# update, packed: a micro-batch as one padding-free row, each prompt once per group
# ---------------------------------------------------------------------------------------------
def packed_hidden(family, bare, prompts, prompt_index: list[int], completion_ids: Tensor, completion_mask: Tensor,
                  observations: list | None = None, *, prompt_once: bool, shared_vision: bool) -> Tensor:
    """Final hidden states [N, C, H] (row n, column t predicts completion_ids[n, t]) from one packed forward
    (models/packing.py: each prompt once per group with `prompt_once`, no padding, attention never across
    sequences).

    The padded batch the other paths run (prompts selected per sequence, completions and their
    observations appended) gives each token its positions (`family.position_ids`) and token types; the
    packed row takes its real tokens (`pack_layout`), each prompt once per group with `prompt_once`, and
    the images in the order the row meets their placeholders (`row_images`). `bare`: the bare model (`unwrap`).
    """
    sequences = trim_left_padding(prompts.select(prompt_index).inputs)  # per-token keys [N, P]
    if observations is None:
        full = extend_per_token(sequences, completion_ids, completion_mask)  # [N, L] per-token keys
    else:
        full = with_observations(prompts, prompt_index, sequences, completion_ids, completion_mask, observations)
    positions = family.position_ids(bare, full)  # [..., N, L]
    if positions is None:
        positions = (full["attention_mask"].long().cumsum(-1) - 1).clamp(min=0)  # [N, L]
    layout = pack_layout(sequences["attention_mask"], prompt_index, completion_mask, prompt_once=prompt_once)
    token_keys = per_token_keys(full)
    inputs = {key: pack_tokens(full[key], layout) for key in token_keys if key != "attention_mask"}  # [1, T]
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    images = row_images(prompts, layout.groups, full, token_keys, observations, prompt_once=prompt_once)
    if shared_vision and observations is None and (prompts.has_images or prompts.has_videos):
        # the towers' outputs per prompt of the row, encoded as the padded path encodes them (a model that reads
        # a row's several images differently, LLaVA-OneVision's tiles, sees each prompt's own)
        images = {key: value for key, value in images.items() if key not in family.pixel_keys}
        images["mm_encoder_outputs"] = family.vision_features(bare, prompts, [p for p, _ in layout.groups])
    inputs.update(images)
    weigh_router_tokens(bare, lambda: layout.router_weight[None])
    with packed_segments(bare.get_decoder().config, layout.segments):
        out = bare.model(**inputs, position_ids=pack_tokens(positions, layout), use_cache=False)
    return unpack_scored(out.last_hidden_state, layout, tuple(completion_ids.shape))  # [N, C, H]


def row_images(prompts, groups: tuple, full: dict[str, Tensor], token_keys: list[str], observations: list | None,
               *, prompt_once: bool) -> dict[str, Tensor]:
    """The image inputs (every key that is not per token) of the packed row, in the order it meets their
    placeholders: per sequence as `full` holds them, or with `prompt_once` each group's prompt images once,
    then its sequences' observations' images. Counts per sequence (`COUNT_KEYS`) become the row's total."""
    keys = [key for key in full if key not in token_keys]
    if not prompt_once:
        images = {key: full[key] for key in keys}
    else:
        images = {}
        for key in keys:
            parts = []
            for prompt, members in groups:
                if key in prompts.inputs:
                    parts.append(prompts.select([prompt]).inputs[key])
                for n in members if observations is not None else ():
                    parts += [extra[key] for extra in observations[n].observation_inputs if key in extra]
            images[key] = torch.cat([part.to(full["input_ids"].device) for part in parts], dim=0)
    for key in COUNT_KEYS:
        if key in images:
            images[key] = images[key].sum(dim=0, keepdim=True)
    return images
