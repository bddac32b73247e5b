"""An engine core in this process: its tensor-parallel worker ranks started first (if the configuration has
more than one rank), then the `EngineCore` over them."""

from __future__ import annotations

from typing import Optional

from ...config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from ...models.loader import check_class_tensor_parallel
from ..core.engine_core import EngineCore
from .workers import WorkerGroup, start_workers


def start_core(
    model_config: ModelConfig,
    cache_config: Optional[CacheConfig] = None,
    scheduler_config: Optional[SchedulerConfig] = None,
    parallel_config: Optional[ParallelConfig] = None,
) -> EngineCore:
    parallel_config = parallel_config or ParallelConfig()
    workers: Optional[WorkerGroup] = None
    if parallel_config.tensor_parallel_size > 1:
        check_class_tensor_parallel(model_config, parallel_config.tensor_parallel_size)  # before any worker starts
        workers = start_workers(model_config, parallel_config)
    return EngineCore(model_config, cache_config, scheduler_config, parallel_config, workers=workers)
