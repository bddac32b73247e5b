"""Model code, one file per architecture; `ModelRegistry` maps config architectures to classes."""

from .registry import ModelRegistry

__all__ = ["ModelRegistry"]
