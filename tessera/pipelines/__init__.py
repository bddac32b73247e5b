"""Vision pipelines as plugins, in the style of text-generation-webui's multimodal extension."""

from .base import AbstractMultimodalPipeline
from .discovery import list_pipelines, load_pipeline

__all__ = ["AbstractMultimodalPipeline", "list_pipelines", "load_pipeline"]
