"""Loading a PEFT LoRA adapter onto a model's language-model linears (layers/lora.py runs it).

A PEFT folder holds `adapter_config.json` (`r`, `lora_alpha`, `use_rslora`, `target_modules`) and
`adapter_model.safetensors` with, per adapted module, `base_model.model.<HF module path>.lora_A.weight` [r, in] and
`.lora_B.weight` [out, r]. Each HF module path is mapped as the checkpoint's own weights are (the model's prefix
renames, then the projections fused into one Linear: q/k/v into qkv_proj, gate/up into gate_up_proj, each taking
its rows). The update is scale * B @ A with scale = lora_alpha / r (/ sqrt(r) with rsLoRA), as PEFT computes it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from ..errors import InputError
from ..layers.linear import Linear
from ..layers.lora import LoRAPart
from ..lora.request import LoRARequest
from .loader import _rename, _shard_targets

PEFT_PREFIX = "base_model.model."


def load_lora(model: nn.Module, request: LoRARequest) -> list[str]:
    """Add the adapter's updates to the model's Linears under `request.lora_int_id`; the names of the layers it
    adapts (the language model's, and the vision tower's or projector's where the adapter has them).
    A folder that is not a PEFT LoRA adapter, or one this model cannot run, raises InputError naming why."""
    folder = Path(request.lora_path)
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise InputError(f"LoRA adapter {request.lora_name!r}: {folder} needs adapter_config.json and "
                         "adapter_model.safetensors (PEFT's format).")  # fmt: skip
    config = json.loads(config_file.read_text())
    refused = (("bias", (None, "none")), ("fan_in_fan_out", (None, False)), ("modules_to_save", (None, [])),
               ("use_dora", (None, False)))  # fmt: skip
    for key, allowed in refused:
        if config.get(key) not in allowed:
            raise InputError(f"LoRA adapter {request.lora_name!r}: {key}={config.get(key)!r} is not supported.")
    rank = int(config["r"])
    scale = float(config.get("lora_alpha", rank)) / (math.sqrt(rank) if config.get("use_rslora") else rank)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in load_file(str(weights_file)).items():
        path, _, kind = name.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise InputError(f"LoRA adapter {request.lora_name!r}: unexpected tensor {name}.")
        pairs.setdefault(path, {})[kind[0]] = tensor
    targets, prefixes = _shard_targets(model), getattr(model, "hf_to_tessera_prefixes", {})
    parts: list[tuple[str, Linear, LoRAPart]] = []
    for path, pair in pairs.items():  # every part checked before any layer changes
        name = _rename(f"{path}.weight", prefixes)
        fused, rows = targets.get(name, (name, slice(None)))
        module = model.get_submodule(fused.rpartition(".")[0]) if "." in fused else None
        if not isinstance(module, Linear) or getattr(getattr(module, "tp", None), "world_size", 1) > 1:
            raise InputError(
                f"LoRA adapter {request.lora_name!r}: {path} is not a linear layer Tessera adapts (or tensor "
                "parallelism is on, which adapters do not support yet)."
            )
        rows = slice(rows.start or 0, rows.stop if rows.stop is not None else module.out_features)
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None or a.shape != (rank, module.in_features) or b.shape != (rows.stop - rows.start, rank):
            raise InputError(
                f"LoRA adapter {request.lora_name!r}: {path}'s lora_A/lora_B do not fit the model "
                f"(rank {rank}, {module.in_features} inputs, {rows.stop - rows.start} outputs)."
            )
        dtype = module.weight.dtype if module.weight.is_floating_point() else torch.float32
        parts.append((fused.rpartition(".")[0], module, LoRAPart(a.to(dtype), b.to(dtype), scale, rows)))
    for _, module, part in parts:
        if module.lora_parts is None:
            module.lora_parts = {}
        module.lora_parts.setdefault(request.lora_int_id, []).append(part)
    return sorted({name for name, _, _ in parts})


def unload_lora(model: nn.Module, lora_int_id: int) -> None:
    for module in model.modules():
        if isinstance(module, Linear) and module.lora_parts:
            module.lora_parts.pop(lora_int_id, None)
