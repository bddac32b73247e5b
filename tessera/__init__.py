"""Tessera: a multimodal LLM inference engine."""

from pathlib import Path

from .logger import configure_logging

configure_logging()

from .entrypoints.llm import LLM  # noqa: E402
from .models import ModelRegistry  # noqa: E402
from .outputs import CompletionOutput, RequestOutput  # noqa: E402
from .sampling_params import SamplingParams  # noqa: E402

# The bundled demo model: a tiny LLaVA trained on synthetic shapes by tools/train_demo_model.py.
DEMO_MODEL = Path(__file__).resolve().parent / "demo_model"

__version__ = "0.1.0"
__all__ = ["DEMO_MODEL", "LLM", "CompletionOutput", "ModelRegistry", "RequestOutput", "SamplingParams", "__version__"]
