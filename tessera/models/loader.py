"""Loading a model from a local Hugging Face folder: the class from config.json, weights from
safetensors (one file or a sharded index), every tensor checked by name and shape. A GGUF file's
weights come de-quantized, under HF names, from `tessera.models.gguf`, and are checked the same way.

Pickle checkpoints (.bin/.pt) can run arbitrary code when loaded, so they are refused unless the
user allows them explicitly; even then they are read with `weights_only=True`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from ..config import ModelConfig
from ..distributed import TensorParallelGroup, get_tp_group, tensor_parallel_group
from ..gguf_reading import release_gguf_readers
from ..layers.fused_moe import split_experts
from ..layers.gguf_blocks import QuantizedBlocks, concat_rows
from ..layers.linear import Linear, MergedLinear
from ..layers.mrope import uses_mrope
from ..layers.quantization import quantize_linears
from .causal_lm import CausalLM
from .interfaces import supports_mrope
from .registry import ModelRegistry

logger = logging.getLogger(__name__)

# Tensors some checkpoints carry that no model needs (recomputed buffers).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "embeddings.position_ids")


def load_model(model_config: ModelConfig) -> nn.Module:
    """Build the model class named by config.json and load its weights, parts placed as configured.
    Checkpoint tensors whose names start with the model's `ignored_checkpoint_prefixes` are skipped (parts
    of the checkpoint the class does not run); a model with a `finish_loading(model_config)` method gets it
    called last, to load what is not in the checkpoint."""
    model_cls, architecture = ModelRegistry.resolve_model_cls(model_config.architectures)
    if uses_mrope(model_config.hf_config) and not supports_mrope(model_cls):
        raise ValueError(
            f"The config of {model_config.model} asks for M-RoPE (three-axis positions, as Qwen2-VL's), but "
            f"{architecture} ({model_cls.__name__}) does not compute them: it does not implement SupportsMRoPE. "
            "Running it with 1-D positions would give wrong outputs; use a model class that supports M-RoPE."
        )
    with torch.device("meta"):  # no memory, no random init: every tensor comes from the checkpoint
        model = model_cls(model_config.hf_config)
    check_tensor_parallel(model, architecture)
    ignore_prefixes = tuple(getattr(model, "ignored_checkpoint_prefixes", ()))
    blocks: dict[str, QuantizedBlocks] = {}
    if model_config.gguf_file is not None:
        from .gguf import iter_gguf_checkpoint
        from .gguf_mmproj import iter_gguf_pair

        keep = blocks if model_config.keep_gguf_blocks and get_tp_group().world_size == 1 else None
        if model_config.mmproj is not None:
            tensors = iter_gguf_pair(model_config.gguf_file, model_config.mmproj, model_config.dtype, keep)
        else:
            tensors = iter_gguf_checkpoint(model_config.gguf_file, model_config.hf_config, model_config.dtype, keep)
        source = model_config.gguf_file + (f" + {model_config.mmproj}" if model_config.mmproj else "")
        try:
            load_tensors(model, tensors, source, ignore_prefixes=ignore_prefixes, described_by="its metadata")
        finally:
            release_gguf_readers()  # the file's parse, kept from its config and tokenizer on
    else:
        load_weights(model, model_config.model, allow_pickle=model_config.allow_pickle, ignore_prefixes=ignore_prefixes)
    place_parts(model, model_config)
    split_experts(model)  # each routed expert as Linears, which the kernels and quantization below then take
    if model_config.quantization is not None:  # the language model only: vision tower and projector keep their dtype
        quantize_linears(model, model_config.quantization, skip=getattr(model, "multimodal_parts", {}).values(),
                         blocks=blocks_by_layer(model, blocks))  # fmt: skip
    if hasattr(model, "finish_loading"):
        model.finish_loading(model_config)
    parts = weight_bytes(model)
    logger.info("Weights: %.1f MiB (%s)", parts.pop("total") / 2**20,
                ", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in parts.items()))  # fmt: skip
    return model.eval()


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes the loaded weights take (parameters and buffers, quantized ones as stored, each tensor once):
    "total", each multimodal part's, and the per-layer embedding tables' (Gemma 4's PLE: a large table of which
    a step reads a few rows)."""

    def size(module: nn.Module, seen: set) -> int:
        total = 0
        for tensor in [*module.parameters(), *module.buffers()]:
            key = (tensor.data_ptr(), tensor.numel())
            if tensor.numel() and key not in seen:
                seen.add(key)
                total += tensor.numel() * tensor.element_size()
        return total

    out = {"total": size(model, set())}
    for part in getattr(model, "multimodal_parts", {}).values():
        out[part] = size(model.get_submodule(part), set())
    tables = [m for name, m in model.named_modules() if name.endswith("embed_tokens_per_layer")]
    if tables:
        seen: set = set()
        out["per-layer embeddings"] = sum(size(table, seen) for table in tables)
    return out


