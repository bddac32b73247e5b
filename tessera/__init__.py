"""Tessera: a multimodal LLM inference engine."""

from .logger import configure_logging

configure_logging()

from .llm import LLM  # noqa: E402
from .models import ModelRegistry  # noqa: E402
from .outputs import CompletionOutput, RequestOutput  # noqa: E402
from .sampling_params import SamplingParams  # noqa: E402

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "ModelRegistry", "RequestOutput", "SamplingParams", "__version__"]
