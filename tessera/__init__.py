"""Tessera: a multimodal LLM inference engine."""

from .models import ModelRegistry

__version__ = "0.1.0"
__all__ = ["ModelRegistry", "__version__"]
