"""Voxtral: a Whisper encoder (whisper_encoder.py, no pooling), an adapter that packs 4 consecutive frames
into one token (linear, GELU, linear) and a Llama-family language model. As transformers' modeling_voxtral.py;
processing as vLLM's voxtral.py.

Its tokenizer is mistral-common's (tekken.json, through transformers' MistralCommonBackend), which writes each
recording into the prompt itself: `[BEGIN_AUDIO]` then one `[AUDIO]` per 80 ms of the recording padded to
whole 30-second chunks (375 per chunk). So chats (engine/mistral_chat.py) and transcriptions
(`get_generation_prompt`, mistral-common's TranscriptionRequest) arrive as token ids with the placeholders
already in place: the processor finds them; a lone `[BEGIN_AUDIO]` in token ids is expanded. The features are
the HF processor's: log-mel frames of the padded recording, [chunks, mel bins, 3000].
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, Optional

import numpy as np
import torch
from torch import nn
from transformers import BatchFeature, VoxtralConfig, VoxtralProcessor
from transformers.activations import ACT2FN

from tessera.config import ModelConfig, SpeechToTextConfig
from tessera.errors import InputError
from tessera.models.interfaces import MultiModalEmbeddings, SupportsMultiModal, SupportsTranscription
from tessera.models.registry import ModelRegistry
from tessera.models.utils import module_dtype_device
from tessera.models.whisper_encoder import WhisperEncoder
from tessera.multimodal import MULTIMODAL_REGISTRY
from tessera.multimodal.audio import MAX_AUDIO_SECONDS
from tessera.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargs
from tessera.multimodal.parse import MultiModalDataItems, MultiModalDataParser
from tessera.multimodal.processing import (
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    PromptReplacement,
    PromptUpdate,
    PromptUpdateDetails,
)
from tessera.multimodal.profiling import BaseDummyInputsBuilder, ProcessorInputs
from tessera.tokenizer_utils import cached_tokenizer

# The languages Voxtral was trained to transcribe (its model card's, as vLLM lists them).
ISO639_1_SUPPORTED_LANGS = {"ar": "Arabic", "nl": "Dutch", "en": "English", "fr": "French", "de": "German",
                            "hi": "Hindi", "it": "Italian", "pt": "Portuguese", "es": "Spanish"}  # fmt: skip


def audio_encoder_of(tokenizer: Any) -> Any:
    """mistral-common's AudioEncoder behind a MistralCommonBackend (its audio settings and special ids)."""
    encoder = getattr(getattr(getattr(tokenizer, "tokenizer", None), "instruct_tokenizer", None), "audio_encoder", None)
    if encoder is None:
        raise ValueError("Voxtral needs its mistral-common tokenizer (tekken.json with an audio section).")
    return encoder


class VoxtralProcessingInfo(BaseProcessingInfo):
    def get_hf_config(self) -> VoxtralConfig:
        return self.ctx.get_hf_config(VoxtralConfig)

    def get_hf_processor(self, **kwargs: object) -> VoxtralProcessor:
        return self.ctx.get_hf_processor(VoxtralProcessor, **kwargs)

    def get_audio_encoder(self) -> Any:
        return audio_encoder_of(self.get_tokenizer())

    @property
    def sampling_rate(self) -> int:
        return int(self.get_audio_encoder().audio_config.sampling_rate)

    def get_num_audio_tokens(self, num_samples: int) -> int:
        """`[AUDIO]` tokens of a recording of `num_samples` samples (padded to whole chunks), as mistral-common."""
        encoder = self.get_audio_encoder()
        padded = encoder.next_multiple_of_chunk_frames(num_samples, self.sampling_rate)
        return -(-padded // int(self.sampling_rate // encoder.audio_config.frame_rate))

    def get_supported_mm_limits(self) -> Mapping[str, Optional[int]]:
        return {"audio": None}

    def get_max_audio_samples(self, seq_len: int) -> int:
        """The longest recording a prompt of `seq_len` tokens holds (whole chunks, at most MAX_AUDIO_SECONDS)."""
        chunk = int(self.get_audio_encoder().audio_config.chunk_length_s * self.sampling_rate)
        per_chunk = self.get_num_audio_tokens(chunk)
        chunks = max(1, min(seq_len // per_chunk, int(MAX_AUDIO_SECONDS * self.sampling_rate) // chunk))
        return chunks * chunk

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int]) -> Mapping[str, int]:
        return {"audio": 1 + self.get_num_audio_tokens(self.get_max_audio_samples(seq_len))}


class VoxtralDummyInputsBuilder(BaseDummyInputsBuilder[VoxtralProcessingInfo]):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> Any:
        """Token ids: `[BEGIN_AUDIO]` per item (text cannot hold mistral-common's special tokens)."""
        return [self.info.get_audio_encoder().special_ids.begin_audio] * mm_counts.get("audio", 0)

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int]):
        longest = np.zeros(self.info.get_max_audio_samples(seq_len), dtype=np.float32)
        return {"audio": [longest] * mm_counts.get("audio", 0)}

    def get_dummy_processor_inputs(self, seq_len: int, mm_counts: Mapping[str, int]) -> ProcessorInputs:
        return ProcessorInputs(prompt_text=self.get_dummy_text(mm_counts),
                               mm_data=self.get_dummy_mm_data(seq_len, mm_counts))  # fmt: skip


