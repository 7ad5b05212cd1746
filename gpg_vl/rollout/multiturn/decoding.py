"""Multi-turn rollouts on the HF engine: B x G trajectories decoded together, tools answered between segments.

Each prompt is prefilled once and its cache forked G ways (as a single turn is). Then, turn by turn:

- segment: the rows still going decode one token at a time on one batched cache; a row's segment ends at an
  end-of-sequence token, at a stop string of its family (`</tool_call>`), at `max_new_tokens`, or at the
  trajectory's token limit. A row whose segment has ended is fed nothing more: its later columns are masked
  out (attention 0), so its cache holds exactly its own tokens;
- tools: a segment that ends in a tool call (only its last call runs) gets its observation (the tool's text
  and images, or an error sentence), rendered and encoded by the family; a segment without a call, or a
  limit (turns, images, tokens), ends the trajectory, and finished trajectories leave the batch;
- observation (`incremental`, the default): the segment's last token and the observation's tokens (their
  images through the vision tower) are prefilled onto each continuing row's cache, ragged rows padded with
  masked columns, positions from the family's rule over the row's whole interleaved sequence; the
  conversation is never prefilled again. `naive` re-prefills every continuing row's whole conversation
  instead (for the bench). Models with linear-attention layers (a hybrid family) take `naive`: their recurrent
  states cannot step over a masked column.

The log-prob of every generated token under the sampling distribution (suppressed ids removed, the
temperature applied, as the update computes it) is kept in `Trajectory.logps`.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor

from gpg_vl.errors import UserError
from gpg_vl.models.batch import eval_mode, extend_per_token, trim_left_padding, unwrap
from gpg_vl.models.cache import cache_keyword, cache_of, prefill_forked
from gpg_vl.rollout.engine import EnginePrompts, Sampling
from gpg_vl.rollout.multiturn.tools import ToolContext, ToolResult, answer_call, read_call, with_tool_stops
from gpg_vl.rollout.multiturn.trajectory import (
    MultiTurnSettings,
    ToolCallRecord,
    Trajectory,
    pad_trajectories,
    sequence_inputs,
)
from gpg_vl.rollout.sampling import next_tokens
from gpg_vl.rollout.types import Rollout

STOP_WINDOW = 32  # tokens of a segment's tail decoded to look for a stop string


@dataclass
class _Row:
    """One trajectory while it is decoded."""

    prompt: int  # its prompt's index
    prompt_inputs: dict[str, Tensor]  # that prompt's inputs [1, P], left padding trimmed
    trajectory: Trajectory
    context: ToolContext
    positions: Tensor  # [..., 1, L] positions of its whole sequence so far plus room for one more segment
    fed: int  # tokens of its sequence (prompt + trajectory) already in the cache
    pending: int | None = None  # the segment's last token, not yet in the cache
    segment: list[int] | None = None
    ended_by: str = ""  # eos, stop, length, total


def incremental_unsupported(model: torch.nn.Module) -> str | None:
    """Why observations cannot be prefilled onto this model's batched cache (None when they can)."""
    text = getattr(unwrap(model).config, "text_config", unwrap(model).config)
    if "linear_attention" in (getattr(text, "layer_types", None) or []):
        return "its linear-attention states cannot step over the masked columns of rows that took other turns"
    return None


def require_multi_turn(family, model, settings: MultiTurnSettings) -> None:
    """One sentence when this model cannot run rollout.max_turns > 1 on the HF engine."""
    reason = family.multi_turn_unsupported() or family.prefill_once_unsupported(unwrap(model))
    if reason is not None:
        raise UserError(f"rollout.max_turns={settings.max_turns} cannot run on this model: {reason}; set "
                        "rollout.max_turns=1.")


