"""The packed layout and attention (gpg_vl/models/packing.py) on hand-worked cases and against slow references."""

from __future__ import annotations

import math

import pytest
import torch

from gpg_vl.errors import UserError
from gpg_vl.models.packing import (
    dense_mask,
    pack_layout,
    pack_tokens,
    segment_attention,
    segment_buckets,
    unpack_scored,
    varlen_keys,
)

# Three sequences: 0 and 1 continue prompt 0 (2 real tokens, one column of left padding), 2 continues prompt 1
# (3 tokens); completions of 3, 1 and 2 tokens in C = 3 columns. L = P + C = 6 columns per padded row.
PROMPT_MASK = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1]])
PROMPT_INDEX = [0, 0, 1]
COMPLETION_MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])


def test_prompt_once_layout_holds_each_prompt_once_then_its_completions_input_tokens():
    layout = pack_layout(PROMPT_MASK, PROMPT_INDEX, COMPLETION_MASK, prompt_once=True)
    # prompt 0 (row 0, columns 1-2), seq 0's columns 3-4 (its last token, column 5, is never fed: C - 1 = 2),
    # seq 1's column 3, prompt 1 (row 2, columns 0-2), seq 2's columns 3-4 (it is shorter than C: fed whole)
    assert layout.token_index.tolist() == [1, 2, 3, 4, 9, 12, 13, 14, 15, 16]
    assert layout.segments == ((0, 2, 0, 0), (2, 4, 0, 2), (4, 5, 0, 2), (5, 8, 5, 5), (8, 10, 5, 8))
    assert layout.groups == ((0, (0, 1)), (1, (2,)))
    assert layout.router_weight.tolist() == [2, 2, 1, 1, 1, 1, 1, 1, 1, 1]  # prompt 0 stands for 2 sequences
    # (n, t) <- packed token: token 0 from its prompt's last token, token t from its completion's token t - 1
    assert layout.scored_rows.tolist() == [0, 0, 0, 1, 2, 2]
    assert layout.scored_columns.tolist() == [0, 1, 2, 0, 0, 1]
    assert layout.scored_from.tolist() == [1, 2, 3, 1, 7, 8]


def test_whole_sequence_layout_repeats_each_prompt_as_its_own_segment():
    layout = pack_layout(PROMPT_MASK, PROMPT_INDEX, COMPLETION_MASK, prompt_once=False)
    assert layout.token_index.tolist() == [1, 2, 3, 4, 7, 8, 9, 12, 13, 14, 15, 16]
    assert layout.segments == ((0, 4, 0, 0), (4, 7, 4, 4), (7, 12, 7, 7))
    assert layout.scored_from.tolist() == [1, 2, 3, 5, 9, 10]
    assert layout.router_weight.tolist() == [1.0] * 12


def test_the_dense_mask_lets_a_completion_see_its_prompt_and_its_own_past_only():
    mask = dense_mask(pack_layout(PROMPT_MASK, PROMPT_INDEX, COMPLETION_MASK, prompt_once=True))
    assert mask[4].nonzero().flatten().tolist() == [0, 1, 4]  # seq 1: prompt 0, itself; not seq 0's tokens 2-3
    assert mask[3].nonzero().flatten().tolist() == [0, 1, 2, 3]
    assert mask[1].nonzero().flatten().tolist() == [0, 1]  # a prompt token: causal within the prompt
    assert mask[9].nonzero().flatten().tolist() == [5, 6, 7, 8, 9]  # never prompt 0's group


def test_pack_tokens_gathers_multimodal_positions_and_unpack_puts_outputs_back():
    positions = torch.arange(3 * 3 * 6).reshape(3, 3, 6)  # [3, N, L]: M-RoPE's three axes
    layout = pack_layout(PROMPT_MASK, PROMPT_INDEX, COMPLETION_MASK, prompt_once=True)
    packed = pack_tokens(positions, layout)  # [3, 1, T]
    assert packed.shape == (3, 1, 10)
    assert packed[1, 0].tolist() == [18 + i for i in layout.token_index.tolist()]
    outputs = torch.arange(10, dtype=torch.float32).reshape(1, 10, 1).expand(1, 10, 2)  # [1, T, H]
    hidden = unpack_scored(outputs, layout, (3, 3))  # [N, C, H]
    assert hidden[..., 0].tolist() == [[1, 2, 3], [1, 0, 0], [7, 8, 0]]


def test_a_completion_mask_with_a_gap_is_refused_in_one_sentence():
    with pytest.raises(UserError, match="trainer.packing=off"):
        pack_layout(PROMPT_MASK, PROMPT_INDEX, torch.tensor([[1, 0, 1], [1, 0, 0], [1, 1, 0]]), prompt_once=True)


