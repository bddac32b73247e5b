"""LLaVA-NeXT (LLaVA-1.6): a CLIP (or SigLIP) tower, LLaVA's projector and the language model that
text_config.model_type names in the text-model registry (Llama, Mistral...). Processing as in vLLM's
llava_next.py.

"anyres": the HF image processor picks the grid of `image_grid_pinpoints` that best fits the image,
resizes it into that grid (keeping the aspect ratio, padding the rest) and cuts it into tiles of the
tower's size, preceded by the whole image resized (the base tile). The model runs every tile through the
tower, keeps the base tile's features as they are, lays the other tiles' features out as one grid,
removes the rows or columns that only saw padding (HF's unpad_image, on the original image size) and
appends the `image_newline` embedding after each row. Each `<image>` of the prompt becomes one token per
feature: base + unpadded + one per row, as the HF processor counts them (its _get_number_of_features).

Our processor keeps each image's own tiles (the HF processor pads every image of a call to the most
tiles), so an item is the same whether it was processed alone or with others.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
from torch import nn
from transformers import BatchFeature, LlavaNextConfig, LlavaNextProcessor, PretrainedConfig
from transformers.image_processing_utils import select_best_resolution

from tessera.models.clip import CLIPVisionModel
from tessera.models.interfaces import MultiModalEmbeddings, SupportsMultiModal
from tessera.models.llava import (
    LlavaDummyInputsBuilder,
    LlavaMultiModalProcessor,
    LlavaMultiModalProjector,
    LlavaProcessingInfo,
)
from tessera.models.registry import ModelRegistry
from tessera.models.siglip import SiglipVisionModel
from tessera.models.utils import module_dtype_device
from tessera.multimodal import MULTIMODAL_REGISTRY
from tessera.multimodal.inputs import MultiModalFieldConfig
from tessera.multimodal.parse import ImageSize

# ---- anyres arithmetic (HF's, on plain ints) ---------------------------------------------------------


def best_resolution(image_height: int, image_width: int, grid_pinpoints: Sequence[Sequence[int]]) -> tuple[int, int]:
    """The (height, width) of `grid_pinpoints` that HF's image processor resizes this image into."""
    height, width = select_best_resolution((image_height, image_width), [list(p) for p in grid_pinpoints])
    return int(height), int(width)


def anyres_grid_shape(
    image_height: int, image_width: int, grid_pinpoints: Sequence[Sequence[int]], tile_size: int
) -> tuple[int, int]:
    """(rows, columns) of tiles of the image's best grid."""
    height, width = best_resolution(image_height, image_width, grid_pinpoints)
    return height // tile_size, width // tile_size


def num_anyres_tiles(image_height: int, image_width: int, grid_pinpoints: Sequence[Sequence[int]], tile: int) -> int:
    """Tiles HF's image processor makes of an image: its grid's plus the base image."""
    rows, columns = anyres_grid_shape(image_height, image_width, grid_pinpoints, tile)
    return rows * columns + 1


def unpadded_shape(original_height: int, original_width: int, height: int, width: int) -> tuple[int, int, int, int]:
    """HF's unpad_image on a [height, width] feature grid of an image of the original size: the
    (top, bottom, left, right) bounds of the rows and columns that saw the image, not the padding."""
    if original_width / original_height > width / height:
        new_height = int(round(original_height * (width / original_width), 7))
        padding = (height - new_height) // 2
        return padding, height - padding, 0, width
    new_width = int(round(original_width * (height / original_height), 7))
    padding = (width - new_width) // 2
    return 0, height, padding, width - padding


def max_patches_ratio(vision_aspect_ratio: Optional[str], height: int, width: int, side: int) -> Optional[float]:
    """LLaVA-OneVision's "anyres_max_N": the factor by which an unpadded [height, width] feature grid is
    shrunk (bilinear) when it exceeds N tiles of side x side features by more than 10%; None if not."""
    if not vision_aspect_ratio or not vision_aspect_ratio.startswith("anyres_max_"):
        return None
    max_num_patches = int(vision_aspect_ratio.strip("anyres_max_"))
    ratio = math.sqrt(height * width / (max_num_patches * side**2))
    return ratio if ratio > 1.1 else None