def blocks_by_layer(model: nn.Module, blocks: Mapping[str, QuantizedBlocks]) -> dict[str, QuantizedBlocks]:
    """A GGUF file's quantized matrices (HF name -> blocks) as the blocks of each Linear of `model` that they
    fill entirely: fused layers (q | k | v, gate | up) get their parts' rows in order, a tied lm_head the
    embedding's."""
    if not blocks:
        return {}
    targets, prefixes = _shard_targets(model), getattr(model, "hf_to_tessera_prefixes", {})
    parts: dict[str, list[tuple[int, QuantizedBlocks]]] = {}
    for hf_name, value in blocks.items():
        name = _rename(hf_name, prefixes)
        fused, rows = targets.get(name, (name, slice(0, None)))
        if not isinstance(rows, slice):  # a routed expert's part: its blocks are not kept (dequantized)
            continue
        parts.setdefault(fused, []).append((rows.start or 0, value))
    for group in _tied_names(model).values():
        present = next((parts[name] for name in group if name in parts), None)
        if present is not None:
            parts.update({name: present for name in group})
    by_layer = {}
    for name, module in model.named_modules():
        found = sorted(parts.get(f"{name}.weight", []), key=lambda part: part[0])
        if not isinstance(module, Linear) or not found:
            continue
        starts = [start for start, _ in found]
        ends = [start + part.q.shape[0] for start, part in found]
        if starts[0] == 0 and starts[1:] == ends[:-1] and ends[-1] == module.out_features:
            joined = concat_rows([part for _, part in found])
            if joined is not None and joined.q.shape[1] == module.in_features:
                by_layer[name] = joined
    return by_layer


def check_class_tensor_parallel(model_config: ModelConfig, world_size: int = 2) -> None:
    """Before any rank starts: refuse tensor parallelism for a model class that says it cannot split
    (`supports_tensor_parallel = False` on the class), and a model whose layers do not split over `world_size`
    ranks (heads, widths: the model is built on the meta device as rank 0 would build it, so a worker never starts
    to fail)."""
    model_cls, architecture = ModelRegistry.resolve_model_cls(model_config.architectures)
    if getattr(model_cls, "supports_tensor_parallel", True) is False:
        raise ValueError(
            f"{architecture} ({model_cls.__name__}) does not support tensor parallelism; use tensor_parallel_size=1."
        )
    with tensor_parallel_group(TensorParallelGroup(rank=0, world_size=world_size)), torch.device("meta"):
        check_tensor_parallel(model_cls(model_config.hf_config), architecture)


def check_tensor_parallel(model: nn.Module, architecture: str) -> None:
    """Under tensor parallelism (built inside `tensor_parallel_group`), every language model in `model`
    must split its layers over the ranks; others would run whole on each rank and be summed wrongly."""
    world_size = get_tp_group().world_size
    if world_size == 1:
        return
    language_models = [m for m in model.modules() if isinstance(m, CausalLM)]
    unsupported = sorted({type(m).__name__ for m in language_models if not m.supports_tensor_parallel})
    if not language_models or unsupported:
        raise ValueError(
            f"{architecture} does not support tensor parallelism ({', '.join(unsupported) or 'no language model'}"
            f" cannot split its layers over ranks); run it with tensor_parallel_size=1."
        )


