"""Gemma 4 (Gemma4ForConditionalGeneration): images and video frames through its vision encoder
(gemma4_vision.py), audio through its conformer (gemma4_audio.py), each projected into the text model by a
`Gemma4MultimodalEmbedder` (`embed_vision`, `embed_audio`), and the Gemma 4 text decoder (gemma4.py). Processing
in gemma4_processing.py. As transformers 5.23's Gemma4Model:
- the soft tokens replace the placeholder embeddings as they are (no sqrt(hidden) scale);
- the per-layer embeddings look up the pad id at every placeholder (`takes_input_ids_with_embeds`);
- with `use_bidirectional_attention` "vision", each run of image or video soft tokens attends both ways on the
  sliding layers (`is_mm_prefix_lm` for images and videos; audio stays causal).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from transformers import Gemma4Config

from tessera.models.gemma4_audio import Gemma4AudioModel
from tessera.models.gemma4_processing import (
    Gemma4DummyInputsBuilder,
    Gemma4MultiModalProcessor,
    Gemma4ProcessingInfo,
)
from tessera.models.gemma4_vision import Gemma4MultimodalEmbedder, Gemma4VisionModel
from tessera.models.interfaces import MultiModalEmbeddings, SupportsMultiModal
from tessera.models.registry import ModelRegistry
from tessera.models.utils import module_dtype_device
from tessera.multimodal import MULTIMODAL_REGISTRY


@MULTIMODAL_REGISTRY.register_processor(
    Gemma4MultiModalProcessor, info=Gemma4ProcessingInfo, dummy_inputs=Gemma4DummyInputsBuilder
)
class Gemma4ForConditionalGeneration(nn.Module, SupportsMultiModal):
    takes_input_ids_with_embeds = True  # the per-layer embeddings look the ids up
    bidirectional_modalities = ("image", "video")  # which items' runs attend both ways, when is_mm_prefix_lm
    hf_to_tessera_prefixes = {
        "model.language_model.": "language_model.model.",
        "model.vision_tower.": "vision_tower.",
        "model.audio_tower.": "audio_tower.",
        "model.embed_vision.": "embed_vision.",
        "model.embed_audio.": "embed_audio.",
        "lm_head.": "language_model.lm_head.",
    }

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> Optional[str]:
        return {"image": "<|image|>", "video": "<|video|>", "audio": "<|audio|>"}.get(modality)

    def __init__(self, config: Gemma4Config) -> None:
        super().__init__()
        self.config = config
        text = config.text_config
        self.is_mm_prefix_lm = getattr(text, "use_bidirectional_attention", None) == "vision"
        self.vision_tower = self.embed_vision = self.audio_tower = self.embed_audio = None
        if config.vision_config is not None:
            self.vision_tower = Gemma4VisionModel(config.vision_config)
            self.embed_vision = Gemma4MultimodalEmbedder.from_configs(config.vision_config, text)
        if config.audio_config is not None:
            self.audio_tower = Gemma4AudioModel(config.audio_config)
            self.embed_audio = Gemma4MultimodalEmbedder.from_configs(config.audio_config, text)
        self.language_model = ModelRegistry.build_language_model(config)
        parts = {"vision": "vision_tower", "projector": "embed_vision", "audio": "audio_tower",
                 "audio_projector": "embed_audio"}  # fmt: skip
        self.multimodal_parts = {key: name for key, name in parts.items() if getattr(self, name) is not None}
        self.placeholder_ids = [config.image_token_id, config.video_token_id, config.audio_token_id]
        self.pad_token_id = text.pad_token_id
        unused = self.language_model.model.unused_checkpoint_names
        self.ignored_checkpoint_prefixes = tuple(f"model.language_model.{name}" for name in unused)

    def get_language_model(self) -> nn.Module:
        return self.language_model

    def _pictures(self, pixel_values: Any, position_ids: Any) -> list[torch.Tensor]:
        """Images or frames [N, patches, 3 * patch^2] with their patch positions -> N [soft tokens, hidden]."""
        dtype, device = module_dtype_device(self.vision_tower)
        out = []
        for pixels, positions in _batches(pixel_values, position_ids, 2):  # items of one padded size together
            pixels, positions = pixels.to(device=device, dtype=dtype), positions.to(device=device)
            out += [self.embed_vision(p) for p in self.vision_tower(pixels, positions)]
        return out

    def _audio(self, features: Any, mask: Any) -> list[torch.Tensor]:
        """Clips [N, frames, mel] with their valid-frame masks -> N [soft tokens, hidden]."""
        dtype, device = module_dtype_device(self.audio_tower)
        out = []
        for clips, valid in _batches(features, mask, 1):
            clips, valid = clips.to(device=device, dtype=dtype), valid.to(device=device, dtype=torch.bool)
            out += [self.embed_audio(clip) for clip in self.audio_tower(clips, valid)]
        return out

    def get_multimodal_embeddings(self, **kwargs: object) -> Optional[MultiModalEmbeddings]:
        """One [soft tokens, hidden] tensor per item of the modality in kwargs (a video's frames in order)."""
        if kwargs.get("pixel_values") is not None:
            return self._pictures(kwargs["pixel_values"], kwargs["image_position_ids"])
        if kwargs.get("pixel_values_videos") is not None:
            frames = self._pictures(kwargs["pixel_values_videos"], kwargs["video_position_ids"])
            counts = torch.as_tensor(kwargs["num_frames_per_video"]).reshape(-1).tolist()
            starts = [sum(counts[:i]) for i in range(len(counts))]
            return [torch.cat(frames[start : start + int(n)]) for start, n in zip(starts, counts)]
        if kwargs.get("input_features") is not None:
            return self._audio(kwargs["input_features"], kwargs["input_features_mask"])
        return None

    def forward(
        self, input_ids: Optional[torch.Tensor], positions: torch.Tensor, inputs_embeds: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Hidden states [T, hidden]; the per-layer embeddings see the pad id at every placeholder, as in HF."""
        if input_ids is not None:
            placeholders = torch.isin(input_ids, torch.tensor(self.placeholder_ids, device=input_ids.device))
            input_ids = input_ids.masked_fill(placeholders, self.pad_token_id)
        return self.language_model(input_ids, positions, inputs_embeds)


def _batches(values: Any, companions: Any, companion_dims: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A field ([N, a, b] or a list of per-item [..., a, b] tensors) and its companion (positions [.., a, 2],
    masks [.., a]: `companion_dims` trailing dims), as batches of consecutive items of one padded size (items
    processed apart may be padded differently)."""
    if isinstance(values, torch.Tensor):
        values, companions = [values], [companions]
    batches: list[tuple[list, list]] = []
    for value, companion in zip(values, companions):
        value, companion = torch.as_tensor(value), torch.as_tensor(companion)
        value = value.reshape(-1, *value.shape[-2:])
        companion = companion.reshape(value.shape[0], *companion.shape[companion.ndim - companion_dims :])
        if batches and batches[-1][0][0].shape[1:] == value.shape[1:]:
            batches[-1][0].append(value)
            batches[-1][1].append(companion)
        else:
            batches.append(([value], [companion]))
    return [(torch.cat(v), torch.cat(c)) for v, c in batches]