def build_vision_tower(vision_config: PretrainedConfig) -> nn.Module:
    """The tower a LLaVA-style config names: CLIP or SigLIP; both return the hidden states at given layers."""
    towers = {"clip_vision_model": CLIPVisionModel, "siglip_vision_model": SiglipVisionModel}
    if vision_config.model_type not in towers:
        raise ValueError(
            f"Unsupported vision tower {vision_config.model_type!r}; supported: {', '.join(sorted(towers))}"
        )
    return towers[vision_config.model_type](vision_config)


# ---- processing ----------------------------------------------------------------------------------------


class LlavaNextProcessingInfo(LlavaProcessingInfo):
    """LLaVA's, with anyres token counts and the largest image among the grid pinpoints."""

    def get_hf_config(self) -> LlavaNextConfig:
        return self.ctx.get_hf_config(LlavaNextConfig)

    def get_hf_processor(self, **kwargs: object) -> LlavaNextProcessor:
        return self.ctx.get_hf_processor(LlavaNextProcessor, **kwargs)

    def get_tile_size(self) -> tuple[int, int]:
        """(height, width) of each tile the image processor outputs (its crop, else its size)."""
        image_processor = self.get_hf_processor().image_processor
        crop, size = getattr(image_processor, "crop_size", None), image_processor.size

        def get(sizes: Any, key: str) -> Optional[int]:  # a dict, or transformers' SizeDict
            return sizes.get(key) if isinstance(sizes, Mapping) else getattr(sizes, key, None)

        if getattr(image_processor, "do_center_crop", False) and crop and get(crop, "height"):
            return get(crop, "height"), get(crop, "width")
        if get(size, "height"):
            return get(size, "height"), get(size, "width")
        return get(size, "shortest_edge"), get(size, "shortest_edge")

    def get_grid_pinpoints(self) -> list[list[int]]:
        return [list(p) for p in self.get_hf_processor().image_processor.image_grid_pinpoints]

    def _base_features(self, tile_height: int, tile_width: int) -> tuple[int, int, int]:
        """(features of the base tile, feature rows and columns of a tile), as the HF processor counts them."""
        processor = self.get_hf_processor()
        rows, columns = tile_height // processor.patch_size, tile_width // processor.patch_size
        base = rows * columns + processor.num_additional_image_tokens
        return base - (processor.vision_feature_select_strategy == "default"), rows, columns

    def _unpadded_features(self, height: int, width: int, rows: int, columns: int) -> tuple[int, int]:
        """(unpadded features, newlines) of an image whose grid holds rows x columns features."""
        top, bottom, left, right = unpadded_shape(height, width, rows, columns)
        return (bottom - top) * (right - left), bottom - top

    def get_num_image_tokens(self, *, image_width: int, image_height: int) -> int:
        tile_height, tile_width = self.get_tile_size()
        base, rows, columns = self._base_features(tile_height, tile_width)
        best_height, best_width = best_resolution(image_height, image_width, self.get_grid_pinpoints())
        rows, columns = rows * (best_height // tile_height), columns * (best_width // tile_width)
        unpadded, newlines = self._unpadded_features(image_height, image_width, rows, columns)
        return base + unpadded + newlines

    def get_image_size_with_most_features(self) -> ImageSize:
        """The grid pinpoint whose image gets the most tokens (vLLM's rule)."""
        best = max(
            (self.get_num_image_tokens(image_width=width, image_height=height), -i, width, height)
            for i, (height, width) in enumerate(self.get_grid_pinpoints())
        )
        return ImageSize(width=best[2], height=best[3])


LlavaNextDummyInputsBuilder = LlavaDummyInputsBuilder  # black images of the size with the most features


def split_padded_tiles(processed: BatchFeature, grid_pinpoints: Sequence[Sequence[int]]) -> BatchFeature:
    """pixel_values [N, max_tiles, C, H, W] (padded by the HF processor to the most tiles of the call) ->
    one [tiles, C, H, W] tensor per image, its own tiles only (the count follows from image_sizes)."""
    pixel_values, image_sizes = processed.get("pixel_values"), processed.get("image_sizes")
    if pixel_values is None or image_sizes is None:
        return processed
    tile = pixel_values[0].shape[-1]
    processed["pixel_values"] = [
        pixels[: num_anyres_tiles(int(size[0]), int(size[1]), grid_pinpoints, tile)]
        for pixels, size in zip(pixel_values, image_sizes)
    ]
    return processed


class LlavaNextMultiModalProcessor(LlavaMultiModalProcessor):
    """LLaVA's prompt updates (its `image_token_index` repeated get_num_image_tokens times, or an
    embedding's length); each image's own tiles and its original size."""

    def _call_hf_processor(
        self, prompt: str, mm_data: Mapping[str, object], mm_kwargs: Mapping[str, object]
    ) -> BatchFeature:
        processed = super()._call_hf_processor(prompt, mm_data, mm_kwargs)
        return split_padded_tiles(processed, self.info.get_grid_pinpoints())

    def _get_mm_fields_config(
        self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        return dict(
            super()._get_mm_fields_config(hf_inputs, hf_processor_mm_kwargs),
            image_sizes=MultiModalFieldConfig.batched("image"),
        )


# ---- the model -----------------------------------------------------------------------------------------


def _as_list(value: Any, name: str) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return list(value)
    if isinstance(value, (list, tuple)):
        return [torch.as_tensor(v) for v in value]
    raise ValueError(f"{name} must be a tensor or a list of tensors")


@MULTIMODAL_REGISTRY.register_processor(
    LlavaNextMultiModalProcessor, info=LlavaNextProcessingInfo, dummy_inputs=LlavaNextDummyInputsBuilder
)
class LlavaNextForConditionalGeneration(nn.Module, SupportsMultiModal):
    multimodal_parts = {"vision": "vision_tower", "projector": "multi_modal_projector"}
    # Hub checkpoints: "language_model.model.*", "vision_tower.vision_model.*", "image_newline"...;
    # transformers 5's in-memory layout nests the parts under "model." (first match wins).
    hf_to_tessera_prefixes = {
        "model.language_model.": "language_model.model.",
        "model.vision_tower.vision_model.": "vision_tower.vision_model.",
        "model.vision_tower.": "vision_tower.vision_model.",
        "vision_tower.vision_model.": "vision_tower.vision_model.",
        "vision_tower.": "vision_tower.vision_model.",
        "model.multi_modal_projector.": "multi_modal_projector.",
        "model.image_newline": "image_newline",
        "lm_head.": "language_model.lm_head.",
    }
    vision_aspect_ratio: Optional[str] = None  # LLaVA-OneVision's "anyres_max_N"

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> Optional[str]:
        return "<image>" if modality == "image" else None

    def __init__(self, config: LlavaNextConfig) -> None:
        super().__init__()
        self.config = config
        layers = config.vision_feature_layer
        self.feature_layers = [layers] if isinstance(layers, int) else list(layers)
        if config.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(
                f"Unexpected vision_feature_select_strategy {config.vision_feature_select_strategy!r}; "
                "expected 'default' or 'full'."
            )
        text_config = config.text_config
        self.vision_tower = build_vision_tower(config.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(config, len(self.feature_layers))
        self.image_newline = nn.Parameter(torch.empty(text_config.hidden_size))
        self.language_model = ModelRegistry.build_language_model(config)
        self.placeholder_token_id = config.image_token_index
        self.tile_size = config.vision_config.image_size
        self.tile_side = config.vision_config.image_size // config.vision_config.patch_size

    def get_language_model(self) -> nn.Module:
        return self.language_model

    def _tile_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Tiles [N, C, H, W] -> projected features [N, side * side, hidden] (CLS dropped by "default")."""
        dtype, device = module_dtype_device(self.vision_tower)
        states = self.vision_tower(pixel_values.to(device=device, dtype=dtype), self.feature_layers)
        if self.config.vision_feature_select_strategy == "default":
            states = [s[:, 1:] for s in states]
        features = torch.cat(states, dim=-1)
        dtype, device = module_dtype_device(self.multi_modal_projector)
        return self.multi_modal_projector(features.to(device=device, dtype=dtype))

    def _with_newlines(self, grid: torch.Tensor) -> torch.Tensor:
        """A feature grid [hidden, rows, columns] -> [rows * (columns + 1), hidden], image_newline after each row."""
        newline = self.image_newline.to(grid)[:, None, None].expand(*grid.shape[:-1], 1)
        return torch.cat((grid, newline), dim=-1).flatten(1, 2).transpose(0, 1)

    def _pack_image(self, features: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
        """One image's tile features [tiles, side * side, hidden] -> its embeddings [num_tokens, hidden]."""
        if features.shape[0] == 1:  # no grid (OneVision's multi-image mode): base tile, one newline
            return torch.cat((features[0], self.image_newline[None].to(features)))
        base, tiles = features[0], features[1:]
        side = self.tile_side
        height, width = image_size
        rows, columns = anyres_grid_shape(height, width, self.config.image_grid_pinpoints, self.tile_size)
        if tiles.shape[0] != rows * columns:
            raise ValueError(f"An image of size {image_size} has {rows}x{columns} tiles; got {tiles.shape[0]}")
        grid = tiles.reshape(rows, columns, side, side, -1).permute(4, 0, 2, 1, 3).flatten(1, 2).flatten(2, 3)
        top, bottom, left, right = unpadded_shape(height, width, grid.shape[1], grid.shape[2])
        grid = grid[:, top:bottom, left:right]
        ratio = max_patches_ratio(self.vision_aspect_ratio, grid.shape[1], grid.shape[2], side)
        if ratio is not None:
            size = [int(grid.shape[1] // ratio), int(grid.shape[2] // ratio)]
            grid = nn.functional.interpolate(grid[None], size, mode="bilinear")[0]
        return torch.cat((base, self._with_newlines(grid)))

    def _image_embeddings(self, pixel_values: Any, image_sizes: Any) -> list[torch.Tensor]:
        """Each image's tiles ([tiles, C, H, W], or padded [N, max_tiles, C, H, W]) with its (height, width)
        -> one [num_tokens, hidden] tensor per image."""
        if image_sizes is None:
            raise ValueError("pixel_values need image_sizes (each image's original height and width)")
        sizes = [tuple(int(x) for x in torch.as_tensor(s).reshape(2)) for s in _as_list(image_sizes, "image_sizes")]
        pixels = _as_list(pixel_values, "pixel_values")
        if len(pixels) != len(sizes) or any(p.ndim != 4 for p in pixels):
            raise ValueError("pixel_values must hold one (tiles, channels, height, width) tensor per image")
        counts = [num_anyres_tiles(h, w, self.config.image_grid_pinpoints, self.tile_size) for h, w in sizes]
        counts = [1 if p.shape[0] == 1 else n for p, n in zip(pixels, counts)]  # a lone base tile: no grid
        features = self._tile_features(torch.cat([p[:n] for p, n in zip(pixels, counts)]))
        return [self._pack_image(f, size) for f, size in zip(features.split(counts), sizes)]

    def get_multimodal_embeddings(self, **kwargs: object) -> Optional[MultiModalEmbeddings]:
        if kwargs.get("image_embeds") is not None:
            return kwargs["image_embeds"]  # type: ignore[return-value]
        if kwargs.get("pixel_values") is None:
            return None
        return self._image_embeddings(kwargs["pixel_values"], kwargs.get("image_sizes"))

    def forward(
        self, input_ids: Optional[torch.Tensor], positions: torch.Tensor, inputs_embeds: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        return self.language_model(input_ids, positions, inputs_embeds)
