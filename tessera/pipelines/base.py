"""The pipeline interface of text-generation-webui's multimodal extension: a vision tower plus
projector that turns images into embeddings for a text LLM.

Tessera runs a pipeline through its own processing framework and engine (see
tessera/models/pipeline_adapter.py), so a pipeline gets processor caching, batching, chunked
prefill and prefix caching without code of its own. What differs from the webui: `embed_tokens`
and `placeholder_embeddings` have defaults that use the text model Tessera attaches, and
`num_image_embeds` may depend on the loaded vision tower."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional

import torch
from PIL import Image
from torch import nn

from ..config import DTYPE_NAMES


class AbstractMultimodalPipeline(ABC):
    text_model: Optional[nn.Module] = None
    """The text LLM (Tessera's model), attached before the first use."""

    tokenizer: Any = None
    """The text LLM's tokenizer, attached before the first use."""

    @staticmethod
    @abstractmethod
    def name() -> str:
        """The pipeline's unique name, as given to --multimodal-pipeline."""

    @staticmethod
    @abstractmethod
    def image_start() -> Optional[str]:
        """Text put before each image's embeddings (e.g. "<im_start>"), or None."""

    @staticmethod
    @abstractmethod
    def image_end() -> Optional[str]:
        """Text put after each image's embeddings (e.g. "<im_end>"), or None."""

    @abstractmethod
    def placeholder_token_id(self) -> int:
        """The token id that stands for each image embedding position in the prompt."""

    @abstractmethod
    def num_image_embeds(self) -> int:
        """How many embeddings one image becomes."""

    @abstractmethod
    def embed_images(self, images: list[Image.Image]) -> torch.Tensor:
        """Images -> embeddings [num_images, num_image_embeds, text hidden size]."""

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Text token embeddings, by the attached text model's embedding table."""
        if self.text_model is None:
            raise RuntimeError(f"Pipeline {self.name()!r} has no text model attached")
        return self.text_model.get_input_embeddings(input_ids)

    def placeholder_embeddings(self) -> torch.Tensor:
        """The embeddings of one image's placeholder tokens [num_image_embeds, hidden]."""
        ids = torch.full((self.num_image_embeds(),), self.placeholder_token_id(), dtype=torch.long)
        return self.embed_tokens(ids)

    def attach(self, text_model: nn.Module, tokenizer: Any) -> None:
        """Called by Tessera once the text model and tokenizer are loaded."""
        self.text_model, self.tokenizer = text_model, tokenizer

    # ---- helpers for params (vision_device, vision_bits, projector_device, projector_bits) ----------

    def _get_device(self, setting_name: str, params: dict) -> torch.device:
        """params[setting_name] as a torch.device; unset: the GPU if there is one, else the CPU."""
        value = (params or {}).get(setting_name)
        if value is None:
            return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
        return torch.device(value)

    def _get_dtype(self, setting_name: str, params: dict) -> torch.dtype:
        """params[setting_name] (bits: 32 or 16, or a name such as "bf16") as a torch.dtype; unset: float32."""
        value = (params or {}).get(setting_name)
        if value is None:
            return torch.float32
        if isinstance(value, str) and value.lower() in DTYPE_NAMES:
            return DTYPE_NAMES[value.lower()]
        bits = int(value)
        if bits not in (16, 32):
            raise ValueError(f"{setting_name} must be 16 or 32 (or bf16), got {value!r}")
        return torch.float32 if bits == 32 else torch.float16