@torch.no_grad()
def generate_trajectories(policy, prompts: EnginePrompts, *, group_size: int, sampling: Sampling,
                          settings: MultiTurnSettings, tools: tuple[str, ...] | None = None,
                          scripted: Callable[[int, int], list[int] | None] | None = None) -> Rollout:
    """B x G trajectories (row b * G + g continues prompt b), as the module's docstring says.

    `tools`: the tools offered (None: any registered tool). `scripted(row, turn)`: token ids that segment
    `turn` of trajectory `row` is made of (forced, still scored by the model), or None to sample it (tests)."""
    family, model = policy.family, policy.model
    require_multi_turn(family, model, settings)
    settings = with_tool_stops(settings, tools)
    bare = unwrap(model)
    incremental = settings.hf_multiturn == "incremental" and incremental_unsupported(bare) is None
    batch = prompts.batch.to(model.device)
    device = batch.inputs["input_ids"].device
    suppress = list(family.suppressed_ids) + (list(family.eos_ids) if sampling.ignore_eos else [])
    suppressed = torch.tensor(suppress, device=device) if suppress else None
    eos = set(family.eos_ids) if not sampling.ignore_eos else set()
    rows = []
    for b in range(len(batch)):
        prompt_inputs = trim_left_padding(batch.select([b]).inputs)
        for _ in range(group_size):
            context = prompt_context(family, prompts, b, settings)
            rows.append(_Row(b, prompt_inputs, Trajectory(), context, torch.empty(0), 0))
    with eval_mode(model):
        family.reset_positions(bare)
        for row in rows:
            row.positions = _positions(family, bare, row, sampling.max_new_tokens)
        cache, attention = _prefill_prompts(family, bare, batch.inputs, group_size, sampling.max_new_tokens)
        for row in rows:
            row.fed = row.prompt_inputs["input_ids"].shape[1] - 1
        last = [[int(row.prompt_inputs["input_ids"][0, -1])] for row in rows]
        logits, cache, attention = _feed(family, bare, rows, last, cache, attention, device=device)
        live = list(range(len(rows)))  # indices into rows of the trajectories still going, in batch order
        decoding = _Decoding(family, bare, sampling, settings, suppressed, eos, scripted, device)
        for turn in range(settings.max_turns):
            state = _State(cache, attention, logits)
            _decode_segment(decoding, [rows[i] for i in live], live, turn, state)
            cache, attention = state.cache, state.attention
            keep = answer_segments(family, [rows[i] for i in live], turn, settings, tools)
            live = [i for i, going in zip(live, keep, strict=True) if going]
            if not live:
                break
            continuing = [rows[i] for i in live]
            for row in continuing:
                row.positions = _positions(family, bare, row, sampling.max_new_tokens)
            if incremental:
                index = torch.tensor([k for k, going in enumerate(keep) if going], device=device)
                cache, attention = family.fork_cache(bare, cache, index), attention[index]
                chunks = [[row.pending] + row.trajectory.token_ids[slice(*row.trajectory.observations[-1])]
                          for row in continuing]
                logits, cache, attention = _feed(family, bare, continuing, chunks, cache, attention, device=device,
                                                 observations=True)
            else:
                logits, cache, attention = _prefill_whole(family, bare, continuing, device=device)
    return trajectory_rollout(family, rows, group_size, settings)


def prompt_context(family, prompts: EnginePrompts, b: int, settings: MultiTurnSettings) -> ToolContext:
    """The tool context of a trajectory of prompt `b`: the prompt's images (original pixels, from its messages)
    with their (W, H, w, h) sizes (from the encoded batch)."""
    batch = prompts.batch
    images = prompts.messages and [part["image"] for m in prompts.messages[b] if isinstance(m["content"], list)
                                   for part in m["content"] if isinstance(part, dict) and "image" in part]
    sizes = batch.image_sizes[b] if batch.image_sizes else []
    return ToolContext.for_prompt(list(images or [])[:len(sizes)], sizes, family, settings)


