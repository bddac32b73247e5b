"""LoRA adapters chosen per request (vLLM's `LoRARequest`): `tessera.lora.request`."""

from .request import LoRARequest

__all__ = ["LoRARequest"]
