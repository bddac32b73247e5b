"""Which LoRA adapters the core holds: loaded on a request's first use (models/lora_loader.py), at most `max_loras`
at once; when full, the least recently used adapter no unfinished request uses is unloaded first."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterable

from torch import nn

from ...errors import InputError
from ...lora.request import LoRARequest
from ...models.lora_loader import load_lora, unload_lora
from .request import MultiModalItem


class LoRAManager:
    def __init__(self, model: nn.Module, max_loras: int, *, tensor_parallel: bool = False) -> None:
        self.model, self.max_loras, self.tensor_parallel = model, max_loras, tensor_parallel
        self.loaded: OrderedDict[int, LoRARequest] = OrderedDict()
        parts = getattr(model, "multimodal_parts", {}).values()
        self.encoder_prefixes = tuple(f"{part}." for part in parts)  # modules whose output the encoder cache keeps
        self.adapts_encoder: set[int] = set()

    def activate(self, lora: LoRARequest, in_use: Iterable[int]) -> None:
        """Make `lora` runnable (InputError when it cannot be: a bad folder, an id taken by another adapter, every
        slot held by running requests' adapters, tensor parallelism)."""
        held = self.loaded.get(lora.lora_int_id)
        if held is not None:
            if (held.lora_name, held.lora_path) != (lora.lora_name, lora.lora_path):
                raise InputError(f"LoRA id {lora.lora_int_id} already means adapter {held.lora_name!r} "
                                 f"({held.lora_path}); give {lora.lora_name!r} an id of its own.")  # fmt: skip
            self.loaded.move_to_end(lora.lora_int_id)
            return
        if self.tensor_parallel:
            raise InputError("LoRA adapters do not run under tensor parallelism yet; use tensor_parallel_size=1.")
        if len(self.loaded) >= self.max_loras:
            busy = set(in_use)
            idle = next((i for i in self.loaded if i not in busy), None)
            if idle is None:
                raise InputError(f"All {self.max_loras} LoRA slots hold adapters of running requests; raise "
                                 "max_loras or retry when they finish.")  # fmt: skip
            self.unload(idle)
        modules = load_lora(self.model, lora)
        self.loaded[lora.lora_int_id] = lora
        if any(name.startswith(self.encoder_prefixes) for name in modules):
            self.adapts_encoder.add(lora.lora_int_id)

    def unload(self, lora_int_id: int) -> None:
        if self.loaded.pop(lora_int_id, None) is not None:
            unload_lora(self.model, lora_int_id)
            self.adapts_encoder.discard(lora_int_id)

    def items_for(self, lora: LoRARequest, items: list[MultiModalItem]) -> list[MultiModalItem]:
        """A request's items as its adapter's encoder sees them: under an adapter of the vision tower or projector,
        each runs with it and is cached apart (its hash names the adapter)."""
        if lora.lora_int_id not in self.adapts_encoder:
            return items
        return [dataclasses.replace(item, hash=f"{item.hash}|lora:{lora.lora_int_id}", lora_int_id=lora.lora_int_id)
                for item in items]  # fmt: skip
