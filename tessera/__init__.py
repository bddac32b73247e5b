"""Tessera: a multimodal LLM inference engine."""

from pathlib import Path

from .logger import configure_logging

configure_logging()

from .entrypoints.llm import LLM  # noqa: E402
from .models import ModelRegistry  # noqa: E402
from .outputs import CompletionOutput, RequestOutput  # noqa: E402
from .sampling_params import SamplingParams  # noqa: E402

# The default model (the CLI's and server's when none is given): for now the 1.55M-parameter LLaVA trained
# from scratch on synthetic shapes (tools/train_tiny_demo_model.py), also the tests' fast fixture. The demo
# VLM (a vision side trained here in front of SmolLM2-135M-Instruct, models/demo_vlm.py) takes over the
# default once its vision side is trained and shipped in tessera/demo_vlm.
TINY_DEMO_MODEL = Path(__file__).resolve().parent / "tiny_demo_model"
DEMO_MODEL = TINY_DEMO_MODEL

__version__ = "0.1.0"
__all__ = [
    "DEMO_MODEL", "LLM", "TINY_DEMO_MODEL", "CompletionOutput", "ModelRegistry", "RequestOutput", "SamplingParams",
    "__version__",
]  # fmt: skip
