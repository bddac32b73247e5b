"""The tensor-parallel group: torch.distributed's gloo (CPU) or NCCL (CUDA) process group over the ranks
that each hold a slice of the language model's weights and KV cache.

The group is an explicit object, not torch.distributed's global default group: the driver process
(rank 0, where the scheduler runs) may be a user's Python process holding several engines. Parallel
layers read the current group once, when they are built (`tensor_parallel_group(group)` around the
model's construction), and keep it; a model built outside that context is a single rank and runs no
collective.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import os
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

# How long a collective waits for a rank that neither answers nor dies (a dead rank's closed
# connection fails the collective at once). Long enough for the driver's vision encoder and the
# first step's allocations, short enough that a stuck worker does not hang a server forever.
DEFAULT_TIMEOUT_S = float(os.environ.get("TESSERA_DISTRIBUTED_TIMEOUT", "600"))


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    world_size: int = 1
    process_group: Optional[Any] = None  # a c10d ProcessGroup when world_size > 1
    backend: str = "none"

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it."""
        if self.world_size > 1:
            self.process_group.allreduce([tensor]).wait()
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `tensor` (equal shapes), concatenated along `dim` in rank order."""
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.process_group.allgather([parts], [tensor]).wait()
        return torch.cat(parts, dim=dim)

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """`obj` as rank `src` has it, on every rank (pickled; tensors travel by value)."""
        if self.world_size == 1:
            return obj
        device = "cuda" if self.backend == "nccl" else "cpu"
        if self.rank == src:
            payload = torch.frombuffer(
                bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8
            )
            size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
        else:
            size = torch.zeros(1, dtype=torch.int64, device=device)
        self._broadcast(size, src)
        if self.rank != src:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        data = payload.to(device)
        self._broadcast(data, src)
        return obj if self.rank == src else pickle.loads(data.cpu().numpy().tobytes())

    def _broadcast(self, tensor: torch.Tensor, src: int) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = src
        self.process_group.broadcast([tensor], options).wait()


SINGLE_RANK = TensorParallelGroup()
_current: contextvars.ContextVar[TensorParallelGroup] = contextvars.ContextVar("tessera_tp_group", default=SINGLE_RANK)


def get_tp_group() -> TensorParallelGroup:
    """The group layers being built now belong to (a single rank outside `tensor_parallel_group`)."""
    return _current.get()


@contextlib.contextmanager
def tensor_parallel_group(group: TensorParallelGroup) -> Iterator[TensorParallelGroup]:
    """Build a model's layers for `group` (each layer keeps the group it was built with); per thread."""
    token = _current.set(group)
    try:
        yield group
    finally:
        _current.reset(token)


def create_store(host: str, port: int, world_size: int, *, is_master: bool, timeout_s: float = DEFAULT_TIMEOUT_S):
    """The rendezvous key-value store rank 0 serves (port 0: any free port, read back from `.port`)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(host, port, world_size, is_master=is_master, timeout=timeout, wait_for_workers=False)


def init_tensor_parallel_group(
    store: Any, rank: int, world_size: int, *, backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S
) -> TensorParallelGroup:
    """Join the group of `world_size` ranks meeting at `store` (blocks until every rank has joined).
    `backend`: "gloo" (CPU tensors) or "nccl" (CUDA tensors)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    elif backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, world_size, options)
    else:
        raise ValueError(f"Unsupported distributed backend {backend!r}; use gloo (CPU) or nccl (CUDA)")
    return TensorParallelGroup(rank, world_size, group, backend)


def divide(numerator: int, denominator: int, what: str) -> int:
    """numerator / denominator, or a ValueError naming `what` when it does not divide evenly."""
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator}); "
            "choose a tensor_parallel_size that divides it."
        )
    return numerator // denominator
