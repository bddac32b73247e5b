"""ColQwen2 (ColQwen2ForRetrieval): a Qwen2-VL whose every final hidden state is projected (`embedding_proj_layer`)
and L2-normalized into a multi-vector embedding, for late-interaction retrieval (ColPali): a document page is an
image, a query a text, and their score is MaxSim (layers/pooler.py `similarity`). It runs with the pooling runner
only ("ALL" tokens). As transformers 5.23's modeling_colqwen2.py:
- positions are the plain token indices on the three M-RoPE axes (HF calls the Qwen2-VL model with embeddings and
  no ids, so it never computes the image grids' positions);
- processing is ColQwen2Processor's: an image is embedded alone behind its `visual_prompt_prefix` (a text prompt
  sent with it is replaced, as HF's process_images writes that prefix for every image), a text query as
  `query_prefix` + text + ten pad tokens + a newline (process_queries); token-id prompts are taken as given.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import BatchFeature, ColQwen2Config, ColQwen2Processor, Qwen2VLConfig

from tessera.errors import InputError
from tessera.layers.linear import Linear
from tessera.models.interfaces import MultiModalEmbeddings, SupportsMRoPE, SupportsMultiModal
from tessera.models.qwen2_vl import (
    Qwen2VLDummyInputsBuilder,
    Qwen2VLForConditionalGeneration,
    Qwen2VLMultiModalProcessor,
    Qwen2VLProcessingInfo,
)
from tessera.multimodal import MULTIMODAL_REGISTRY
from tessera.pooling_params import PoolerConfig

QUERY_AUGMENTATION = 10  # pad tokens after a query, as ColQwen2Processor adds them


class ColQwen2ProcessingInfo(Qwen2VLProcessingInfo):
    def get_hf_config(self) -> Qwen2VLConfig:
        return self.ctx.get_hf_config(ColQwen2Config).vlm_config

    def get_hf_processor(self, **kwargs: object) -> ColQwen2Processor:
        return self.ctx.get_hf_processor(ColQwen2Processor, **kwargs)

    def get_supported_mm_limits(self) -> Mapping[str, Optional[int]]:
        return {"image": 1}  # a document page: one image, alone

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int]) -> Mapping[str, int]:
        return {"image": self.get_max_image_tokens()}


class ColQwen2DummyInputsBuilder(Qwen2VLDummyInputsBuilder):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return self.info.get_hf_processor().image_token * mm_counts.get("image", 0)


class ColQwen2MultiModalProcessor(Qwen2VLMultiModalProcessor):
    def apply(self, prompt, mm_data, hf_processor_mm_kwargs: Mapping[str, object] = {}, *, mm_uuids=None):
        """The prompt as ColQwen2Processor writes it (see the module docstring)."""
        processor = self.info.get_hf_processor()
        if isinstance(prompt, str):
            if mm_data and mm_data.get("image") is not None:  # HF writes the visual prompt over any text
                prompt = processor.visual_prompt_prefix
            else:
                pad = processor.query_augmentation_token * QUERY_AUGMENTATION
                prompt = f"{processor.query_prefix}{prompt}{pad}\n"
        return super().apply(prompt, mm_data, hf_processor_mm_kwargs, mm_uuids=mm_uuids)

    def _apply_hf_processor_main(
        self, prompt, mm_items, hf_processor_mm_kwargs, *, enable_hf_prompt_update: bool
    ):  # fmt: skip
        """The text (already written as ColQwen2Processor would) tokenized apart from the image."""
        return super()._apply_hf_processor_main(prompt, mm_items, hf_processor_mm_kwargs, enable_hf_prompt_update=False)

    def _call_hf_processor(
        self, prompt: str, mm_data: Mapping[str, object], mm_kwargs: Mapping[str, object]
    ) -> BatchFeature:
        """ColQwen2Processor takes text or images, not both: the images go to its image processor."""
        processor = self.info.get_hf_processor(**mm_kwargs)
        if not mm_data.get("images"):
            return super()._call_hf_processor(prompt, {}, mm_kwargs)
        text = processor.tokenizer(prompt, return_tensors="pt")
        images = processor.image_processor(images=mm_data["images"], return_tensors="pt")
        return BatchFeature({"input_ids": text["input_ids"], **images})


@MULTIMODAL_REGISTRY.register_processor(
    ColQwen2MultiModalProcessor, info=ColQwen2ProcessingInfo, dummy_inputs=ColQwen2DummyInputsBuilder
)
class ColQwen2ForRetrieval(nn.Module, SupportsMultiModal, SupportsMRoPE):
    multimodal_parts = {"vision": "vlm.visual"}
    runners = ("pooling",)
    default_pooler_config = PoolerConfig("ALL", normalize=True)  # (each vector is already unit length)
    hf_to_tessera_prefixes = {
        "vlm.model.language_model.": "vlm.language_model.model.",
        "vlm.model.visual.": "vlm.visual.",
        "vlm.language_model.": "vlm.language_model.model.",
        "vlm.visual.": "vlm.visual.",
        "vlm.model.": "vlm.language_model.model.",
    }
    ignored_checkpoint_prefixes = ("vlm.lm_head.",)  # retrieval reads no logits

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> Optional[str]:
        return "<|image_pad|>" if modality == "image" else None

    def __init__(self, config: ColQwen2Config) -> None:
        super().__init__()
        self.config = config
        vlm_config = copy.deepcopy(config.vlm_config)
        vlm_config.get_text_config().tie_word_embeddings = True  # no head of its own: the unused one shares weights
        vlm_config.tie_word_embeddings = True
        self.vlm = Qwen2VLForConditionalGeneration(vlm_config)
        hidden = vlm_config.get_text_config().hidden_size
        self.embedding_proj_layer = Linear(hidden, config.embedding_dim, bias=True)
        self.placeholder_token_id = self.vlm.placeholder_token_id

    def get_language_model(self) -> nn.Module:
        return self.vlm.language_model

    def get_multimodal_embeddings(self, **kwargs: object) -> Optional[MultiModalEmbeddings]:
        return self.vlm.get_multimodal_embeddings(**kwargs)

    def get_mrope_input_positions(
        self, input_tokens: list[int], mm_features: Sequence[Any]
    ) -> tuple[torch.Tensor, int]:
        """Plain token indices on all three axes (see the module docstring)."""
        return torch.arange(len(input_tokens)).expand(3, -1), 0

    def forward(
        self, input_ids: Optional[torch.Tensor], positions: torch.Tensor, inputs_embeds: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Each token's embedding [T, embedding_dim], unit length."""
        hidden = self.vlm(input_ids, positions, inputs_embeds)
        embeddings = self.embedding_proj_layer(hidden.to(self.embedding_proj_layer.weight.dtype))
        return F.normalize(embeddings, dim=-1, eps=0.0)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise InputError("ColQwen2 is a retrieval model: it embeds (runner='pooling'), it does not generate.")
