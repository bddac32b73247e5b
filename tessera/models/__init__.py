"""Model code, one file per architecture; `ModelRegistry` maps config architectures to classes."""

from ..multimodal import MULTIMODAL_REGISTRY
from .registry import ModelRegistry

# The multimodal registry finds a model's processor by its class; it resolves architectures here.
MULTIMODAL_REGISTRY.set_model_resolver(ModelRegistry.resolve_model_cls)

__all__ = ["ModelRegistry"]
