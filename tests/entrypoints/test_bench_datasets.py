"""The prompts of `tessera bench serve`."""

from __future__ import annotations

from tessera.entrypoints import bench_datasets


def test_random_mm_prompts_are_reproducible():
    a = bench_datasets.random_mm_prompts(3, [(32, 16)], 5, seed=1)
    b = bench_datasets.random_mm_prompts(3, [(32, 16)], 5, seed=1)
    assert a == b and all(p.image_url.startswith("data:image/jpeg;base64,") and p.max_tokens == 5 for p in a)
    assert a != bench_datasets.random_mm_prompts(3, [(32, 16)], 5, seed=2)
