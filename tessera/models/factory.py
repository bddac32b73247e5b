"""What the engine runs, built from a ModelConfig: the model and its multimodal processor, from a
model folder (ModelRegistry) or from a text model with a vision pipeline plugin. The engine calls
`build_model` and knows neither path."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from torch import nn

from ..config import ModelConfig
from ..multimodal import MULTIMODAL_REGISTRY
from ..multimodal.processing import BaseMultiModalProcessor
from .loader import load_model
from .registry import ModelRegistry

if TYPE_CHECKING:
    from ..pipelines.base import AbstractMultimodalPipeline


@dataclass(frozen=True)
class BuiltProcessor:
    """What a front-end needs to turn prompts into requests, built without the model's weights."""

    processor: Optional[BaseMultiModalProcessor]
    """Prompt and items -> token ids, placeholders and item kwargs; None for a text-only model."""

    tokenizer: Any

    model_cls: type
    """The model's class: its `get_placeholder_str(modality, i)`, if it has one, is item i's prompt text."""

    pipeline: Optional[AbstractMultimodalPipeline] = None
    """The vision pipeline plugin in pipeline mode, else None."""

    def chat_renderer(self) -> tuple[Any, Optional[str]]:
        """(what renders chat templates: the HF processor, else the tokenizer; the text an image
        part becomes in pipeline mode, else None: the template places images itself)."""
        if self.pipeline is not None:
            from .pipeline_adapter import IMAGE_MARKER

            return self.tokenizer, IMAGE_MARKER
        if self.processor is not None:
            return self.processor.info.get_hf_processor(), None
        return self.tokenizer, None


@dataclass(frozen=True)
class BuiltModel:
    model: nn.Module
    """The model with its weights loaded, in eval mode, its parts on the configured dtypes and devices."""

    processor: Optional[BaseMultiModalProcessor]
    """Prompt and items -> token ids, placeholders and item kwargs; None for a text-only model."""

    tokenizer: Any
    """The tokenizer the model was built with."""

    pipeline: Optional[AbstractMultimodalPipeline] = None
    """The vision pipeline plugin in pipeline mode, else None."""

    @property
    def inputs(self) -> BuiltProcessor:
        return BuiltProcessor(self.processor, self.tokenizer, type(self.model), self.pipeline)


def build_model(model_config: ModelConfig, tokenizer: Any) -> BuiltModel:
    """The model of `model_config`, and its processor if it takes items: with a vision pipeline when
    `model_config.multimodal_config.uses_pipeline`, else the class config.json's architectures name
    (which must be supported in both cases) and the processor registered for it."""
    model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architectures)
    if model_config.multimodal_config.uses_pipeline:  # a text model + a vision pipeline plugin
        from .pipeline_adapter import build_with_pipeline

        pipeline, processor, model = build_with_pipeline(model_config, tokenizer)
        return BuiltModel(model, processor, tokenizer, pipeline)
    return BuiltModel(load_model(model_config), _processor(model_config, model_cls, tokenizer), tokenizer)


def build_processor(model_config: ModelConfig, tokenizer: Any) -> BuiltProcessor:
    """`build_model`'s processor side alone, for a front-end whose engine cores run elsewhere (no weights
    are loaded; a vision pipeline is, as its processing needs it)."""
    model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architectures)
    if model_config.multimodal_config.uses_pipeline:
        from .pipeline_adapter import PipelineForCausalLM, build_pipeline_processor

        pipeline, processor = build_pipeline_processor(model_config, tokenizer)
        return BuiltProcessor(processor, tokenizer, PipelineForCausalLM, pipeline)
    return BuiltProcessor(_processor(model_config, model_cls, tokenizer), tokenizer, model_cls)


def _processor(model_config: ModelConfig, model_cls: type, tokenizer: Any) -> Optional[BaseMultiModalProcessor]:
    if MULTIMODAL_REGISTRY.get_factories(model_cls) is None:
        return None
    return MULTIMODAL_REGISTRY.create_processor(model_config, tokenizer=tokenizer)
