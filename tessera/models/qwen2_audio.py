"""Qwen2-Audio: a Whisper encoder with 2x average pooling before its final norm (whisper_encoder.py), a linear
projector, and the language model its text_config names (Qwen2). As transformers' modeling_qwen2_audio.py;
processing as vLLM's qwen2_audio.py.

The HF processor (WhisperFeatureExtractor) turns each waveform at 16 kHz into log-mel features padded to
30 s ([mel bins, 3000] and a frame mask; longer recordings are cut at 30 s) and expands each `<|AUDIO|>` of
the prompt to one token per output frame: n mel frames -> (n - 1) // 2 + 1 after the strided conv, then
half that after pooling. Chat templates write `Audio N: <|audio_bos|><|AUDIO|><|audio_eos|>`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import numpy as np
import torch
from torch import nn
from transformers import BatchFeature, Qwen2AudioConfig, Qwen2AudioProcessor

from tessera.models.interfaces import MultiModalEmbeddings, SupportsMultiModal
from tessera.models.registry import ModelRegistry
from tessera.models.utils import module_dtype_device
from tessera.models.whisper_encoder import WhisperEncoder, conv_output_frames
from tessera.multimodal import MULTIMODAL_REGISTRY
from tessera.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargs
from tessera.multimodal.parse import MultiModalDataItems, MultiModalDataParser
from tessera.multimodal.processing import (
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    PromptReplacement,
    PromptUpdate,
    PromptUpdateDetails,
)
from tessera.multimodal.profiling import BaseDummyInputsBuilder

AUDIO_TOKEN = "<|AUDIO|>"


def audio_output_lengths(mel_frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(frames after the strided conv, tokens after pooling) for `mel_frames` valid input frames."""
    conv = conv_output_frames(mel_frames)
    return conv, (conv - 2) // 2 + 1


class Qwen2AudioProcessingInfo(BaseProcessingInfo):
    def get_hf_config(self) -> Qwen2AudioConfig:
        return self.ctx.get_hf_config(Qwen2AudioConfig)

    def get_hf_processor(self, **kwargs: object) -> Qwen2AudioProcessor:
        return self.ctx.get_hf_processor(Qwen2AudioProcessor, **kwargs)

    def get_feature_extractor(self) -> Any:
        return self.get_hf_processor().feature_extractor

    def get_supported_mm_limits(self) -> Mapping[str, Optional[int]]:
        return {"audio": None}

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int]) -> Mapping[str, int]:
        frames = torch.tensor(self.get_feature_extractor().nb_max_frames)
        return {"audio": int(audio_output_lengths(frames)[1])}


class Qwen2AudioDummyInputsBuilder(BaseDummyInputsBuilder[Qwen2AudioProcessingInfo]):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return AUDIO_TOKEN * mm_counts.get("audio", 0)  # the tokens of the items alone, as the profile counts them

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int]):
        extractor = self.info.get_feature_extractor()
        longest = np.zeros(extractor.chunk_length * extractor.sampling_rate, dtype=np.float32)
        return {"audio": [longest] * mm_counts.get("audio", 0)}


class Qwen2AudioMultiModalProcessor(BaseMultiModalProcessor[Qwen2AudioProcessingInfo]):
    def _get_data_parser(self) -> MultiModalDataParser:
        return MultiModalDataParser(target_sr=self.info.get_feature_extractor().sampling_rate)

    def _call_hf_processor(
        self, prompt: str, mm_data: Mapping[str, object], mm_kwargs: Mapping[str, object]
    ) -> BatchFeature:
        """The HF processor takes `audio` (not `audios`) and its waveforms' sampling rate."""
        data = dict(mm_data)
        audios = data.pop("audios", None)
        if audios:
            data["audio"] = list(audios)
            mm_kwargs = {**mm_kwargs, "sampling_rate": self.info.get_feature_extractor().sampling_rate}
        return super()._call_hf_processor(prompt, data, mm_kwargs)

    def _get_mm_fields_config(
        self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        return dict(
            input_features=MultiModalFieldConfig.batched("audio"),
            feature_attention_mask=MultiModalFieldConfig.batched("audio"),
        )

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_mm_kwargs: MultiModalKwargs,
    ) -> Sequence[PromptUpdate]:
        audio_token_id = self.info.get_hf_config().audio_token_index
        items = out_mm_kwargs.get_items("audio") if out_mm_kwargs.get_item_count("audio") else []

        def get_replacement(item_idx: int) -> PromptUpdateDetails:
            frames = torch.as_tensor(items[item_idx]["feature_attention_mask"].data).sum()
            num_tokens = int(audio_output_lengths(frames)[1])
            return PromptUpdateDetails.select_token_id([audio_token_id] * num_tokens, audio_token_id)

        return [PromptReplacement(modality="audio", target=[audio_token_id], replacement=get_replacement)]


class Qwen2AudioMultiModalProjector(nn.Module):
    def __init__(self, config: Qwen2AudioConfig) -> None:
        super().__init__()
        self.linear = nn.Linear(config.audio_config.d_model, config.text_config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


@MULTIMODAL_REGISTRY.register_processor(
    Qwen2AudioMultiModalProcessor, info=Qwen2AudioProcessingInfo, dummy_inputs=Qwen2AudioDummyInputsBuilder
)
class Qwen2AudioForConditionalGeneration(nn.Module, SupportsMultiModal):
    multimodal_parts = {"vision": "audio_tower", "projector": "multi_modal_projector"}  # the encoder's dtype/device
    hf_to_tessera_prefixes = {
        "model.language_model.": "language_model.model.",
        "model.audio_tower.": "audio_tower.",
        "model.multi_modal_projector.": "multi_modal_projector.",
        "language_model.model.": "language_model.model.",
        "language_model.lm_head.": "language_model.lm_head.",
        "audio_tower.": "audio_tower.",
        "multi_modal_projector.": "multi_modal_projector.",
        "lm_head.": "language_model.lm_head.",
    }

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> Optional[str]:
        return f"Audio {i + 1}: <|audio_bos|>{AUDIO_TOKEN}<|audio_eos|>" if modality == "audio" else None

    def __init__(self, config: Qwen2AudioConfig) -> None:
        super().__init__()
        self.config = config
        self.audio_tower = WhisperEncoder(config.audio_config, pool=True)
        self.multi_modal_projector = Qwen2AudioMultiModalProjector(config)
        self.language_model = ModelRegistry.build_language_model(config)
        self.placeholder_token_id = config.audio_token_index

    def get_language_model(self) -> nn.Module:
        return self.language_model

    def get_multimodal_embeddings(self, **kwargs: object) -> Optional[MultiModalEmbeddings]:
        """One [tokens, hidden] tensor per audio item: its valid output frames."""
        features, mask = kwargs.get("input_features"), kwargs.get("feature_attention_mask")
        if features is None:
            return None
        if isinstance(features, (list, tuple)):
            features, mask = torch.stack(list(features)), torch.stack([torch.as_tensor(m) for m in mask])
        dtype, device = module_dtype_device(self.audio_tower)
        mel_frames = torch.as_tensor(mask).reshape(features.shape[0], -1).sum(-1)
        hidden = self.multi_modal_projector(self.audio_tower(features.to(device=device, dtype=dtype), mel_frames))
        _, tokens = audio_output_lengths(mel_frames)
        return [item[: int(n)] for item, n in zip(hidden, tokens)]

    def forward(
        self, input_ids: Optional[torch.Tensor], positions: torch.Tensor, inputs_embeds: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        return self.language_model(input_ids, positions, inputs_embeds)
