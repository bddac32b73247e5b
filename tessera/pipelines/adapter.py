"""A vision pipeline (tessera.pipelines) + a text LLM seen as one multimodal model, through the same
interfaces as every other model: a BaseMultiModalProcessor (prompt -> tokens, images -> items) and a
SupportsMultiModal model (items -> embeddings). The plugin (`plugin.py`) registers the model as the
architecture PIPELINE_ARCHITECTURE and turns the pipeline options into `hf_overrides` naming it, so the
engine builds it as any model and has no second code path.

Prompts mark each image with IMAGE_MARKER (inline <img> tags and chat image parts become it). The
processor splits the text at the markers, tokenizes each text part on its own (as the webui does),
and puts image_start + placeholder_token_id x num_image_embeds + image_end in each marker's place.
"""

from __future__ import annotations

import functools
import json
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from PIL import Image
from torch import nn
from transformers import BatchFeature, PretrainedConfig

from ..config import ModelConfig
from ..models.interfaces import MultiModalEmbeddings, SupportsMultiModal
from ..models.registry import ModelRegistry
from ..models.utils import module_dtype_device
from ..multimodal import MULTIMODAL_REGISTRY
from ..multimodal.inputs import MultiModalFieldConfig, MultiModalKwargs
from ..multimodal.parse import MultiModalDataItems
from ..multimodal.processing import BaseMultiModalProcessor, BaseProcessingInfo
from ..multimodal.profiling import BaseDummyInputsBuilder
from ..multimodal.prompt_updates import PromptReplacement, PromptUpdateDetails
from .base import AbstractMultimodalPipeline
from .discovery import load_pipeline
from .plugin import PIPELINE_SETTINGS

IMAGE_MARKER = "<image>"


class PipelineProcessingInfo(BaseProcessingInfo):
    @functools.cached_property
    def pipeline(self) -> AbstractMultimodalPipeline:
        """The pipeline of the model config (the loaded model's own, when it is loaded in this process)."""
        pipeline = pipeline_of(self.ctx.model_config)
        pipeline.attach(pipeline.text_model, self.get_tokenizer())  # type: ignore[arg-type]  (processing needs it)
        return pipeline

    def get_supported_mm_limits(self) -> Mapping[str, Optional[int]]:
        return {"image": None}

    def marker_ids(self) -> tuple[list[int], list[int]]:
        """Token ids of the pipeline's image start and end texts (empty when it has none)."""
        tokenizer = self.get_tokenizer()
        encode = lambda text: tokenizer.encode(text, add_special_tokens=False) if text else []  # noqa: E731
        return encode(self.pipeline.image_start()), encode(self.pipeline.image_end())

    def image_token_ids(self) -> list[int]:
        start, end = self.marker_ids()
        return start + [self.pipeline.placeholder_token_id()] * self.pipeline.num_image_embeds() + end

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int]) -> Mapping[str, int]:
        return {"image": self.pipeline.num_image_embeds()}


class PipelineDummyInputsBuilder(BaseDummyInputsBuilder[PipelineProcessingInfo]):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return IMAGE_MARKER * mm_counts.get("image", 0)

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int]) -> Mapping[str, Any]:
        return {"image": [Image.new("RGB", (336, 336), (128, 128, 128))] * mm_counts.get("image", 0)}


class PipelineMultiModalProcessor(BaseMultiModalProcessor[PipelineProcessingInfo]):
    def _call_hf_processor(
        self, prompt: str, mm_data: Mapping[str, object], mm_kwargs: Mapping[str, object]
    ) -> BatchFeature:
        tokenizer = self.info.get_tokenizer()
        image_ids = self.info.image_token_ids()
        ids: list[int] = []
        for k, piece in enumerate(prompt.split(IMAGE_MARKER)):
            if k > 0:
                ids += image_ids
            if k == 0 or piece:
                ids += tokenizer.encode(piece, add_special_tokens=k == 0)
        images = [_as_rgb_tensor(image) for image in mm_data.get("images", [])]  # type: ignore[union-attr]
        out: dict[str, Any] = {"input_ids": torch.tensor([ids])}
        if images:
            out["image_pixels"] = images
        return BatchFeature(out)

    def _get_mm_fields_config(self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]):
        return {"image_pixels": MultiModalFieldConfig.batched("image")}

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_mm_kwargs: MultiModalKwargs,
    ) -> Sequence[PromptReplacement]:
        replacement = PromptUpdateDetails.select_token_id(
            self.info.image_token_ids(), embed_token_id=self.info.pipeline.placeholder_token_id()
        )
        return [PromptReplacement(modality="image", target=IMAGE_MARKER, replacement=replacement)]

    def _place_items(self, prompt_ids: list[int], resolved: Any, maybe_applied: bool) -> tuple[list[int], dict]:
        # Text always goes through _call_hf_processor, which expands every marker itself (also on the
        # cached path), so the placeholders are there to be found.
        return super()._place_items(prompt_ids, resolved, True)


