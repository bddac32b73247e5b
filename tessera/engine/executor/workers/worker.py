"""What a tensor-parallel worker rank runs, in its own process or Ray actor: join the group, load its
slice of the model, then run each step's `ModelInputs` that rank 0 broadcasts, until it sends None."""

from __future__ import annotations

import logging
from typing import Optional

import torch

from ....config import ModelConfig
from ....distributed import create_store, init_tensor_parallel_group, tensor_parallel_group
from ....models.loader import load_model
from ...core.model_inputs import run_model
from ...core.model_runner import prepare_model_for_steps

logger = logging.getLogger(__name__)


def joined_key(rank: int) -> str:
    """The store key a worker sets before it joins the group (rank 0 waits for them, watching for deaths)."""
    return f"tessera/joined/{rank}"


def run_worker(
    rank: int,
    world_size: int,
    host: str,
    port: int,
    backend: str,
    model_config: ModelConfig,
    num_threads: Optional[int] = None,
) -> None:
    if num_threads:
        torch.set_num_threads(num_threads)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = create_store(host, port, world_size, is_master=False)
    store.set(joined_key(rank), "1")
    group = init_tensor_parallel_group(store, rank, world_size, backend=backend)
    with tensor_parallel_group(group):
        model = load_model(model_config)
    setup = group.broadcast_object()  # from ModelRunner: the KV cache's shape, as rank 0 sized it
    prepare_model_for_steps(model, setup["num_blocks"], setup["block_size"], setup["dtype"], model_config.device)
    logger.info("Tensor-parallel rank %d/%d ready", rank, world_size)
    while (inputs := group.broadcast_object()) is not None:
        run_model(model, inputs, setup["block_size"], model_config.device)