def _prefill_prompts(family, bare, inputs: dict[str, Tensor], group_size: int, room: int):
    """The prompts' cache (all tokens but the last, each prompt once, its images through the vision tower
    once), forked G ways, and its attention mask [N, P - 1]. Positions are explicit (the family's rule on the
    left-padded batch), so a padded prompt's tokens sit where the later turns' positions expect them."""
    ids = inputs["input_ids"]  # [B, P]
    filler = ids.new_full((ids.shape[0], room), family.pad_id)
    positions = family.position_ids(bare, extend_per_token(inputs, filler, inputs["attention_mask"].new_ones(
        ids.shape[0], room)))
    if positions is None or ids.shape[1] < 2:
        raise UserError("rollout.max_turns > 1 needs a family with explicit positions and prompts longer than "
                        "one token; set rollout.max_turns=1.")
    cache = prefill_forked(family, bare, inputs, positions[..., :ids.shape[1] - 1], group_size=group_size)
    index = torch.arange(ids.shape[0], device=ids.device).repeat_interleave(group_size)  # [N]
    return cache, inputs["attention_mask"][index][:, :-1]


def _positions(family, bare, row: _Row, room: int) -> Tensor:
    """Positions [..., 1, L] of the row's prompt + trajectory + `room` more tokens, by the family's rule."""
    full = sequence_inputs(row.prompt_inputs, row.trajectory)
    filler = full["input_ids"].new_full((1, room), family.pad_id)
    full = extend_per_token(full, filler, full["attention_mask"].new_ones(1, room))
    positions = family.position_ids(bare, full)
    if positions is None:
        raise UserError(f"the {family.name} family computes no explicit positions, which rollout.max_turns > 1 "
                        "needs on the hf engine; set rollout.max_turns=1.")
    return positions


def _feed(family, bare, rows: list[_Row], chunks: list[list[int]], cache, attention: Tensor, *, device,
          observations: bool = False) -> tuple[Tensor, object, Tensor]:
    """Run each row's next tokens (`chunks[i]`, ragged, padded with masked columns) on the batched cache;
    returns (logits [n, V] at each row's last fed token, the cache, the attention mask [n, L + w]).
    With `observations`, the chunks end with each row's latest observation, whose images and per-token
    inputs (token types) go in too."""
    width = max(1, max(len(chunk) for chunk in chunks))
    ids = torch.full((len(rows), width), family.pad_id, dtype=torch.long, device=device)  # [n, w]
    real = torch.zeros((len(rows), width), dtype=attention.dtype, device=device)  # [n, w]
    position_rows, extra_tokens, images = [], {}, {}
    for i, (row, chunk) in enumerate(zip(rows, chunks, strict=True)):
        ids[i, :len(chunk)] = torch.tensor(chunk, dtype=torch.long, device=device)
        real[i, :len(chunk)] = 1
        spot = row.positions[..., 0, row.fed:row.fed + width]  # [..., <= w]
        if spot.shape[-1] < width:
            spot = torch.cat([spot, spot.new_zeros(*spot.shape[:-1], width - spot.shape[-1])], dim=-1)
        position_rows.append(spot)
        row.fed += len(chunk)
        if observations and row.trajectory.observation_inputs:
            start, end = row.trajectory.observations[-1]
            offset = len(chunk) - (end - start)  # the pending token comes first
            for key, value in row.trajectory.observation_inputs[-1].items():
                if tuple(value.shape) == (1, end - start):  # per token (token types)
                    extra_tokens.setdefault(key, torch.zeros((len(rows), width), dtype=value.dtype, device=device))
                    extra_tokens[key][i, offset:offset + end - start] = value[0].to(device)
                else:
                    images.setdefault(key, []).append(value.to(device))
    positions = torch.stack(position_rows, dim=-2)  # [..., n, w]
    attention = torch.cat([attention, real], dim=1)  # [n, L + w]
    inputs = {"input_ids": ids, "attention_mask": attention, "position_ids": positions, **extra_tokens,
              **{key: sum(values) if key == "batch_num_images" else torch.cat(values, dim=0)
                 for key, values in images.items()}}
    out = bare(**inputs, use_cache=True, logits_to_keep=width, **{cache_keyword(bare): cache})
    last = (real.long().sum(dim=1) - 1).clamp(min=0)  # [n]
    logits = out.logits[torch.arange(len(rows), device=device), last].float()  # [n, V]
    return logits, cache_of(out), attention


