"""The other tensor-parallel ranks: worker processes (`mp`) or Ray actors (`ray`) that each hold a slice
of the language model and run every step in lockstep with rank 0 (this process)."""

from __future__ import annotations

from ....config import ModelConfig, ParallelConfig
from .base import WorkerGroup


def start_workers(model_config: ModelConfig, parallel_config: ParallelConfig) -> WorkerGroup:
    """Start ranks 1..tensor_parallel_size-1 on the configured backend and join their group as rank 0."""
    if parallel_config.distributed_executor_backend == "ray":
        from .ray_workers import RayWorkers

        return RayWorkers(model_config, parallel_config)
    from .mp_workers import MultiprocWorkers

    return MultiprocWorkers(model_config, parallel_config)


__all__ = ["WorkerGroup", "start_workers"]
