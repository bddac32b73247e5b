"""`BaseProcessingInfo`: what a model's processing needs to know (config, tokenizer, HF processor,
item limits). Model files import it from `processing`, as vLLM's guide does; it lives here so that the
dummy-input builders (`profiling`) and the processor (`processing`) both build on it without a cycle."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from typing import Any, Optional

from transformers import PretrainedConfig, ProcessorMixin

from .context import InputProcessingContext

DEFAULT_MM_LIMIT = 999
"""Items per prompt allowed when neither the model nor the user sets a limit."""


class BaseProcessingInfo:
    """What a model's processing needs to know: config, tokenizer, HF processor, limits."""

    def __init__(self, ctx: InputProcessingContext) -> None:
        self.ctx = ctx

    @property
    def model_id(self) -> str:
        return self.ctx.model_config.model

    def get_tokenizer(self) -> Any:
        return self.ctx.tokenizer

    def get_hf_config(self) -> PretrainedConfig:
        return self.ctx.get_hf_config()

    def get_hf_processor(self, **kwargs: object) -> ProcessorMixin:
        return self.ctx.get_hf_processor(**kwargs)

    @abstractmethod
    def get_supported_mm_limits(self) -> Mapping[str, Optional[int]]:
        """Maximum items per prompt for each supported modality (None: no model limit)."""

    def get_allowed_mm_limits(self) -> Mapping[str, int]:
        """min(model limit, user limit) per supported modality."""
        mm_config = self.ctx.model_config.multimodal_config
        allowed = {}
        for modality, supported in self.get_supported_mm_limits().items():
            limits = [x for x in (supported, mm_config.get_limit_per_prompt(modality)) if x is not None]
            allowed[modality] = min(limits) if limits else DEFAULT_MM_LIMIT
        return allowed

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int]) -> Optional[Mapping[str, int]]:
        """Maximum placeholder tokens per item, if known without processing dummy inputs."""
        return None
