"""Tensor parallelism's process group: which rank this process is, and the collectives the parallel
layers call (`parallel_state`)."""

from .parallel_state import (
    TensorParallelGroup,
    create_store,
    divide,
    get_tp_group,
    init_tensor_parallel_group,
    tensor_parallel_group,
)

__all__ = [
    "TensorParallelGroup",
    "create_store",
    "divide",
    "get_tp_group",
    "init_tensor_parallel_group",
    "tensor_parallel_group",
]
