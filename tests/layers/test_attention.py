"""Paged attention against plain causal attention computed from its definition."""

from __future__ import annotations

import pytest
import torch

from tessera.layers.attention import AttentionMetadata, PagedAttention, attention_metadata

H, HKV, D = 4, 2, 8


def reference(q, k, v, scale):
    """Causal attention of one whole sequence: q [L, H, D], k/v [L, Hkv, D] -> [L, H, D]."""
    k = k.repeat_interleave(H // HKV, dim=1)
    v = v.repeat_interleave(H // HKV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    length = q.shape[0]
    scores = scores.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def make_layer(num_blocks=32, block_size=4):
    layer = PagedAttention(H, D, HKV, scale=D**-0.5)
    layer.k_cache = torch.zeros(num_blocks, HKV, block_size, D)
    layer.v_cache = torch.zeros(num_blocks, HKV, block_size, D)
    return layer


def random_qkv(length, seed):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(length, H, D, generator=g),
        torch.randn(length, HKV, D, generator=g),
        torch.randn(length, HKV, D, generator=g),
    )


def run(layer, pieces, block_tables, block_size=4):
    """pieces: per sequence (q, k, v, context_len) of the new tokens; one forward for all."""
    metadata = AttentionMetadata.build(
        [p[0].shape[0] for p in pieces], [p[3] for p in pieces], block_tables, block_size
    )
    q, k, v = (torch.cat([p[i] for p in pieces]) for i in range(3))
    with attention_metadata(metadata):
        return layer(q, k, v).split([p[0].shape[0] for p in pieces])


def test_slot_mapping_follows_the_block_tables():
    metadata = AttentionMetadata.build([3, 1], [6, 5], [[7, 2], [4, 9]], block_size=4)
    # seq 0: new tokens 3..5 -> block 7 slot 3, block 2 slots 0-1; seq 1: token 4 -> block 9 slot 0
    assert metadata.slot_mapping.tolist() == [7 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 9 * 4 + 0]
    assert metadata.context_blocks[1].tolist() == [4, 9]


def test_too_few_blocks_is_an_error():
    with pytest.raises(ValueError, match="cannot hold 9 tokens"):
        AttentionMetadata.build([9], [9], [[0, 1]], block_size=4)


def test_prefill_of_several_sequences_in_one_forward():
    layer = make_layer()
    seqs = [random_qkv(n, seed=n) for n in (5, 1, 9)]
    tables = [[0, 1], [2], [3, 4, 5]]
    outs = run(layer, [(q, k, v, q.shape[0]) for q, k, v in seqs], tables)
    for (q, k, v), out in zip(seqs, outs):
        torch.testing.assert_close(out, reference(q, k, v, D**-0.5), atol=1e-5, rtol=0)


def test_chunks_and_decode_tokens_attend_to_the_cached_prefix():
    layer = make_layer()
    q, k, v = random_qkv(12, seed=0)
    expected = reference(q, k, v, D**-0.5)
    table = [5, 1, 8]  # non-contiguous blocks
    other_q, other_k, other_v = random_qkv(3, seed=1)
    outs = []
    for start, end in [(0, 5), (5, 8), (8, 11), (11, 12)]:  # chunks, then one decode token
        # a second, unrelated sequence rides along in every step: it must not disturb the first
        result = run(
            layer, [(q[start:end], k[start:end], v[start:end], end), (other_q, other_k, other_v, 3)], [table, [20]]
        )
        outs.append(result[0])
        torch.testing.assert_close(result[1], reference(other_q, other_k, other_v, D**-0.5), atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat(outs), expected, atol=1e-5, rtol=0)


def test_missing_metadata_or_cache_is_a_clear_error():
    q, k, v = random_qkv(2, seed=0)
    with pytest.raises(RuntimeError, match="attention metadata"):
        make_layer()(q, k, v)
    with pytest.raises(RuntimeError, match="not allocated"):
        with attention_metadata(AttentionMetadata.build([2], [2], [[0]], 4)):
            PagedAttention(H, D, HKV, scale=1.0)(q, k, v)
