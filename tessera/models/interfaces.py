"""Interfaces that model classes declare, as in vLLM's `model_executor.models.interfaces`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal, Optional, Union

import numpy as np
import torch
from torch import nn

from ..config import ModelConfig, SpeechToTextConfig
from .utils import MultiModalEmbeddings, merge_multimodal_embeddings, merge_multimodal_embeddings_by_mask

__all__ = [
    "MultiModalEmbeddings", "SupportsMRoPE", "SupportsMultiModal", "SupportsTranscription", "supports_mrope",
    "supports_multimodal", "supports_transcription",
]  # fmt: skip


class SupportsMultiModal:
    """A model that takes multimodal inputs: embeds them and merges them into the text embeddings."""

    supports_multimodal: ClassVar[Literal[True]] = True

    multimodal_parts: ClassVar[Mapping[str, str]] = {}
    """Attribute names of the parts that may get their own dtype and device, under the keys
    "vision" (the vision tower) and "projector"; weight quantization leaves every part named here alone (an
    audio tower too, under any other key)."""

    is_mm_prefix_lm: ClassVar[bool] = False
    """The tokens of one item attend to each other both ways (Gemma 3, PaliGemma): the engine
    passes each prompt's item spans to attention and never splits an item across prefill chunks."""

    chat_placeholders_inline: ClassVar[bool] = False
    """The model's chat template takes text only (a text model given eyes by a plugin): chat renders
    with the tokenizer, each message as one string with `get_placeholder_str("image", i)` where its
    image parts were; video parts are refused."""

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> Optional[str]:
        """The text that stands for item i of `modality` in a prompt (e.g. "<image>"), or None
        when the model's processor places items itself (e.g. Fuyu puts its image first).
        Chat and inline-image prompts use it."""
        return None

    def get_multimodal_embeddings(self, **kwargs: object) -> Optional[MultiModalEmbeddings]:
        """Embeddings of the items in `kwargs` (the processor's mm_kwargs); item i at index i."""
        raise NotImplementedError

    def get_input_embeddings(
        self,
        input_ids: torch.Tensor,
        multimodal_embeddings: Optional[MultiModalEmbeddings] = None,
        *,
        is_multimodal: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Text embeddings of `input_ids` with the item embeddings placed at their placeholders:
        where `is_multimodal` [T] is True if given (from the placeholders' is_embed), else at
        `self.placeholder_token_id`. Models may override it, as vLLM's guide shows."""
        inputs_embeds = self.embed_text_tokens(input_ids)
        if multimodal_embeddings is None or len(multimodal_embeddings) == 0:
            return inputs_embeds
        if is_multimodal is not None:
            return merge_multimodal_embeddings_by_mask(inputs_embeds, multimodal_embeddings, is_multimodal)
        placeholder_token_id = getattr(self, "placeholder_token_id", None)
        if placeholder_token_id is None:
            raise ValueError(f"{type(self).__name__}.placeholder_token_id is not set; pass is_multimodal instead")
        return merge_multimodal_embeddings(input_ids, inputs_embeds, multimodal_embeddings, placeholder_token_id)

    def get_language_model(self) -> nn.Module:
        raise NotImplementedError

    def embed_text_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The text embeddings the item embeddings are merged into (the language model's table)."""
        return self.get_language_model().get_input_embeddings(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.get_language_model().compute_logits(hidden_states)


def supports_multimodal(model: Union[type, object]) -> bool:
    return getattr(model, "supports_multimodal", False) is True


class SupportsMRoPE:
    """A model whose positions are three-axis M-RoPE indices [3, T] (Qwen2-VL and successors), as
    vLLM's interface: the engine asks once per request for its prompt's positions and carries the
    delta into decoding (token i >= prompt length sits at i + delta on every axis)."""

    supports_mrope: ClassVar[Literal[True]] = True

    def get_mrope_input_positions(
        self, input_tokens: list[int], mm_features: Sequence[Any]
    ) -> tuple[torch.Tensor, int]:
        """([3, len(input_tokens)] positions of the prompt, delta). `mm_features`: the prompt's
        items in prompt order, each with `.modality`, `.identifier`, `.mm_position` (its
        PlaceholderRange) and `.data` (its MultiModalKwargsItem), as vLLM's MultiModalFeatureSpec."""
        raise NotImplementedError


def supports_mrope(model: Union[type, object]) -> bool:
    return getattr(model, "supports_mrope", False) is True


class SupportsTranscription:
    """A speech-to-text model with a prompt format of its own, as vLLM's interface: `/v1/audio/transcriptions`
    and `LLM.transcribe` ask it for each window's prompt. (An audio model without it transcribes through its
    chat template: engine/transcription.py.)"""

    supports_transcription: ClassVar[Literal[True]] = True
    supports_transcription_only: ClassVar[bool] = False
    supported_languages: ClassVar[Mapping[str, str]] = {}
    """ISO 639-1 code -> language name of the languages it transcribes; empty: it does not say."""

    @classmethod
    def get_speech_to_text_config(cls, model_config: ModelConfig, task_type: str) -> SpeechToTextConfig:
        return SpeechToTextConfig()

    @classmethod
    def get_generation_prompt(
        cls,
        audio: np.ndarray,
        stt_config: SpeechToTextConfig,
        model_config: ModelConfig,
        language: Optional[str],
        task_type: Literal["transcribe", "translate"],
        request_prompt: str,
        to_language: Optional[str],
    ) -> Any:
        """The engine prompt (a dict with "multi_modal_data": {"audio": ...}) for one window `audio` (mono
        float32 at `stt_config.sample_rate`)."""
        raise NotImplementedError

    @classmethod
    def validate_language(cls, language: Optional[str]) -> Optional[str]:
        """`language` if the model transcribes it (None: the model finds out), else a ValueError naming the
        languages it knows."""
        if language is None or not cls.supported_languages or language in cls.supported_languages:
            return language
        known = ", ".join(sorted(cls.supported_languages))
        raise ValueError(f"This model does not transcribe language {language!r}; it knows {known}.")


def supports_transcription(model: Union[type, object]) -> bool:
    return getattr(model, "supports_transcription", False) is True
