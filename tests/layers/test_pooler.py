"""Pooling final hidden states, from first principles: which rows, the Matryoshka cut before the L2 norm, and the
sentence-transformers files that say how a folder pools."""

from __future__ import annotations

import json

import pytest
import torch

from tessera.layers.pooler import pool
from tessera.pooling_params import PoolerConfig, PoolingParams

HIDDEN = torch.tensor([[3.0, 4.0, 0.0], [1.0, 0.0, 0.0], [0.0, 2.0, 2.0]])


@pytest.mark.parametrize(
    "kind, expected",
    [("LAST", [0.0, 2.0, 2.0]), ("CLS", [3.0, 4.0, 0.0]), ("MEAN", [4 / 3, 2.0, 2 / 3])],
)
def test_each_pooling_type_picks_its_rows(kind, expected):
    raw = pool(HIDDEN, PoolerConfig(kind, normalize=False))
    torch.testing.assert_close(raw, torch.tensor(expected))
    normed = pool(HIDDEN, PoolerConfig(kind))
    torch.testing.assert_close(normed, torch.tensor(expected) / torch.tensor(expected).norm())


def test_all_keeps_every_token_and_normalizes_each():
    out = pool(HIDDEN, PoolerConfig("ALL"))
    assert out.shape == (3, 3)
    torch.testing.assert_close(out.norm(dim=-1), torch.ones(3))


def test_dimensions_cut_before_normalizing_and_the_request_overrides_normalize():
    out = pool(HIDDEN, PoolerConfig("CLS"), PoolingParams(dimensions=2))
    torch.testing.assert_close(out, torch.tensor([0.6, 0.8]))
    raw = pool(HIDDEN, PoolerConfig("CLS"), PoolingParams(normalize=False))
    torch.testing.assert_close(raw, HIDDEN[0])
    with pytest.raises(ValueError, match="dimensions 4 exceeds"):
        pool(HIDDEN, PoolerConfig(), PoolingParams(dimensions=4))
    with pytest.raises(ValueError, match="positive integer"):
        PoolingParams(dimensions=0)


def test_a_sentence_transformers_folder_says_how_it_pools(tmp_path):
    assert PoolerConfig.from_folder(str(tmp_path)) == PoolerConfig("LAST", normalize=True)  # no modules.json
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    modules = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]  # fmt: skip
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    assert PoolerConfig.from_folder(str(tmp_path)) == PoolerConfig("MEAN", normalize=False)
    modules.append({"idx": 2, "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    assert PoolerConfig.from_folder(str(tmp_path)) == PoolerConfig("MEAN", normalize=True)
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        PoolerConfig("MAX")


def test_similarity_is_the_cosine_or_late_interaction():
    from tessera.layers.pooler import similarity

    assert similarity(torch.tensor([1.0, 0.0]), torch.tensor([3.0, 3.0])) == pytest.approx(2**-0.5)
    query = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    document = torch.tensor([[0.5, 0.1], [0.2, 0.9], [0.7, 0.0]])
    # MaxSim: query row 0's best is 0.7 (row 2), row 1's is 0.9 (row 1)
    assert similarity(query, document) == pytest.approx(0.7 + 0.9)
    with pytest.raises(ValueError, match="both multi-vector"):
        similarity(query, torch.tensor([1.0, 0.0]))
