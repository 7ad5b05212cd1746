"""Padding-free scoring: a micro-batch's sequences packed into one row, each prompt once per group.

The padded update computes a rectangle: prompts left-padded to the longest, completions right-padded to the
longest. Packed, the forward runs one row of real tokens only:

    [prompt a][completion a.0][completion a.1] ... [prompt b][completion b.0] ...

Each token keeps the position it has in its own (prompt + completion) sequence: the family's rule (1-D, or
Qwen's 3-D M-RoPE) on the padded batch, gathered at the real tokens, so a packed token sees the rotary
angles it would see padded. Attention never crosses sequences: a prompt's tokens attend causally within the
prompt, a completion's tokens attend to their prompt and causally within themselves, never to another
completion of the group. With `prompt_once`, each distinct prompt is in the row once, before its G
completions (the prompt-once update without a forked cache); otherwise each sequence is its own prompt +
completion segment.

The attention is a family-independent function registered with transformers (`PACKED_ATTENTION`), used
for the packed forward only: on CUDA, torch's varlen flash attention (`varlen_attn`) over each segment's
gathered keys (its prompt's and its own); elsewhere scaled dot-product attention over the segments gathered
into padded batches, a few buckets of similar length (torch's flex attention has no CPU backward, and a dense
[T, T] block mask costs 4-7x the padded attention on the bench's shape: docs/packing.md).
`dense_mask` is the same rule as one boolean matrix, the reference the tests hold the segment attention to.

Shapes: N sequences, L = P + C columns of the padded batch, T packed tokens, H hidden size.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from gpg_vl.errors import UserError

PACKED_ATTENTION = "gpg_packed"  # the attention implementation name registered with transformers
_SEGMENTS: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("gpg_packed_segments", default=None)


@dataclass(frozen=True)
class PackedLayout:
    """Where every token of a padded batch [N, L] (L = P + C, prompt columns first) goes in the packed row.

    `token_index` [T]: the flat index n * L + column of each packed token, in row order. `segments`: one
    (start, end, prefix_start, prefix_end) per segment of the row: its tokens [start, end) attend to the
    prefix [prefix_start, prefix_end) (their prompt, for a completion that continues a shared prompt; empty
    otherwise) and causally to themselves. `scored_rows`, `scored_columns` [K]: the completion token (n, t)
    of every scored token (completion mask set), and `scored_from` [K] the packed token whose output
    predicts it. `router_weight` [T]: how many sequences each packed token stands for (a shared prompt's
    token stands for its G sequences), as the padded path weighs the MoE router loss.
    """

    token_index: Tensor  # [T]
    segments: tuple[tuple[int, int, int, int], ...]
    scored_rows: Tensor  # [K]
    scored_columns: Tensor  # [K]
    scored_from: Tensor  # [K]
    router_weight: Tensor  # [T]
    groups: tuple[tuple[int, tuple[int, ...]], ...]  # (prompt, its sequences) in row order

    @property
    def tokens(self) -> int:
        return int(self.token_index.numel())


def completion_lengths(completion_mask: Tensor) -> list[int]:
    """The length of each completion [N], which must be a prefix of its row (right padding only)."""
    lengths = completion_mask.sum(dim=1)  # [N]
    columns = torch.arange(completion_mask.shape[1], device=completion_mask.device)
    if not bool(((columns < lengths[:, None]) == completion_mask.bool()).all()):
        raise UserError("trainer.packing needs each completion's mask to be a prefix of its row (right padding "
                        "only); this micro-batch has a gap inside a completion: set trainer.packing=off.")
    return lengths.tolist()


def pack_layout(prompt_mask: Tensor, prompt_index: list[int], completion_mask: Tensor, *,
                prompt_once: bool) -> PackedLayout:
    """The packed layout of N sequences: `prompt_mask` [N, P] (left-padded, per sequence), `prompt_index` [N]
    (sequence n continues prompt `prompt_index[n]`), `completion_mask` [N, C] (right-padded).

    A completion's input tokens are its columns t < min(length, C - 1), what the padded forward feeds
    with a mask (it never feeds the last column), so the two forwards see the same tokens. The output at a
    prompt's last token predicts completion token 0; at completion column t, token t + 1.
    """
    count, width = prompt_mask.shape
    columns = width + completion_mask.shape[1]
    lengths = completion_lengths(completion_mask)
    fed = [min(length, completion_mask.shape[1] - 1) for length in lengths]
    prompt_columns = [torch.nonzero(prompt_mask[n], as_tuple=True)[0].tolist() for n in range(count)]
    groups: list[tuple[int, tuple[int, ...]]] = []
    if prompt_once:
        for prompt in sorted(set(prompt_index)):
            groups.append((prompt, tuple(n for n in range(count) if prompt_index[n] == prompt)))
    else:
        groups = [(prompt_index[n], (n,)) for n in range(count)]
    index, segments, weight = [], [], []
    last_prompt_token, first_completion_token = {}, {}
    for _, members in groups:
        head = members[0]
        start = len(index)
        index += [head * columns + c for c in prompt_columns[head]]
        weight += [float(len(members))] * len(prompt_columns[head])
        prompt_end = len(index)
        if prompt_once:
            segments.append((start, prompt_end, start, start))
        for n in members:
            last_prompt_token[n] = prompt_end - 1
            if not prompt_once:  # the sequence is one segment: its prompt, then its completion
                index += [n * columns + width + t for t in range(fed[n])]
                weight += [1.0] * fed[n]
                first_completion_token[n] = prompt_end
                segments.append((start, len(index), start, start))
                continue
            first_completion_token[n] = len(index)
            index += [n * columns + width + t for t in range(fed[n])]
            weight += [1.0] * fed[n]
            if fed[n]:
                segments.append((first_completion_token[n], len(index), start, prompt_end))
    scored_rows, scored_columns, scored_from = [], [], []
    for n in range(count):
        for t in range(lengths[n]):
            scored_rows.append(n)
            scored_columns.append(t)
            scored_from.append(last_prompt_token[n] if t == 0 else first_completion_token[n] + t - 1)
    device = prompt_mask.device
    return PackedLayout(torch.tensor(index, dtype=torch.long, device=device), tuple(segments),
                        torch.tensor(scored_rows, dtype=torch.long, device=device),
                        torch.tensor(scored_columns, dtype=torch.long, device=device),
                        torch.tensor(scored_from, dtype=torch.long, device=device),
                        torch.tensor(weight, device=device), tuple(groups))


def pack_tokens(values: Tensor, layout: PackedLayout) -> Tensor:
    """A per-token tensor of the padded batch [..., N, L] as the packed row [..., 1, T] (positions [3, N, L]
    keep their leading axis)."""
    flat = values.reshape(*values.shape[:-2], -1)  # [..., N * L]
    return flat.index_select(-1, layout.token_index).unsqueeze(-2)  # [..., 1, T]


def unpack_scored(packed: Tensor, layout: PackedLayout, shape: tuple[int, int]) -> Tensor:
    """Outputs of the packed row [1, T, H] -> [N, C, H], row n column t the output that predicts completion
    token (n, t); zeros where nothing is scored."""
    rows, width = shape
    out = packed.new_zeros(rows, width, packed.shape[-1])  # [N, C, H]
    return out.index_put((layout.scored_rows, layout.scored_columns), packed[0, layout.scored_from])


def dense_mask(layout: PackedLayout) -> Tensor:
    """The packed attention rule as one matrix [T, T] (query, key) -> may attend: causal within a segment,
    and to the whole of its prefix. The reference `segment_attention` is held to."""
    total = layout.tokens
    allowed = torch.zeros(total, total, dtype=torch.bool)
    for start, end, prefix_start, prefix_end in layout.segments:
        allowed[start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool).tril()
        allowed[start:end, prefix_start:prefix_end] = True
    return allowed


def segment_attention(query: Tensor, key: Tensor, value: Tensor, segments: tuple, *, scaling: float | None,
                      dropout: float = 0.0, buckets: tuple[tuple[int, ...], ...] | None = None) -> Tensor:
    """Attention of one packed row by segments, each on its prefix's and its own keys only.

    query [1, heads, T, d], key / value [1, kv_heads, T, d] -> [1, T, heads, d] (what transformers'
    attention functions return). On CUDA in half precision one varlen flash-attention call (`varlen_attn`,
    causal aligned to the end of each segment's keys). Elsewhere one scaled dot-product attention call per
    bucket of segments gathered into a padded batch: `buckets` (segment indices; default `segment_buckets`,
    the partition the cost model picks) trades the padding one call computes against the cost of another call
    (docs/packing.md).
    """
    if query.is_cuda and dropout == 0.0 and query.dtype in (torch.float16, torch.bfloat16):  # flash: half types
        return _varlen_attention(query, key, value, segments, scaling=scaling)
    plan = segment_plan(segments, buckets if buckets is not None else segment_buckets(segments), str(query.device))
    heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[-1]

    def gather(states: Tensor, index: Tensor, count: int, width: int) -> Tensor:  # [1, h, T, d] -> [S, h, w, d]
        return states[0].index_select(1, index).view(states.shape[1], count, width, dim).transpose(0, 1)

    outputs = []
    for queries, keys, mask, real in plan.batches:
        count, width_q, width_k = mask.shape[0], mask.shape[-2], mask.shape[-1]
        out = torch.nn.functional.scaled_dot_product_attention(
            gather(query, queries, count, width_q), gather(key, keys, count, width_k),
            gather(value, keys, count, width_k), attn_mask=mask, dropout_p=dropout, scale=scaling,
            enable_gqa=heads != kv_heads)  # [S_b, heads, Lq_b, d]
        outputs.append(out.transpose(1, 2).reshape(-1, heads, dim).index_select(0, real))  # [T_b, heads, d]
    rows = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
    return (rows if plan.row_order is None else rows.index_select(0, plan.row_order)).unsqueeze(0)  # [1, T, heads, d]


CALL_COST = 1 << 16  # one more attention call, in (query, key) pairs of padded work: estimated, docs/packing.md


def _lengths(segment: tuple[int, int, int, int]) -> tuple[int, int]:
    """(queries, keys) of a segment: its own tokens, and its prefix's and its own."""
    start, end, prefix_start, prefix_end = segment
    return end - start, end - start + prefix_end - prefix_start


@functools.lru_cache(maxsize=16)
def segment_buckets(segments: tuple, call_cost: int = CALL_COST) -> tuple[tuple[int, ...], ...]:
    """The segments (indices) partitioned into the buckets one attention call each runs as a padded batch:
    in order of key length, the contiguous runs minimising the padded work, sum over buckets of
    count x longest queries x longest keys, plus `call_cost` per call (dynamic programming, O(S^2))."""
    order = sorted(range(len(segments)), key=lambda i: (_lengths(segments[i])[1], _lengths(segments[i])[0]))
    count = len(order)
    best, cut = [0] * (count + 1), [count] * (count + 1)  # best[i]: the cheapest partition of order[i:]
    for first in range(count - 1, -1, -1):
        best[first], longest_q, longest_k = None, 0, 0
        for last in range(first, count):
            queries, keys = _lengths(segments[order[last]])
            longest_q, longest_k = max(longest_q, queries), max(longest_k, keys)
            cost = (last - first + 1) * longest_q * longest_k + call_cost + best[last + 1]
            if best[first] is None or cost <= best[first]:  # a tie: the longer run
                best[first], cut[first] = cost, last + 1
    buckets, first = [], 0
    while first < count:
        buckets.append(tuple(order[first:cut[first]]))
        first = cut[first]
    return tuple(buckets)


@dataclass(frozen=True)
class SegmentPlan:
    """The gathers of `segment_attention`: per bucket, query index [S_b * Lq_b] and key index [S_b * Lk_b] into
    the row (padding points at token 0), mask [S_b, 1, Lq_b, Lk_b] (a padding query sees token 0 only, so no
    row is empty) and the index [T_b] of the real queries in the flattened [S_b * Lq_b] batch; `row_order` [T]
    puts the buckets' real queries, concatenated, back in row order (None when they already are)."""

    batches: tuple[tuple[Tensor, Tensor, Tensor, Tensor], ...]
    row_order: Tensor | None


@functools.lru_cache(maxsize=4)
def segment_plan(segments: tuple, buckets: tuple[tuple[int, ...], ...], device: str) -> SegmentPlan:
    """Built once per packed forward and shared by its layers (cached on the segments)."""
    batches, placed = [], []
    for bucket in buckets:
        chosen = [segments[i] for i in bucket]
        longest_query = max(_lengths(s)[0] for s in chosen)
        longest_key = max(_lengths(s)[1] for s in chosen)
        queries = torch.zeros(len(chosen), longest_query, dtype=torch.long)
        keys = torch.zeros(len(chosen), longest_key, dtype=torch.long)
        mask = torch.zeros(len(chosen), longest_query, longest_key, dtype=torch.bool)
        real = torch.zeros(len(chosen), longest_query, dtype=torch.bool)
        for row, (start, end, prefix_start, prefix_end) in enumerate(chosen):
            length, prefix = end - start, prefix_end - prefix_start
            queries[row, :length] = torch.arange(start, end)
            keys[row, :prefix + length] = torch.cat([torch.arange(prefix_start, prefix_end),
                                                     torch.arange(start, end)])
            mask[row, :length, :prefix + length] = torch.ones(length, prefix + length, dtype=torch.bool).tril(prefix)
            mask[row, length:, 0] = True
            real[row, :length] = True
            placed.append(torch.arange(start, end))
        batches.append((queries.flatten().to(device), keys.flatten().to(device), mask.unsqueeze(1).to(device),
                        real.flatten().nonzero().flatten().to(device)))
    positions = torch.cat(placed)  # the row position of each concatenated real query
    if torch.equal(positions, torch.arange(positions.numel())):
        return SegmentPlan(tuple(batches), None)
    row_order = torch.empty_like(positions)
    row_order[positions] = torch.arange(positions.numel())
    return SegmentPlan(tuple(batches), row_order.to(device))


def varlen_keys(segments: tuple, device) -> tuple[Tensor, Tensor, Tensor, int, int]:
    """(key index [sum of key lengths], cu_seq_q [S + 1], cu_seq_k [S + 1], max_q, max_k): each segment's keys
    gathered as its prefix then itself, the arguments of a varlen attention call."""
    index, cu_q, cu_k = [], [0], [0]
    for start, end, prefix_start, prefix_end in segments:
        index += list(range(prefix_start, prefix_end)) + list(range(start, end))
        cu_q.append(cu_q[-1] + end - start)
        cu_k.append(len(index))
    lengths_q = [b - a for a, b in zip(cu_q, cu_q[1:], strict=False)]
    lengths_k = [b - a for a, b in zip(cu_k, cu_k[1:], strict=False)]

    def tensor(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    return (torch.tensor(index, dtype=torch.long, device=device), tensor(cu_q), tensor(cu_k), max(lengths_q),
            max(lengths_k))


def _varlen_attention(query: Tensor, key: Tensor, value: Tensor, segments: tuple, *,
                      scaling: float | None) -> Tensor:
    """CUDA: torch's varlen flash attention over the gathered keys (wired, not run on this project's CPU CI;
    its check is `scripts/gpu_check.py --packing`)."""
    from torch.nn.attention.varlen import varlen_attn

    index, cu_q, cu_k, max_q, max_k = varlen_keys(segments, query.device)
    q = query[0].transpose(0, 1)  # [T, heads, d]
    k, v = key[0].transpose(0, 1)[index], value[0].transpose(0, 1)[index]  # [sum keys, kv_heads, d]
    out = varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scaling, window_size=(-1, 0),
                      enable_gqa=query.shape[1] != key.shape[1])  # [T, heads, d]
    return out.unsqueeze(0)


def packed_attention_forward(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, *,
                             scaling: float | None = None, dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    """transformers' attention-function signature: the packed row's segments come from `packed_segments`."""
    segments = _SEGMENTS.get()
    if segments is None:
        raise RuntimeError("the packed attention ran outside packed_segments(); it serves packed forwards only.")
    return segment_attention(query, key, value, segments, scaling=scaling,
                             dropout=dropout if module.training else 0.0), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)


@contextlib.contextmanager
def packed_segments(text_config, segments: tuple):
    """Run the language model's attention as `packed_attention_forward` over `segments` inside the block
    (the text config's implementation switched, and restored after)."""
    _register()
    before = text_config._attn_implementation
    token = _SEGMENTS.set(segments)
    text_config._attn_implementation = PACKED_ATTENTION
    try:
        yield
    finally:
        text_config._attn_implementation = before
        _SEGMENTS.reset(token)


# ---------------------------------------------------------------------------------------------
# the packed forward
# ---------------------------------------------------------------------------------------------
def packing_unsupported(model: torch.nn.Module) -> str | None:
    """Why the language model of `model` cannot run packed exactly (None when it can): every layer must be
    full causal attention (no sliding window, no linear attention's recurrent state, no bidirectional
    image attention), its language model named by `get_decoder`."""
    text = model.config.get_text_config()
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"]) - {"full_attention"}
    if kinds:
        return f"its layers include {', '.join(sorted(kinds))}, which a packed row would run across sequences"
    if getattr(text, "use_bidirectional_attention", False):
        return "its attention is bidirectional over image tokens"
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or getattr(decoder, "config", None) is None:
        return "it names no language model (`get_decoder`) whose attention could be switched"
    return None
