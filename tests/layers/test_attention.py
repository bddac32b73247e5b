"""Paged attention against attention computed from its definition: causal, sliding windows,
bidirectional spans, logit soft-capping."""

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
    layer.k_cache = torch.zeros(layer.cache_shape(num_blocks, block_size))
    layer.v_cache = torch.zeros(layer.cache_shape(num_blocks, block_size))
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


# --- Sliding windows, bidirectional spans, logit soft-capping ------------------------------------
#
# The reference: one whole sequence in fp64, the full [L, L] score matrix, and a mask written out
# position by position from the rules (HF transformers 5.23): a query at p sees a key at p' iff
# (p' <= p or p and p' lie in one span) and, on a layer with window W, p' > p - W.


def rule_mask(length, window=None, spans=()):
    allowed = torch.zeros(length, length, dtype=torch.bool)
    for p in range(length):
        for key in range(length):
            same_span = any(start <= p < end and start <= key < end for start, end in spans)
            visible = key <= p or same_span
            if window is not None:
                visible = visible and key > p - window
            allowed[p, key] = visible
    return allowed


def full_reference(q, k, v, window=None, spans=(), soft_cap=None):
    """One whole sequence: q [L, H, D], k/v [L, Hkv, D] -> [L, H, D], in fp64."""
    q, k, v = q.double(), k.double().repeat_interleave(H // HKV, dim=1), v.double().repeat_interleave(H // HKV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * D**-0.5
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    scores = scores.masked_fill(~rule_mask(q.shape[0], window, spans), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


VARIANTS = [
    {},
    {"sliding_window": 1},
    {"sliding_window": 3},
    {"sliding_window": 4},
    {"sliding_window": 5},
    {"sliding_window": 100},  # larger than every context
    {"logits_soft_cap": 0.8},
    {"sliding_window": 3, "logits_soft_cap": 0.8},
]


def variant_layer(variant, num_blocks=64, block_size=4):
    layer = PagedAttention(H, D, HKV, scale=D**-0.5, **variant)
    layer.k_cache = torch.zeros(layer.cache_shape(num_blocks, block_size))
    layer.v_cache = torch.zeros(layer.cache_shape(num_blocks, block_size))
    return layer


def expected(seq, variant):
    q, k, v = seq["qkv"]
    return full_reference(q, k, v, variant.get("sliding_window"), seq.get("spans", ()), variant.get("logits_soft_cap"))


def make_seqs(lengths, spans=None, seed=0):
    """Sequences with random q/k/v and non-contiguous block tables (block size 4) out of one pool."""
    pool = torch.randperm(60, generator=torch.Generator().manual_seed(seed)).tolist()
    seqs = []
    for i, length in enumerate(lengths):
        table = [pool.pop() for _ in range(-(-length // 4))]
        seqs.append({"qkv": random_qkv(length, seed=seed * 100 + i), "table": table, "spans": (spans or {}).get(i, [])})
    return seqs


def simulate(layers, seqs, steps, done=None, block_size=4):
    """Runs a schedule, `steps` a list of {sequence: new tokens}, through a stack of layers that
    share one metadata per step (as a model's layers do). Returns [layer][sequence] output rows."""
    done = list(done or [0] * len(seqs))
    outs = [[[] for _ in seqs] for _ in layers]
    use_spans = any(seq["spans"] for seq in seqs)
    for step in steps:
        ids = list(step)
        query_lens = [step[i] for i in ids]
        context_lens = [done[i] + step[i] for i in ids]
        metadata = AttentionMetadata.build(
            query_lens,
            context_lens,
            [seqs[i]["table"] for i in ids],
            block_size,
            bidirectional_spans=[seqs[i]["spans"] for i in ids] if use_spans else None,
        )
        q, k, v = (torch.cat([seqs[i]["qkv"][n][done[i] : done[i] + step[i]] for i in ids]) for n in range(3))
        with attention_metadata(metadata):
            for layer, layer_outs in zip(layers, outs):
                for i, out in zip(ids, layer(q, k, v).split(query_lens)):
                    layer_outs[i].append(out)
        for i in ids:
            done[i] += step[i]
    return [[torch.cat(rows) if rows else None for rows in layer_outs] for layer_outs in outs]


def check(seqs, steps, done=None, variants=VARIANTS):
    layers = [variant_layer(variant) for variant in variants]
    outs = simulate(layers, seqs, steps, done)
    for variant, layer_outs in zip(variants, outs):
        for i, (seq, out) in enumerate(zip(seqs, layer_outs)):
            want = expected(seq, variant)[(done or [0] * len(seqs))[i] :]
            torch.testing.assert_close(out, want, atol=1e-5, rtol=0, msg=lambda m: f"{variant}, sequence {i}: {m}")


def test_whole_prompts_with_windows_and_soft_cap():
    check(make_seqs([5, 1, 9, 13]), [{0: 5, 1: 1, 2: 9, 3: 13}])


def test_chunks_decode_batches_and_mixed_steps():
    seqs = make_seqs([15, 12, 13, 13], seed=1)
    steps = [
        {0: 13, 1: 5},  # a whole prompt and a first chunk
        {0: 1, 1: 3, 2: 9},  # decode + a chunk after cached tokens + a whole prompt
        {0: 1, 1: 3, 2: 1, 3: 6},  # the chunk crosses a block boundary
        {1: 1, 2: 1, 3: 7},
        {2: 1},
        {2: 1},
    ]
    assert [sum(s.get(i, 0) for s in steps) for i in range(4)] == [15, 12, 13, 13]
    check(seqs, steps)


def test_a_decode_batch_over_many_steps():
    seqs = make_seqs([11, 12, 13, 16, 20], seed=2)
    prompts = {0: 3, 1: 4, 2: 5, 3: 8, 4: 12}
    steps = [prompts] + [{i: 1 for i in range(5)} for _ in range(8)]
    check(seqs, steps)


def test_a_lone_sequence_decodes_over_many_steps():
    # batch-1 decode slices the keys it sees out of the gathered blocks instead of masking them
    check(make_seqs([19], seed=8), [{0: 5}] + [{0: 1}] * 14)


SPANS = {0: [(2, 7), (9, 12)], 1: [(0, 4)], 3: [(4, 13)]}  # across block boundaries, longer than windows


def test_whole_prompts_with_bidirectional_spans():
    seqs = make_seqs([14, 9, 6, 16], spans=SPANS, seed=3)
    check(seqs, [{0: 14, 1: 9, 2: 6, 3: 16}])


def test_chunks_and_decode_with_bidirectional_spans():
    seqs = make_seqs([16, 9, 6, 18], spans=SPANS, seed=4)
    steps = [
        {0: 2, 1: 4},  # seq 1: chunk == its span
        {0: 5, 1: 3, 2: 6},  # seq 0: chunk == span [2, 7)
        {0: 5, 1: 1, 3: 4},  # seq 0: [7, 12) holds span [9, 12) and text before it
        {0: 2, 3: 9},  # seq 3: span [4, 13) after 4 cached tokens
        {0: 1, 1: 1, 3: 1},
        {0: 1, 3: 4},
    ]
    assert [sum(s.get(i, 0) for s in steps) for i in range(4)] == [16, 9, 6, 18]
    check(seqs, steps)


def test_a_chunk_starting_inside_a_span_after_a_prefix_cache_hit():
    # Sequence 0 computes the whole prompt; sequence 1 has the same tokens, shares its first two full
    # blocks (positions 0-7) and computes from 8 on: inside span [6, 11), whose tokens 6 and 7 are cached.
    seqs = make_seqs([14], spans={0: [(6, 11)]}, seed=5)
    twin = dict(seqs[0], table=seqs[0]["table"][:2] + [61, 62])
    check([seqs[0], twin], [{0: 14}, {1: 4}, {1: 1}, {1: 1}], done=[0, 8])
    # with a window, the cached span-mates drop out of view as for any earlier key
    check([seqs[0], twin], [{0: 14}, {1: 6}], done=[0, 8], variants=[{"sliding_window": 2}, {"sliding_window": 3}])


def test_the_window_changes_the_output_for_a_longer_context():
    seq = make_seqs([12], seed=6)[0]
    q, k, v = seq["qkv"]
    plain = full_reference(q, k, v)
    ((windowed,),) = simulate([variant_layer({"sliding_window": 3})], [seq], [{0: 11}, {0: 1}])  # prompt, decode
    torch.testing.assert_close(windowed, full_reference(q, k, v, window=3), atol=1e-5, rtol=0)
    torch.testing.assert_close(windowed[:3], plain[:3], atol=1e-5, rtol=0)  # the window covers their context
    assert (windowed[3:] - plain[3:]).abs().amax(dim=(1, 2)).min() > 1e-3  # every later row differs


def test_soft_cap_and_spans_change_the_output():
    seq = make_seqs([10], spans={0: [(2, 8)]}, seed=7)[0]
    q, k, v = seq["qkv"]
    ((out,),) = simulate([variant_layer({"logits_soft_cap": 0.5})], [seq], [{0: 10}])
    torch.testing.assert_close(out, full_reference(q, k, v, spans=[(2, 8)], soft_cap=0.5), atol=1e-5, rtol=0)
    assert (out - full_reference(q, k, v, spans=[(2, 8)])).abs().max() > 1e-2
    assert (out[2:7] - full_reference(q, k, v, soft_cap=0.5)[2:7]).abs().amax(dim=(1, 2)).min() > 1e-3


def test_windowed_steps_gather_only_the_window():
    metadata = AttentionMetadata.build([1, 1, 6], [13, 3, 14], [[0, 1, 2, 3], [4], [5, 6, 7, 8]], block_size=4)
    tables, mask = metadata.decode_tables(5)
    assert tables.tolist() == [[2, 3], [4, 4]]  # positions 8-12 of [0, 1, 2, 3]; 0-2 of [4]
    assert mask.tolist() == [[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]]
    assert metadata.decode_tables(None)[0].shape[1] == 4
    assert metadata.decode_tables(13)[0] is metadata.decode_block_tables  # covers every context
    # the visible keys among the gathered positions: 8-12 of [2, 3] -> 0-4; 0-2 of [4, 4] -> 0-2
    assert metadata.decode_visible(5) == [(0, 5), (0, 3)]
    assert metadata.decode_visible(None) == [(0, 13), (0, 3)]
    assert metadata.decode_visible(3) == [(2, 5), (0, 3)]  # keys 10-12: offsets 2-4 of blocks [2, 3]
    key_start, mask = metadata.prefill_mask(2, 3)  # queries at 8..13 see keys from 6 on
    assert key_start == 6 and mask.shape == (6, 8)
    assert metadata.prefill_mask(2, 3)[1] is mask  # built once per window for all layers
    assert metadata.prefill_mask(2, 14) == (0, None)  # a window covering the context: plain causal


def test_spans_that_change_nothing_keep_the_plain_path():
    # seq 0: span wholly cached; seq 1: span in the future; seq 2: a single-token span
    metadata = AttentionMetadata.build(
        [4, 4, 4], [8, 4, 4], [[0, 1], [2], [3]], 4, bidirectional_spans=[[(1, 4)], [(5, 9)], [(2, 3)]]
    )
    assert metadata.bidirectional_spans == []
    assert metadata.prefill_mask(0) == (0, None)
    metadata = AttentionMetadata.build([4, 4], [8, 4], [[0, 1], [2]], 4, bidirectional_spans=[[(1, 4)], [(1, 3)]])
    assert metadata.bidirectional_spans == [[], [(1, 3)]]


def test_bad_spans_and_arguments_are_errors():
    with pytest.raises(ValueError, match="inside bidirectional span"):
        AttentionMetadata.build([5], [5], [[0, 1]], 4, bidirectional_spans=[[(3, 7)]])
    with pytest.raises(ValueError, match="inside bidirectional span"):  # a decode token too
        AttentionMetadata.build([1], [5], [[0, 1]], 4, bidirectional_spans=[[(3, 7)]])
    with pytest.raises(ValueError, match="overlap"):
        AttentionMetadata.build([8], [8], [[0, 1]], 4, bidirectional_spans=[[(1, 4), (3, 6)]])
    with pytest.raises(ValueError, match="non-empty"):
        AttentionMetadata.build([8], [8], [[0, 1]], 4, bidirectional_spans=[[(4, 4)]])
    with pytest.raises(ValueError, match="span lists"):
        AttentionMetadata.build([8], [8], [[0, 1]], 4, bidirectional_spans=[[], []])
    with pytest.raises(ValueError, match="sliding_window"):
        PagedAttention(H, D, HKV, 1.0, sliding_window=0)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        PagedAttention(H, D, HKV, 1.0, logits_soft_cap=0.0)


@pytest.mark.parametrize("window", [1, 3, 4, 5, 20])
@pytest.mark.parametrize("spans", [[], [(3, 8)], [(0, 2), (5, 11)]])
def test_masks_match_hf_gemma3(window, spans):
    """The masks the layers use against HF's own: Gemma 3's `create_masks_for_vision_model`
    (full layers: causal | blockwise; sliding layers: window & (causal | blockwise)) for a whole
    prompt; a chunk's or a decode token's mask must equal its rows of the whole prompt's."""
    pytest.importorskip("transformers")
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import (
        create_masks_for_vision_model,
        get_block_sequence_ids_for_mask,
    )

    length = 12
    config = Gemma3TextConfig(
        hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=1, num_key_value_heads=1,
        head_dim=8, vocab_size=16, sliding_window=window, layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    token_type_ids = torch.zeros(1, length, dtype=torch.long)
    for start, end in spans:
        token_type_ids[0, start:end] = 1  # Gemma 3 marks image tokens 1; a run of them is one span
    hf = create_masks_for_vision_model(
        config, torch.zeros(1, length, 8), None, None, torch.arange(length)[None],
        get_block_sequence_ids_for_mask(token_type_ids),
    )  # fmt: skip
    ours_by_layer = {"sliding_attention": window, "full_attention": None}
    for layer_type, layer_window in ours_by_layer.items():
        want = hf[layer_type][0, 0]
        assert torch.equal(want, rule_mask(length, layer_window, spans))  # our reference is HF's rule
        # whole prompt, and a chunk [4, 11) after cached tokens (starting inside span (3, 8) where present)
        for query_start, context_len in [(0, length), (4, 11), (8, length)]:
            metadata = AttentionMetadata.build(
                [context_len - query_start], [context_len], [[0, 1, 2]], 4, bidirectional_spans=[spans]
            )
            key_start, mask = metadata.prefill_mask(0, layer_window)
            if mask is None:  # plain causal
                mask = torch.ones(context_len - query_start, context_len, dtype=torch.bool).tril(query_start)
            ours = torch.zeros(context_len - query_start, context_len, dtype=torch.bool)
            ours[:, key_start:] = mask
            assert torch.equal(ours, want[query_start:context_len, :context_len]), (layer_type, query_start)
        # decode tokens at positions 11 and 8, where not strictly inside a span (the engine never
        # schedules those: `build` refuses them), one batch
        rows = [(12, [0, 1, 2]), (9, [3, 4, 5])]
        rows = [(n, table) for n, table in rows if not any(a <= n - 1 < b - 1 for a, b in spans)]
        metadata = AttentionMetadata.build(
            [1] * len(rows), [n for n, _ in rows], [table for _, table in rows], 4,
            bidirectional_spans=[spans] * len(rows),
        )  # fmt: skip
        tables, mask = metadata.decode_tables(layer_window)
        for row, (context_len, table) in enumerate(rows):
            visible = [
                table.index(block) * 4 + offset  # back to positions in the sequence
                for i, block in enumerate(tables[row].tolist())
                for offset in range(4)
                if mask[row, i * 4 + offset]
            ]
            assert visible == want[context_len - 1].nonzero().flatten().tolist(), (layer_type, context_len)