class VoxtralMultiModalProcessor(BaseMultiModalProcessor[VoxtralProcessingInfo]):
    def _get_data_parser(self) -> MultiModalDataParser:
        return MultiModalDataParser(target_sr=self.info.sampling_rate)

    def _call_hf_processor(
        self, prompt: Any, mm_data: Mapping[str, object], mm_kwargs: Mapping[str, object]
    ) -> BatchFeature:
        """Token ids of the prompt (text is tokenized without special tokens) and the HF processor's log-mel
        features of the recordings, as its apply_chat_template computes them."""
        processor = self.info.get_hf_processor(**mm_kwargs)
        if isinstance(prompt, str):
            ids = processor.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = list(prompt)
        data: dict[str, Any] = {"input_ids": torch.tensor([ids], dtype=torch.long)}
        audios = list(mm_data.get("audios") or [])
        if audios:
            call_kwargs = self.info.ctx.get_call_kwargs(processor, mm_kwargs)
            audio_kwargs = processor._merge_kwargs(**call_kwargs)["audio_kwargs"]
            positions = audio_kwargs.pop("max_source_positions")
            features = [processor._retrieve_input_features([a], positions, **audio_kwargs) for a in audios]
            data["input_features"] = torch.cat(features)
            data["audio_num_chunks"] = torch.tensor([len(f) for f in features])
        return BatchFeature(data)

    def _get_mm_fields_config(
        self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        chunks = hf_inputs.get("audio_num_chunks", torch.empty(0, dtype=torch.long))
        return dict(
            input_features=MultiModalFieldConfig.flat_from_sizes("audio", chunks),
            audio_num_chunks=MultiModalFieldConfig.batched("audio"),
        )

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_mm_kwargs: MultiModalKwargs,
    ) -> Sequence[PromptUpdate]:
        special = self.info.get_audio_encoder().special_ids
        chunk_tokens = self.info.get_num_audio_tokens(1)  # one chunk's worth
        items = out_mm_kwargs.get_items("audio") if out_mm_kwargs.get_item_count("audio") else []

        def get_replacement(item_idx: int) -> PromptUpdateDetails:
            count = int(torch.as_tensor(items[item_idx]["audio_num_chunks"].data)) * chunk_tokens
            return PromptUpdateDetails.select_token_id([special.begin_audio] + [special.audio] * count, special.audio)

        return [PromptReplacement(modality="audio", target=[special.begin_audio], replacement=get_replacement)]

    def _place_items(self, prompt_ids: list[int], resolved: Any, maybe_applied: bool) -> tuple[list[int], dict]:
        """mistral-common writes the placeholders into chats and transcriptions: find them first, always."""
        if self.info.get_audio_encoder().special_ids.begin_audio not in prompt_ids and resolved.get("audio"):
            raise InputError(
                "Voxtral takes audio through chat messages (input_audio / audio_url parts), transcription, or "
                "token ids with [BEGIN_AUDIO] where each recording goes; a text prompt cannot hold it."
            )
        return super()._place_items(prompt_ids, resolved, True)