def _prefill_whole(family, bare, rows: list[_Row], *, device) -> tuple[Tensor, object, Tensor]:
    """`naive`: every row's whole conversation (prompt + trajectory) prefilled again, left-padded."""
    sequences = [sequence_inputs(row.prompt_inputs, row.trajectory) for row in rows]
    width = max(s["input_ids"].shape[1] for s in sequences)
    inputs: dict[str, list[Tensor]] = {}
    for sequence in sequences:
        length = sequence["input_ids"].shape[1]
        for key, value in sequence.items():
            if tuple(value.shape) == (1, length):  # per token: left-padded
                fill = family.pad_id if key == "input_ids" else 0
                value = torch.cat([value.new_full((1, width - length), fill), value], dim=1)
            inputs.setdefault(key, []).append(value)
    batch = {key: sum(values) if key == "batch_num_images" else torch.cat(values, dim=0)
             for key, values in inputs.items()}
    positions = torch.stack([torch.cat([row.positions.new_zeros(*row.positions.shape[:-1],
                                                                width - s["input_ids"].shape[1]),
                                        row.positions[..., :s["input_ids"].shape[1]]], dim=-1)[..., 0, :]
                             for row, s in zip(rows, sequences, strict=True)], dim=-2)  # [..., n, width]
    family.reset_positions(bare)
    out = bare(**batch, position_ids=positions, use_cache=True, logits_to_keep=1)
    for row, sequence in zip(rows, sequences, strict=True):
        row.fed = sequence["input_ids"].shape[1]
    return out.logits[:, -1].float(), cache_of(out), batch["attention_mask"]


@dataclass
class _Decoding:
    """What every segment of one rollout decodes with."""

    family: object
    bare: torch.nn.Module
    sampling: Sampling
    settings: MultiTurnSettings
    suppressed: Tensor | None  # ids never sampled
    eos: set[int]
    scripted: Callable[[int, int], list[int] | None] | None
    device: torch.device


@dataclass
class _State:
    """The batched cache, its attention mask [n, L] and the logits [n, V] that draw each row's next token."""

    cache: object
    attention: Tensor
    logits: Tensor


def _decode_segment(decoding: _Decoding, rows: list[_Row], row_ids: list[int], turn: int, state: _State) -> None:
    """Sample one segment for every row (in place: `row.segment`, `row.ended_by`, `row.pending`, the logps, and
    `state`, whose cache then holds every segment token but each row's last, `pending`)."""
    family, sampling, scripted = decoding.family, decoding.sampling, decoding.scripted
    forced = [scripted(i, turn) if scripted is not None else None for i in row_ids]
    for row in rows:
        row.segment, row.ended_by, row.pending = [], "", None
    active = [True] * len(rows)
    for step in range(sampling.max_new_tokens):
        chosen = next_tokens(state.logits, sampling, decoding.suppressed)  # [n]
        for i, script in enumerate(forced):
            if active[i] and script is not None and step < len(script):
                chosen[i] = script[step]
        logps = family.logps_from_logits(state.logits.unsqueeze(1), chosen.unsqueeze(1), temperature=1.0 if
                                         sampling.greedy else sampling.temperature)[:, 0]  # [n]
        chunks = []
        for i, row in enumerate(rows):
            if not active[i]:
                chunks.append([])
                continue
            token = int(chosen[i])
            row.segment.append(token)
            row.trajectory.logps.append(float(logps[i]))
            row.ended_by = segment_end(family, row, token, decoding.eos, sampling, decoding.settings)
            if row.ended_by:
                active[i], row.pending = False, token
                chunks.append([])
            else:
                chunks.append([token])
        if not any(active):
            return
        state.logits, state.cache, state.attention = _feed(family, decoding.bare, rows, chunks, state.cache,
                                                           state.attention, device=decoding.device)


