"""Tensor parallelism in tests: gloo groups inside one process (one thread per rank, each with its own
process group over a local TCPStore; gloo releases the GIL, so the ranks' collectives meet), and the
logits an engine samples from, to compare a tensor-parallel engine with a single-rank one."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from tessera.distributed import TensorParallelGroup, create_store, init_tensor_parallel_group


def thread_groups(world_size: int) -> list[TensorParallelGroup]:
    """`world_size` joined gloo groups, rank order."""
    master = create_store("127.0.0.1", 0, world_size, is_master=True, timeout_s=60)
    stores = [master] + [
        create_store("127.0.0.1", master.port, world_size, is_master=False, timeout_s=60) for _ in range(1, world_size)
    ]
    with ThreadPoolExecutor(world_size) as pool:
        futures = [
            pool.submit(init_tensor_parallel_group, store, rank, world_size, timeout_s=60)
            for rank, store in enumerate(stores)
        ]
        return [f.result() for f in futures]


def run_on_ranks(groups: list[TensorParallelGroup], fn: Callable[[TensorParallelGroup], Any]) -> list[Any]:
    """fn(group) on every rank at once (one thread each); the results in rank order."""
    with ThreadPoolExecutor(len(groups)) as pool:
        return [f.result(timeout=60) for f in [pool.submit(fn, group) for group in groups]]


@contextlib.contextmanager
def recorded_logits() -> Iterator[list[torch.Tensor]]:
    """Every logits tensor rank 0 samples from, step by step, while inside."""
    from tessera.engine.core import model_runner

    steps: list[torch.Tensor] = []
    sample = model_runner.sample

    def recording(logits, *args, **kwargs):
        steps.append(logits.detach().clone())
        return sample(logits, *args, **kwargs)

    model_runner.sample = recording
    try:
        yield steps
    finally:
        model_runner.sample = sample


def generate_recording(llm: Any, prompts: list, params: Any) -> tuple[list[list[int]], list[torch.Tensor]]:
    """(each prompt's generated tokens, the logits of every step) of `llm.generate(prompts, params)`."""
    with recorded_logits() as steps:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], steps


def assert_same_logits(expected: list[torch.Tensor], actual: list[torch.Tensor], atol: float = 1e-4) -> None:
    """Step by step, the same logits shapes and values within `atol`."""
    assert len(actual) == len(expected), f"{len(actual)} steps sampled, expected {len(expected)}"
    for step, (want, got) in enumerate(zip(expected, actual)):
        assert got.shape == want.shape, f"step {step}: logits {tuple(got.shape)}, expected {tuple(want.shape)}"
        torch.testing.assert_close(got, want, rtol=0, atol=atol, msg=lambda m: f"step {step}: {m}")