class VoxtralMultiModalProjector(nn.Module):
    def __init__(self, config: VoxtralConfig) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(config.audio_config.intermediate_size, config.text_config.hidden_size, bias=False)
        self.act = ACT2FN[config.projector_hidden_act]
        self.linear_2 = nn.Linear(config.text_config.hidden_size, config.text_config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


@MULTIMODAL_REGISTRY.register_processor(
    VoxtralMultiModalProcessor, info=VoxtralProcessingInfo, dummy_inputs=VoxtralDummyInputsBuilder
)
class VoxtralForConditionalGeneration(nn.Module, SupportsMultiModal, SupportsTranscription):
    supported_languages = ISO639_1_SUPPORTED_LANGS
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

    def __init__(self, config: VoxtralConfig) -> None:
        super().__init__()
        self.config = config
        self.audio_tower = WhisperEncoder(config.audio_config)
        self.multi_modal_projector = VoxtralMultiModalProjector(config)
        self.language_model = ModelRegistry.build_language_model(config)
        self.placeholder_token_id = config.audio_token_id

    def get_language_model(self) -> nn.Module:
        return self.language_model

    def get_multimodal_embeddings(self, **kwargs: object) -> Optional[MultiModalEmbeddings]:
        """One [chunks * 375, hidden] tensor per recording: its chunks' frames, 4 to a token."""
        features, chunks = kwargs.get("input_features"), kwargs.get("audio_num_chunks")
        if features is None:
            return None
        if isinstance(features, (list, tuple)):
            features = torch.cat([torch.as_tensor(f).reshape(-1, *f.shape[-2:]) for f in features])
        counts = [int(c) for c in torch.as_tensor(chunks).reshape(-1)]
        dtype, device = module_dtype_device(self.audio_tower)
        hidden = self.audio_tower(features.to(device=device, dtype=dtype))  # [chunks, positions, D]
        packed = hidden.reshape(-1, self.config.audio_config.intermediate_size)  # 4 frames per token
        tokens = self.multi_modal_projector(packed)
        per_chunk = tokens.shape[0] // max(1, sum(counts))
        return list(torch.split(tokens, [c * per_chunk for c in counts]))

    def forward(
        self, input_ids: Optional[torch.Tensor], positions: torch.Tensor, inputs_embeds: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        return self.language_model(input_ids, positions, inputs_embeds)

    # ---- transcription (SupportsTranscription, as vLLM's) ----------------------------------------

    @classmethod
    def get_speech_to_text_config(cls, model_config: ModelConfig, task_type: str) -> SpeechToTextConfig:
        """Voxtral hears a whole recording in one prompt (chunk by chunk): no windows."""
        rate = audio_encoder_of(cached_tokenizer(model_config)).audio_config.sampling_rate
        return SpeechToTextConfig(sample_rate=int(rate), max_audio_clip_s=None, min_energy_split_window_size=None)

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
        """mistral-common's transcription request: `[INST][BEGIN_AUDIO][AUDIO]...[/INST]lang:xx[TRANSCRIBE]`."""
        return _transcription_prompt(cached_tokenizer(model_config), audio, int(stt_config.sample_rate), language)


def _transcription_prompt(tokenizer: Any, audio: np.ndarray, rate: int, language: Optional[str]) -> dict:
    from mistral_common.protocol.transcription.request import TranscriptionRequest
    from mistral_common.tokens.tokenizers.audio import Audio

    # as a WAV file, as HF's apply_transcription_request hands it over (16-bit samples)
    wav = Audio(audio_array=np.asarray(audio, np.float32), sampling_rate=rate, format="wav").to_base64("wav")
    request = TranscriptionRequest(model="voxtral", audio=wav, language=language, temperature=0.0)
    encoded = tokenizer.tokenizer.encode_transcription(request)
    return {"prompt_token_ids": list(encoded.tokens),
            "multi_modal_data": {"audio": [(a.audio_array, a.sampling_rate) for a in encoded.audios]}}  # fmt: skip
