"""A request's LoRA adapter, as vLLM's `vllm.lora.request.LoRARequest`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter folder (`adapter_config.json` + `adapter_model.safetensors`) by name and a positive id: one id
    always means the same adapter (the engine loads it once and keys its cached blocks by it)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer; got {self.lora_int_id!r}")
