"""What the engine runs, built from a ModelConfig: the model (the class its config's architectures name,
built in or registered by a plugin) and its multimodal processor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from ..config import ModelConfig
from ..multimodal import MULTIMODAL_REGISTRY
from ..multimodal.processing import BaseMultiModalProcessor
from .loader import load_model
from .registry import ModelRegistry


@dataclass(frozen=True)
class BuiltProcessor:
    """What a front-end needs to turn prompts into requests, built without the model's weights."""

    processor: Optional[BaseMultiModalProcessor]
    """Prompt and items -> token ids, placeholders and item kwargs; None for a text-only model."""

    tokenizer: Any

    model_cls: type
    """The model's class: its `get_placeholder_str(modality, i)`, if it has one, is item i's prompt text."""

    def chat_renderer(self) -> tuple[Any, Optional[str]]:
        """(what renders chat templates: the HF processor, else the tokenizer; the text an image part
        becomes where the model's chat template takes text only (`chat_placeholders_inline`), else None:
        the template places images itself)."""
        if getattr(self.model_cls, "chat_placeholders_inline", False):
            return self.tokenizer, self.model_cls.get_placeholder_str("image", 0)
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

    @property
    def inputs(self) -> BuiltProcessor:
        return BuiltProcessor(self.processor, self.tokenizer, type(self.model))


def build_model(model_config: ModelConfig, tokenizer: Any) -> BuiltModel:
    """The model of `model_config` (the class its architectures name, which must be supported) and the
    processor registered for that class, if it takes items."""
    model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architectures)
    model = load_model(model_config)
    return BuiltModel(model, _processor(model_config, model_cls, tokenizer), tokenizer)


def build_processor(model_config: ModelConfig, tokenizer: Any) -> BuiltProcessor:
    """`build_model`'s processor side alone, for a front-end whose engine cores run elsewhere (no weights
    are loaded)."""
    model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architectures)
    return BuiltProcessor(_processor(model_config, model_cls, tokenizer), tokenizer, model_cls)


def _processor(model_config: ModelConfig, model_cls: type, tokenizer: Any) -> Optional[BaseMultiModalProcessor]:
    if MULTIMODAL_REGISTRY.get_factories(model_cls) is None:
        return None
    return MULTIMODAL_REGISTRY.create_processor(model_config, tokenizer=tokenizer)