def loop_attention(query, key, value, allowed, scaling):
    """The slow reference: one query token at a time, softmax over the keys it may see. [1, T, heads, d]"""
    heads, total = query.shape[1], query.shape[2]
    groups = heads // key.shape[1]
    out = torch.zeros(1, total, heads, query.shape[-1], dtype=torch.float64)
    for h in range(heads):
        for i in range(total):
            keys = allowed[i].nonzero().flatten()
            scores = torch.tensor([float(query[0, h, i] @ key[0, h // groups, j]) * scaling for j in keys])
            weights = torch.softmax(scores.double(), dim=0)
            out[0, i, h] = sum(w * value[0, h // groups, j].double() for w, j in zip(weights, keys, strict=True))
    return out


@pytest.mark.parametrize("buckets", ["chosen", "one", "each", "mixed"])
@pytest.mark.parametrize("prompt_once", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_segment_attention_equals_the_dense_mask_and_the_loop_reference_in_value_and_gradient(prompt_once,
                                                                                                kv_heads, buckets):
    layout = pack_layout(PROMPT_MASK, PROMPT_INDEX, COMPLETION_MASK, prompt_once=prompt_once)
    count = len(layout.segments)
    buckets = {"chosen": None, "one": (tuple(range(count)),), "each": tuple((i,) for i in range(count)),
               "mixed": (tuple(range(count - 1, -1, -2)), tuple(range(count - 2, -1, -2)))}[buckets]
    total, scaling = layout.tokens, 1 / math.sqrt(8)
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, total, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    key = torch.randn(1, kv_heads, total, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    value = torch.randn(1, kv_heads, total, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    packed = segment_attention(query, key, value, layout.segments, scaling=scaling, buckets=buckets)  # [1, T, h, d]
    dense = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=dense_mask(layout), scale=scaling, enable_gqa=kv_heads != 4).transpose(1, 2)
    torch.testing.assert_close(packed, dense)
    torch.testing.assert_close(packed.detach(), loop_attention(query.detach(), key.detach(), value.detach(),
                                                               dense_mask(layout), scaling))
    weights = torch.randn(packed.shape, generator=generator, dtype=torch.float64)
    gradients = torch.autograd.grad((packed * weights).sum(), (query, key, value))
    expected = torch.autograd.grad((dense * weights).sum(), (query, key, value))
    for got, want in zip(gradients, expected, strict=True):
        torch.testing.assert_close(got, want)


def test_segment_buckets_minimise_padded_work_plus_a_cost_per_call():
    # (start, end, prefix_start, prefix_end): queries 2, 2, 10, 10, keys 2, 2, 10, 30 (the last has a 20-token prefix)
    segments = ((0, 2, 0, 0), (2, 4, 0, 0), (4, 14, 0, 0), (14, 24, 100, 120))
    # call cost 0: each alone costs 2*2 + 2*2 + 10*10 + 10*30 = 408; the two short ones together 2*2*2 = 8 as well,
    # so the tie keeps the longer run; the two long ones together 2*10*30 = 600 > 100 + 300
    assert segment_buckets(segments, 0) == ((0, 1), (2,), (3,))
    # call cost 1000: one call, 4 x 10 x 30 = 1200 + 1000, beats any split (at least 2000 in calls alone + work)
    assert segment_buckets(segments, 1000) == ((0, 1, 2, 3),)
    # call cost 150: [short, short] [long] [longer] = 8 + 100 + 300 + 450 = 858; [short, short, long] [longer]
    # = 3 * 10 * 10 + 300 + 300 = 900; [short, short] [long, longer] = 8 + 600 + 300 = 908; one: 1200 + 150
    assert segment_buckets(segments, 150) == ((0, 1), (2,), (3,))
    assert segment_buckets(segments, 200) == ((0, 1, 2), (3,))  # 300 + 300 + 400 = 1000 against 1008 and 1050


def test_varlen_keys_list_each_segments_prefix_then_itself():
    layout = pack_layout(PROMPT_MASK, PROMPT_INDEX, COMPLETION_MASK, prompt_once=True)
    index, cu_q, cu_k, max_q, max_k = varlen_keys(layout.segments, "cpu")
    assert index.tolist() == [0, 1, 0, 1, 2, 3, 0, 1, 4, 5, 6, 7, 5, 6, 7, 8, 9]
    assert cu_q.tolist() == [0, 2, 4, 5, 8, 10] and cu_k.tolist() == [0, 2, 6, 9, 12, 17]
    assert (max_q, max_k) == (3, 5)
