"""Weights from a GGUF file (llama.cpp's format), for `tessera.models.loader`.

transformers de-quantizes them (`load_gguf_checkpoint`, through the `gguf` package: Q4_1, Q8_0,
K-quants... become float tensors) and names them as the state dict of its own model class: it maps
llama.cpp's names (``blk.0.attn_q.weight``) onto the parameters of a model built from the converted
config (``model.layers.0.self_attn.q_proj.weight``) and undoes llama.cpp's reordering of the Llama
q / k rows. The model here is built on the meta device (names and shapes, no memory), of the class
`AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)` builds, so the tensors are exactly the
ones HF runs. Tessera's models mirror HF's module names, so the loader then checks every name and
shape and fuses q/k/v and gate/up as for a safetensors checkpoint; a tied output layer (no
``output.weight`` in the file, ``tie_word_embeddings``) is the embedding.

transformers skips a file's tensors that its mapping does not place; here they are an error, except
the ones llama.cpp precomputes (`IGNORED_GGUF_TENSORS`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch
from transformers import PretrainedConfig

from ..gguf_file import read_gguf_metadata, unreadable_gguf
from ..gguf_reading import ARCHITECTURE_ALIASES, gguf_reader, transformers_reading
from ..layers.gguf_blocks import QuantizedBlocks, decode_blocks

IGNORED_GGUF_TENSORS = frozenset({"rope_freqs.weight"})
"""llama.cpp's precomputed Llama 3 rope frequency factors: the rotary embedding comes from the config
(transformers skips them too)."""


def iter_gguf_checkpoint(
    path: Union[str, Path],
    hf_config: PretrainedConfig,
    dtype: Optional[torch.dtype] = None,
    blocks: Optional[dict[str, QuantizedBlocks]] = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF parameter name, de-quantized tensor) for every tensor of the GGUF file at `path`, whose
    converted config is `hf_config`; tensors are cast to `dtype` if given. If `blocks` is given, it also
    gets (HF name -> QuantizedBlocks) for every quantized matrix whose type `gguf_blocks` decodes, in the
    row order of the de-quantized tensor."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    path = Path(path)
    with torch.device("meta"):  # only the parameter names matter
        shell = _NameShell(AutoModelForCausalLM.from_config(hf_config))
    metadata = read_gguf_metadata(path)
    architecture = ARCHITECTURE_ALIASES.get(metadata.architecture, metadata.architecture)
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=hf_config.to_dict())
    placed = get_gguf_hf_weights_map(shell, processor)
    unplaced = [name for name in metadata.tensor_names if name not in placed and name not in IGNORED_GGUF_TENSORS]
    if unplaced:
        shown = ", ".join(unplaced[:8]) + (f" and {len(unplaced) - 8} more" if len(unplaced) > 8 else "")
        raise ValueError(
            f"Tensors of {path} that transformers' GGUF conversion gives no place in {shell.class_name}: {shown}."
        )
    try:
        with transformers_reading():
            parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=shell, torch_dtype=dtype)
    except Exception as e:
        raise unreadable_gguf(path, e) from e
    if blocks is not None:
        blocks.update(_quantized_blocks(path, processor, placed))
    yield from parsed["tensors"].items()


def _quantized_blocks(path: Path, processor, placed: dict[str, str]) -> Iterator[tuple[str, QuantizedBlocks]]:
    """(HF name, blocks) of the file's decodable quantized matrices. transformers' tensor processor may reorder a
    de-quantized tensor's rows (Llama's q / k: llama.cpp interleaves the rotary halves); it is run on the row
    numbers to get the same order. A matrix it changes otherwise (values, shape) is left to de-quantizing."""
    for tensor in gguf_reader(path).tensors:
        shape = [int(n) for n in reversed(tensor.shape)]  # GGUF lists dimensions innermost first
        if len(shape) != 2 or tensor.name not in placed:
            continue
        decoded = decode_blocks(tensor.tensor_type.name, tensor.data, shape[1])
        if decoded is None:
            continue
        rows = np.arange(shape[0], dtype=np.float64)[:, None]
        result = processor.process(weights=rows, name=tensor.name, tensor_key_mapping=placed,
                                   parsed_parameters={"config": processor.config, "tensors": {}})  # fmt: skip
        order = getattr(result, "weights", None)
        if result is None or getattr(result, "name", None) != tensor.name or not isinstance(order, np.ndarray):
            continue
        if order.shape != rows.shape or not np.array_equal(np.sort(order[:, 0]), rows[:, 0]):
            continue
        yield placed[tensor.name], decoded.rows(torch.from_numpy(order[:, 0].astype(np.int64)))


class _NameShell:
    """What transformers' GGUF name mapping (`get_gguf_hf_weights_map`) reads of a model: its config
    and its state-dict names. The mapping also walks every submodule, rebuilding gguf's name table
    for each (seconds for a 30-layer model) to find names a model's top level does not give; a
    causal LM's full names (``model.layers.N...``, ``lm_head``) are the ones the table holds, so the
    walk stops here. A tensor left unplaced is an error in `iter_gguf_checkpoint`, never skipped."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.config = model.config
        self.class_name = type(model).__name__
        self._names = dict.fromkeys(model.state_dict())

    def state_dict(self) -> dict[str, None]:
        return self._names

    def named_children(self) -> list:
        return []