def place_parts(model: nn.Module, model_config: ModelConfig) -> None:
    model.to(device=model_config.device, dtype=model_config.dtype)
    parts = getattr(model, "multimodal_parts", {})
    for key, dtype, device in (
        ("vision", model_config.vision_dtype, model_config.vision_device),
        ("projector", model_config.projector_dtype, model_config.projector_device),
    ):
        if key in parts:
            model.get_submodule(parts[key]).to(device=device, dtype=dtype)


def load_weights(
    model: nn.Module, folder: str | Path, *, allow_pickle: bool = False, ignore_prefixes: tuple[str, ...] = ()
) -> None:
    """Assign every parameter and persistent buffer of `model` from the checkpoint in `folder`."""
    folder = Path(folder)
    load_tensors(model, iter_checkpoint(folder, allow_pickle=allow_pickle), folder, ignore_prefixes=ignore_prefixes)


def load_tensors(
    model: nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor]],
    source: str | Path,
    *,
    ignore_prefixes: tuple[str, ...] = (),
    described_by: str = "config.json",
) -> None:
    """Assign every parameter and persistent buffer of `model` from (checkpoint name, tensor) pairs
    read from `source` (named in errors; `described_by`: what gave the model's shapes)."""
    expected = model.state_dict(keep_vars=True)
    sharded = _sharded_params(model)
    tied = _tied_names(model)
    shard_targets = _shard_targets(model)
    loaded: dict[str, torch.Tensor] = {}
    shards_missing = {fused: set(names) for fused, names in _shards_by_fused(shard_targets).items()}
    adapters = {f"{n}.{p}": m for n, m in model.named_modules() if hasattr(m, "adapt_checkpoint_tensor")
                for p, _ in m.named_parameters(recurse=False)}  # fmt: skip
    unexpected = []
    for hf_name, tensor in tensors:
        name = _rename(hf_name, getattr(model, "hf_to_tessera_prefixes", {}))
        if name.endswith(IGNORED_SUFFIXES) or hf_name.startswith(ignore_prefixes):
            continue
        fused, rows = shard_targets.get(name, (name, slice(None)))
        if fused not in expected:
            unexpected.append(hf_name)
            continue
        if fused == name and fused in adapters:  # e.g. experts stored transposed: laid out before any slicing
            tensor = adapters[fused].adapt_checkpoint_tensor(fused.rpartition(".")[2], tensor)
        if fused in sharded:  # tensor parallelism: this rank's slice of the checkpoint tensor
            tensor = sharded[fused].shard_weight(fused.rpartition(".")[2], tensor)
        want = (expected[fused][rows] if expected[fused].dim() else expected[fused]).shape  # 0-dim: clip bounds
        if tuple(tensor.shape) != tuple(want):
            raise ValueError(
                f"Weight {hf_name} in {source} has shape {tuple(tensor.shape)}, but the model expects "
                f"{tuple(want)}; {described_by} does not describe these weights."
            )
        if fused == name:
            loaded[name] = tensor
            shards_missing.pop(name, None)  # the whole tensor, not its parts
            continue
        if fused not in loaded:  # first shard: make room for all of them
            loaded[fused] = torch.empty(expected[fused].shape, dtype=tensor.dtype)
        loaded[fused][rows] = tensor
        shards_missing[fused].discard(name)
    for fused, names in shards_missing.items():
        if names:
            loaded.pop(fused, None)
    for name, group in tied.items():  # e.g. lm_head tied to embed_tokens: one tensor serves all
        present = next((n for n in group if n in loaded), None)
        if present is not None:
            loaded.update({n: loaded[present] for n in group})
    missing = [name for name in expected if name not in loaded]
    missing = [n for name in missing for n in (sorted(shards_missing.get(name, ())) or [name])]
    if missing:
        raise ValueError(f"Missing weights in {source}: {_listing(missing)}")
    if unexpected:
        raise ValueError(
            f"Unexpected weights in {source} that {type(model).__name__} has no place for: {_listing(unexpected)}"
        )
    model.load_state_dict(loaded, strict=True, assign=True)
    _retie(model, tied)


