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
gathered keys (its prompt's and its own); elsewhere scaled dot-product attention one segment at a time (one
thread) or over the segments gathered into one padded batch (torch's flex attention has no CPU backward, and
a dense [T, T] block mask costs 4-7x the padded attention on the bench's shape: docs/packing.md).
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
                      dropout: float = 0.0, batched: bool | None = None) -> Tensor:
    """Attention of one packed row by segments, each on its prefix's and its own keys only.

    query [1, heads, T, d], key / value [1, kv_heads, T, d] -> [1, T, heads, d] (what transformers'
    attention functions return). On CUDA in half precision one varlen flash-attention call (`varlen_attn`,
    causal aligned to the end of each segment's keys). Elsewhere scaled dot-product attention, `batched`
    (default: with more than one torch thread) as one call over the segments gathered into a padded batch, else
    one call per segment: measured on the bench's shape, per segment costs what the padded path's attention costs at one
    thread but many small calls stall when threads contend for cores; one batched call costs about 1.2x the
    padded attention at either count (docs/packing.md).
    """
    if query.is_cuda and dropout == 0.0 and query.dtype in (torch.float16, torch.bfloat16):  # flash: half types
        return _varlen_attention(query, key, value, segments, scaling=scaling)
    if batched if batched is not None else torch.get_num_threads() > 1:
        return _batched_attention(query, key, value, segments, scaling=scaling, dropout=dropout)
    gqa = query.shape[1] != key.shape[1]
    outputs = []
    for start, end, prefix_start, prefix_end in segments:
        prefix, length = prefix_end - prefix_start, end - start
        keys = key[:, :, start:end] if prefix == 0 else torch.cat([key[:, :, prefix_start:prefix_end],
                                                                  key[:, :, start:end]], dim=2)
        values = value[:, :, start:end] if prefix == 0 else torch.cat([value[:, :, prefix_start:prefix_end],
                                                                      value[:, :, start:end]], dim=2)
        mask = None
        if prefix:  # [length, prefix + length]: the whole prefix, then causal
            mask = torch.ones(length, prefix + length, dtype=torch.bool, device=query.device).tril(prefix)
        outputs.append(torch.nn.functional.scaled_dot_product_attention(
            query[:, :, start:end], keys, values, attn_mask=mask, is_causal=mask is None and length > 1,
            dropout_p=dropout, scale=scaling, enable_gqa=gqa))  # [1, heads, length, d]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()  # [1, T, heads, d]


@functools.lru_cache(maxsize=4)
def segment_batch(segments: tuple, device: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The segments as a padded batch (built once per packed forward, shared by its layers): query index [S * Lq]
    and key index [S * Lk] into the row (padding points at token 0), mask [S, 1, Lq, Lk] (a padding query sees
    token 0 only, so no row is empty), and the index [T] of the real queries in the flattened [S * Lq] batch."""
    longest_query = max(end - start for start, end, _, _ in segments)
    longest_key = max(end - start + prefix_end - prefix_start for start, end, prefix_start, prefix_end in segments)
    queries = torch.zeros(len(segments), longest_query, dtype=torch.long)
    keys = torch.zeros(len(segments), longest_key, dtype=torch.long)
    mask = torch.zeros(len(segments), longest_query, longest_key, dtype=torch.bool)
    real = torch.zeros(len(segments), longest_query, dtype=torch.bool)
    for row, (start, end, prefix_start, prefix_end) in enumerate(segments):
        length, prefix = end - start, prefix_end - prefix_start
        queries[row, :length] = torch.arange(start, end)
        keys[row, :prefix + length] = torch.cat([torch.arange(prefix_start, prefix_end), torch.arange(start, end)])
        mask[row, :length, :prefix + length] = torch.ones(length, prefix + length, dtype=torch.bool).tril(prefix)
        mask[row, length:, 0] = True
        real[row, :length] = True
    return (queries.flatten().to(device), keys.flatten().to(device), mask.unsqueeze(1).to(device),
            real.flatten().nonzero().flatten().to(device))


def _batched_attention(query: Tensor, key: Tensor, value: Tensor, segments: tuple, *, scaling: float | None,
                       dropout: float) -> Tensor:
    """One scaled dot-product attention call over the segments gathered into a padded batch. [1, T, heads, d]"""
    queries, keys, mask, real = segment_batch(segments, str(query.device))
    count, heads, kv_heads, dim = len(segments), query.shape[1], key.shape[1], query.shape[-1]

    def gather(states: Tensor, index: Tensor, width: int) -> Tensor:  # [1, h, T, d] -> [S, h, width, d]
        return states[0].index_select(1, index).view(states.shape[1], count, width, dim).transpose(0, 1)

    out = torch.nn.functional.scaled_dot_product_attention(
        gather(query, queries, mask.shape[-2]), gather(key, keys, mask.shape[-1]),
        gather(value, keys, mask.shape[-1]), attn_mask=mask, dropout_p=dropout, scale=scaling,
        enable_gqa=heads != kv_heads)  # [S, heads, Lq, d]
    return out.transpose(1, 2).reshape(-1, heads, dim).index_select(0, real).unsqueeze(0)  # [1, T, heads, d]


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
    its check is a GPU check)."""
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