def _as_rgb_tensor(image: Any) -> torch.Tensor:
    """An image as uint8 [H, W, 3] (hashable, cacheable), back to PIL for the pipeline later."""
    if isinstance(image, torch.Tensor):  # CHW, as the parser accepts
        image = Image.fromarray(image.permute(1, 2, 0).to(torch.uint8).numpy())
    elif isinstance(image, np.ndarray):
        image = Image.fromarray(image)
    return torch.from_numpy(np.asarray(image.convert("RGB")).copy())


@MULTIMODAL_REGISTRY.register_processor(
    PipelineMultiModalProcessor, info=PipelineProcessingInfo, dummy_inputs=PipelineDummyInputsBuilder
)
class PipelineForCausalLM(nn.Module, SupportsMultiModal):
    """The text LLM with the pipeline's image embeddings merged in at the placeholder positions."""

    chat_placeholders_inline = True  # a text model's chat template knows no image parts
    supports_tensor_parallel = False  # the pipeline's vision tower runs whole, outside the ranks
    # Original LLaVA checkpoints carry the projector and vision tower beside the text weights.
    ignored_checkpoint_prefixes = ("model.mm_projector.", "model.vision_tower.")

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.language_model = ModelRegistry.resolve_text_model_cls(config)(config)  # by config.model_type
        self.pipeline: Optional[AbstractMultimodalPipeline] = None  # loaded by finish_loading

    @property
    def hf_to_tessera_prefixes(self) -> dict[str, str]:
        """The text model's checkpoint names, under `language_model.`."""
        inner = getattr(self.language_model, "hf_to_tessera_prefixes", {})
        return {**{old: "language_model." + new for old, new in inner.items()}, "": "language_model."}

    def finish_loading(self, model_config: ModelConfig) -> None:
        """Called by the loader once the text weights are in: the pipeline loads its own parts."""
        self.pipeline = pipeline_of(model_config)
        self.pipeline.attach(self.language_model, self.pipeline.tokenizer)

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> Optional[str]:
        return IMAGE_MARKER if modality == "image" else None

    def get_language_model(self) -> nn.Module:
        return self.language_model

    def get_multimodal_embeddings(self, **kwargs: object) -> Optional[MultiModalEmbeddings]:
        pixels = kwargs.get("image_pixels")
        if pixels is None:
            return None
        images = [Image.fromarray(p.numpy()) for p in pixels]  # type: ignore[union-attr]
        with torch.no_grad():
            embeddings = self.pipeline.embed_images(images)
        hidden = self.language_model.config.hidden_size
        expected = (len(images), self.pipeline.num_image_embeds(), hidden)
        if tuple(embeddings.shape) != expected:
            raise ValueError(
                f"Pipeline {self.pipeline.name()!r} returned embeddings of shape {tuple(embeddings.shape)} "
                f"for {len(images)} image(s); expected {expected} (images, num_image_embeds, text hidden size)"
            )
        dtype, device = module_dtype_device(self.language_model)
        return embeddings.to(device=device, dtype=dtype)

    def embed_text_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.pipeline.embed_tokens(input_ids)  # the pipeline may embed text its own way

    def forward(
        self, input_ids: Optional[torch.Tensor], positions: torch.Tensor, inputs_embeds: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Hidden states [T, hidden]; items are merged into inputs_embeds by get_input_embeddings."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_text_tokens(input_ids)  # the pipeline's text embeddings
        return self.language_model(None, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden_states)


# The pipeline of each configuration, shared by the model and its processor in one process (a pipeline
# loads weights of its own), and dropped with them.
_pipelines: weakref.WeakValueDictionary[tuple, AbstractMultimodalPipeline] = weakref.WeakValueDictionary()


def pipeline_of(model_config: ModelConfig) -> AbstractMultimodalPipeline:
    """The pipeline the config's PIPELINE_SETTINGS choose: by name, else by the model folder's name."""
    settings = dict(getattr(model_config.hf_config, PIPELINE_SETTINGS, None) or {})
    name = settings.get("name")
    name = None if name in (None, "auto") else name
    params = {"model_path": str(model_config.model), **(settings.get("params") or {})}
    key = (model_config.model, name, settings.get("pipelines_dir"), json.dumps(params, sort_keys=True, default=str))
    pipeline = _pipelines.get(key)
    if pipeline is None:
        pipeline = load_pipeline(name, model_name=Path(model_config.model).name, params=params,
                                 pipelines_dir=settings.get("pipelines_dir"))  # fmt: skip
        _pipelines[key] = pipeline
    return pipeline