def iter_checkpoint(folder: Path, *, allow_pickle: bool) -> Iterator[tuple[str, torch.Tensor]]:
    safetensors_files = _shards(folder, "model.safetensors.index.json", "*.safetensors")
    if safetensors_files:
        for file in safetensors_files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        return
    pickle_files = _shards(folder, "pytorch_model.bin.index.json", "*.bin") or sorted(folder.glob("*.pt"))
    if not pickle_files:
        raise ValueError(f"No weights in {folder}: expected model.safetensors or a sharded safetensors index.")
    if not allow_pickle:
        raise ValueError(
            f"{folder} has only pickle weights ({pickle_files[0].name}); loading pickle can run arbitrary code. "
            "Convert them to safetensors, or pass allow_pickle=True if you trust these files."
        )
    for file in pickle_files:
        yield from torch.load(file, map_location="cpu", weights_only=True).items()


def _shards(folder: Path, index_name: str, pattern: str) -> list[Path]:
    index = folder / index_name
    if index.is_file():
        weight_map: Mapping[str, str] = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"{index} names shard(s) that are not in the folder: {', '.join(absent)}")
        return files
    single = folder / index_name.removesuffix(".index.json")  # model.safetensors / pytorch_model.bin
    if single.is_file():  # only the model's own file: a folder may hold others (e.g. mm_projector.bin)
        return [single]
    return sorted(folder.glob(pattern))


def _shard_targets(model: nn.Module) -> dict[str, tuple[str, Any]]:
    """Checkpoint names of the projections fused into MergedLinear layers -> (fused name, rows); and of the parts
    a module fuses itself (`checkpoint_parts()`: routed experts stored one at a time) -> (parameter, index)."""
    targets: dict[str, tuple[str, Any]] = {}
    for module_name, module in model.named_modules():
        if hasattr(module, "checkpoint_parts"):
            for suffix, (param, index) in module.checkpoint_parts().items():
                targets[f"{module_name}.{suffix}"] = (f"{module_name}.{param}", index)
        if isinstance(module, MergedLinear):
            parent = module_name.rpartition(".")[0]
            params = ["weight"] + (["bias"] if module.bias is not None else [])
            for shard, rows in module.shard_rows().items():
                for param in params:
                    targets[f"{parent}.{shard}.{param}"] = (f"{module_name}.{param}", rows)
    return targets


def _sharded_params(model: nn.Module) -> dict[str, nn.Module]:
    """Names of the parameters a tensor-parallel layer holds a slice of -> that layer (its `shard_weight`
    cuts a checkpoint tensor to the slice)."""
    owners = {}
    for module_name, module in model.named_modules():
        tp = getattr(module, "tp", None)
        if hasattr(module, "shard_weight") and tp is not None and tp.world_size > 1:
            for param, _ in module.named_parameters(recurse=False):
                owners[f"{module_name}.{param}" if module_name else param] = module
    return owners


def _shards_by_fused(targets: Mapping[str, tuple[str, Any]]) -> dict[str, list[str]]:
    by_fused: dict[str, list[str]] = {}
    for name, (fused, _) in targets.items():
        by_fused.setdefault(fused, []).append(name)
    return by_fused


def _rename(name: str, prefixes: Mapping[str, str]) -> str:
    """Apply the model's checkpoint-name prefix renames (first match wins)."""
    for old, new in prefixes.items():
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def _tied_names(model: nn.Module) -> dict[str, list[str]]:
    """Groups of state-dict names that share one parameter, keyed by the first name."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return {names[0]: names for names in groups.values() if len(names) > 1}


def _retie(model: nn.Module, tied: Mapping[str, list[str]]) -> None:
    """`assign=True` gives each name its own Parameter; make tied names share one again."""
    for first, group in tied.items():
        param = model.get_parameter(first)
        for name in group[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, param)


def _listing(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
