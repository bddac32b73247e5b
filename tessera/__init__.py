"""Tessera: a multimodal LLM inference engine."""

from .llm import LLM
from .models import ModelRegistry
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "ModelRegistry", "RequestOutput", "SamplingParams", "__version__"]
