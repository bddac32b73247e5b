"""Embedding and LM head split by vocabulary rows over two gloo ranks (a thread each), with a vocabulary
that does not divide evenly (the last rank's rows padded): the same outputs as the whole layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.distributed import tensor_parallel_group
from tessera.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from testkit.distributed import run_on_ranks, thread_groups

VOCAB, DIM = 11, 4


@pytest.fixture(scope="module")
def groups():
    return thread_groups(2)


def sharded(groups, cls, weight):
    layers = []
    for group in groups:
        with tensor_parallel_group(group):
            layer = cls(*((VOCAB, DIM) if cls is VocabParallelEmbedding else (DIM, VOCAB)))
        layer.weight.data.copy_(layer.shard_weight("weight", weight))
        layers.append(layer)
    return layers


def test_each_rank_holds_its_rows_padded_to_equal_size(groups):
    weight = torch.randn(VOCAB, DIM)
    first, last = sharded(groups, VocabParallelEmbedding, weight)
    assert first.weight.shape == last.weight.shape == (6, DIM)
    assert torch.equal(first.weight, weight[:6]) and torch.equal(last.weight[:5], weight[6:])
    assert torch.equal(last.weight[5], torch.zeros(DIM))


def test_embedding_looks_up_every_id(groups):
    weight = torch.randn(VOCAB, DIM)
    layers = sharded(groups, VocabParallelEmbedding, weight)
    ids = torch.tensor([0, 5, 6, 10, 3, 6])
    for out in run_on_ranks(groups, lambda g: layers[g.rank](ids)):
        assert torch.equal(out, F.embedding(ids, weight))


def test_lm_head_gathers_the_whole_vocabulary(groups):
    weight = torch.randn(VOCAB, DIM)
    layers = sharded(groups, ParallelLMHead, weight)
    hidden = torch.randn(3, DIM)
    for out in run_on_ranks(groups, lambda g: layers[g.rank](hidden)):
        assert out.shape == (3, VOCAB)
        torch.testing.assert_close(out, hidden @ weight.T, rtol=0, atol=1e-6)


def test_one_rank_is_the_plain_layer():
    embedding, head = VocabParallelEmbedding(VOCAB, DIM), ParallelLMHead(DIM, VOCAB)
    assert embedding.weight.shape == (VOCAB, DIM) and head.weight.shape == (VOCAB, DIM)
    ids = torch.tensor([1, 10])
    assert torch.equal(embedding(ids), F.embedding(ids, embedding.weight))