def segment_end(family, row: _Row, token: int, eos: set[int], sampling: Sampling,
                 settings: MultiTurnSettings) -> str:
    """Why the row's segment ends after `token` ('' when it goes on). `row`: a trajectory being decoded (its
    `segment` so far and its `trajectory`; the vLLM engine's rows too)."""
    if token in eos:
        return "eos"
    stops = (*family.tool_stop_strings, *settings.stop_strings)
    if any(stop in family.tokenizer.decode(row.segment[-STOP_WINDOW:]) for stop in stops):
        return "stop"
    if len(row.trajectory.token_ids) + len(row.segment) >= settings.max_total_tokens:
        return "total"
    if len(row.segment) >= sampling.max_new_tokens:
        return "length"
    return ""


def answer_segments(family, rows: list[_Row], turn: int, settings: MultiTurnSettings,
                     tools: tuple[str, ...] | None) -> list[bool]:
    """Close each row's segment; run the tool calls (on threads, each within its time budget) and append
    their observations. Returns, per row, whether its trajectory goes on. A row is anything with `segment`,
    `ended_by`, `trajectory` and `context` (this engine's `_Row`, the vLLM engine's rows)."""
    calls = []
    for row in rows:
        row.trajectory.add_segment(row.segment)
        call = None
        if row.ended_by == "total":
            row.trajectory.limit = "token"
        elif row.ended_by != "eos":
            call = read_call(family, family.tokenizer.decode(row.segment, skip_special_tokens=False), tools)
            if call is not None and turn + 1 >= settings.max_turns:
                row.trajectory.limit, call = "turn", None
        calls.append(call)
    pending = [(row, call) for row, call in zip(rows, calls, strict=True) if call is not None]
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(pending)))) as pool:
        results = list(pool.map(lambda pair: answer_call(
            pair[1], pair[0].context, allowed=tools,
            room=settings.max_total_tokens - len(pair[0].trajectory.token_ids)), pending))
    going = {}
    for (row, call), result in zip(pending, results, strict=True):
        going[id(row)] = _observe(family, row, call, result, turn, settings)
    keep = [going.get(id(row), False) for row in rows]
    for row, alive in zip(rows, keep, strict=True):
        row.trajectory.finished = not alive
        if not alive:
            row.context.close()  # what its tools kept (an interpreter) goes with the trajectory
    return keep


def _observe(family, row: _Row, call, result: ToolResult, turn: int, settings: MultiTurnSettings) -> bool:
    """Append the observation of one call to the row's trajectory, unless a limit ends it first."""
    trajectory = row.trajectory
    trajectory.calls.append(ToolCallRecord(turn, call.name or "", dict(call.arguments or {}), result.text,
                                           len(result.images), result.error))
    if len(trajectory.images) + len(result.images) > settings.max_images:
        trajectory.limit = "image"
        return False
    ids, inputs = result.encoded or family.encode_observation(result.text, result.images)
    if len(trajectory.token_ids) + len(ids) >= settings.max_total_tokens:
        trajectory.limit = "token"
        return False
    views = result.views  # one per image (tools.run_tool made those of the images a tool made itself)
    row.context.views.extend(views)
    trajectory.add_observation(ids, [view.image for view in views], inputs)
    trajectory.crop_boxes.extend((view.original, tuple(view.box)) for view in views)
    return True


def trajectory_rollout(family, rows: list[_Row], group_size: int, settings: MultiTurnSettings) -> Rollout:
    """The Rollout of finished rows (their trajectories padded, the loss mask, the texts, and the sampler's log-prob
    of each generated token, 0 on observations: the behaviour log-probs the update's correction reads)."""
    trajectories = [row.trajectory for row in rows]
    ids, attention, loss = pad_trajectories(trajectories, family.pad_id, on_limit=settings.on_limit)
    texts = family.tokenizer.batch_decode([t.token_ids for t in trajectories], skip_special_tokens=True)
    logps = torch.zeros(ids.shape, dtype=torch.float32)  # [B * G, C]
    for n, trajectory in enumerate(trajectories):
        logps[n, :len(trajectory.logps)] = torch.tensor(trajectory.logps, dtype=torch.float32)
    return Rollout(completion_ids=ids, completion_mask=attention, texts=texts, group_size=group_size,
                   sampler_logps=logps.to(ids.device), loss_mask=loss, trajectories=trajectories)
