"""Moved to tessera.models.pipeline_adapter; the engine is to build models with
tessera.models.factory.build_model. Kept only until the engine stops importing it from here
(it makes pipelines/ import models/, the one upward import left in this package)."""

from ..models.pipeline_adapter import (  # noqa: F401
    IMAGE_MARKER,
    PipelineDummyInputsBuilder,
    PipelineForCausalLM,
    PipelineMultiModalProcessor,
    PipelineProcessingInfo,
    build_with_pipeline,
)
