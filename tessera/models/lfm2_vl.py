"""LFM2-VL (Liquid AI): a SigLIP2 NaFlex tower over image tiles (siglip2.py), a projector (pixel unshuffle by
`downsample_factor`, layer norm, two linears with GELU) and the LFM2 hybrid decoder (lfm2.py, with its
per-sequence conv state). As transformers' modeling_lfm2_vl.py.

The HF image processor resizes an image to multiples of encoder_patch_size * downsample_factor within
[min_image_tokens, max_image_tokens]; one larger than max_pixels_tolerance times that is cut into rows x cols
tiles of tile_size (the grid closest to its aspect ratio among min_tiles..max_tiles) followed by the whole
image resized as a thumbnail. Each `<image>` becomes `<|image_start|>`, per tile `<|img_row_r_col_c|>` + its
`<image>` tokens, `<|img_thumbnail|>` + the thumbnail's, `<|image_end|>` (a single tile: its `<image>`
tokens only); only the `<image>` tokens take embeddings. pixel_values come as [tiles of all images,
max_patches, C * patch**2] with their spatial_shapes; item i is its num_tiles of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
from torch import nn
from transformers import BatchFeature, Lfm2VlConfig, Lfm2VlProcessor

from tessera.layers.activations import get_activation
from tessera.models.interfaces import MultiModalEmbeddings, SupportsMultiModal
from tessera.models.registry import ModelRegistry
from tessera.models.siglip2 import Siglip2VisionModel
from tessera.models.utils import module_dtype_device
from tessera.multimodal import MULTIMODAL_REGISTRY
from tessera.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargs
from tessera.multimodal.parse import ImageProcessorItems, ImageSize, MultiModalDataItems, image_size_of
from tessera.multimodal.processing import (
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    PromptReplacement,
    PromptUpdate,
    PromptUpdateDetails,
)
from tessera.multimodal.profiling import BaseDummyInputsBuilder

IMAGE_TOKEN = "<image>"
_SETTINGS = ("downsample_factor", "do_image_splitting", "min_tiles", "max_tiles", "use_thumbnail", "min_image_tokens",
             "max_image_tokens", "encoder_patch_size", "tile_size", "max_pixels_tolerance")  # fmt: skip


class Lfm2VlProcessingInfo(BaseProcessingInfo):
    def get_hf_config(self) -> Lfm2VlConfig:
        return self.ctx.get_hf_config(Lfm2VlConfig)

    def get_hf_processor(self, **kwargs: object) -> Lfm2VlProcessor:
        return self.ctx.get_hf_processor(Lfm2VlProcessor, **kwargs)

    def get_supported_mm_limits(self) -> Mapping[str, Optional[int]]:
        return {"image": None}

    def _settings(self, mm_kwargs: Mapping[str, object]) -> dict[str, Any]:
        """The image processor's tiling settings, with the request's and the model's mm_processor_kwargs applied."""
        image_processor = self.get_hf_processor(**mm_kwargs).image_processor
        kwargs = self.ctx.get_merged_mm_kwargs(mm_kwargs)
        return {name: kwargs.get(name, getattr(image_processor, name)) for name in _SETTINGS}

    def get_image_layout(
        self, *, image_width: int, image_height: int, mm_kwargs: Mapping[str, object] = {}
    ) -> tuple[int, int, list[int]]:
        """(rows, cols, [height, width] of the resized whole image) as the HF image processor computes them."""
        s, image_processor = self._settings(mm_kwargs), self.get_hf_processor(**mm_kwargs).image_processor
        min_tiles, max_tiles = (s["min_tiles"], s["max_tiles"]) if s["do_image_splitting"] else (1, 1)
        large = image_processor._is_image_too_large(
            height=image_height, width=image_width, max_image_tokens=s["max_image_tokens"],
            encoder_patch_size=s["encoder_patch_size"], downsample_factor=s["downsample_factor"],
            max_pixels_tolerance=s["max_pixels_tolerance"],
        )  # fmt: skip
        width, height = image_processor.smart_resize(
            height=image_height, width=image_width, downsample_factor=s["downsample_factor"],
            min_image_tokens=s["min_image_tokens"], max_image_tokens=s["max_image_tokens"],
            encoder_patch_size=s["encoder_patch_size"],
        )  # fmt: skip
        rows = cols = 1
        if large and not min_tiles == max_tiles == 1:
            cols, rows, *_ = image_processor._get_grid_layout(
                image_height, image_width, min_tiles=min_tiles, max_tiles=max_tiles, tile_size=s["tile_size"]
            )
        return rows, cols, [height, width]

    def get_num_tiles(self, *, image_width: int, image_height: int, mm_kwargs: Mapping[str, object] = {}) -> int:
        rows, cols, _ = self.get_image_layout(image_width=image_width, image_height=image_height, mm_kwargs=mm_kwargs)
        if rows * cols == 1:
            return 1
        return rows * cols + int(bool(self._settings(mm_kwargs)["use_thumbnail"]))

    def get_image_repl(self, *, image_width: int, image_height: int, mm_kwargs: Mapping[str, object] = {}) -> str:
        """The text an image's `<image>` becomes (built by the HF processor's own method)."""
        rows, cols, size = self.get_image_layout(
            image_width=image_width, image_height=image_height, mm_kwargs=mm_kwargs
        )
        processor = self.get_hf_processor(**mm_kwargs)
        kwargs = dict(self._settings(mm_kwargs))
        merged = self.ctx.get_merged_mm_kwargs(mm_kwargs)
        special = merged.get("use_image_special_tokens", processor.use_image_special_tokens)
        layout = {"image_rows": [rows], "image_cols": [cols], "image_sizes": [size]}
        return processor.replace_image_token(layout, image_idx=0, use_image_special_tokens=special, **kwargs)

    def get_image_size_with_most_features(self) -> ImageSize:
        """Of the tile grids the processor may choose, an image that gets the one with the most tokens."""
        s = self._settings({})
        tile = s["tile_size"]
        best, best_tokens = ImageSize(width=tile, height=tile), -1
        for cols in range(1, s["max_tiles"] + 1):
            for rows in range(1, s["max_tiles"] // cols + 1):
                size = ImageSize(width=2 * tile * cols, height=2 * tile * rows)
                tokens = self.get_image_repl(image_width=size.width, image_height=size.height).count(IMAGE_TOKEN)
                if tokens > best_tokens:
                    best, best_tokens = size, tokens
        return best

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int]) -> Mapping[str, int]:
        size = self.get_image_size_with_most_features()
        repl = self.get_image_repl(image_width=size.width, image_height=size.height)
        return {"image": len(self.get_tokenizer().encode(repl, add_special_tokens=False))}


class Lfm2VlDummyInputsBuilder(BaseDummyInputsBuilder[Lfm2VlProcessingInfo]):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return IMAGE_TOKEN * mm_counts.get("image", 0)

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int]):
        width, height = self.info.get_image_size_with_most_features()
        return {"image": self._get_dummy_images(width=width, height=height, num_images=mm_counts.get("image", 0))}


class Lfm2VlMultiModalProcessor(BaseMultiModalProcessor[Lfm2VlProcessingInfo]):
    def _call_hf_processor(
        self, prompt: str, mm_data: Mapping[str, object], mm_kwargs: Mapping[str, object]
    ) -> BatchFeature:
        """HF's outputs and each image's number of tiles (num_tiles), so that items split apart."""
        processed = super()._call_hf_processor(prompt, mm_data, mm_kwargs)
        images = mm_data.get("images")
        if not images:
            return processed
        sizes = [image_size_of(image) for image in images]
        num_tiles = [
            self.info.get_num_tiles(image_width=s.width, image_height=s.height, mm_kwargs=mm_kwargs) for s in sizes
        ]
        if processed["pixel_values"].shape[0] != sum(num_tiles):
            raise RuntimeError(
                f"The HF processor cut {processed['pixel_values'].shape[0]} tiles for images that should give "
                f"{num_tiles}"
            )
        processed["num_tiles"] = torch.tensor(num_tiles)
        return processed

    def _get_mm_fields_config(
        self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        num_tiles = hf_inputs.get("num_tiles", torch.empty(0, dtype=torch.long))
        return dict(
            pixel_values=MultiModalFieldConfig.flat_from_sizes("image", num_tiles),
            pixel_attention_mask=MultiModalFieldConfig.flat_from_sizes("image", num_tiles),
            spatial_shapes=MultiModalFieldConfig.flat_from_sizes("image", num_tiles),
            num_tiles=MultiModalFieldConfig.batched("image"),
        )

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_mm_kwargs: MultiModalKwargs,
    ) -> Sequence[PromptUpdate]:
        tokenizer = self.info.get_tokenizer()
        image_token_id = self.info.get_hf_config().image_token_id

        def get_replacement(item_idx: int) -> PromptUpdateDetails:
            size = mm_items.get_items("image", ImageProcessorItems).get_image_size(item_idx)
            repl = self.info.get_image_repl(
                image_width=size.width, image_height=size.height, mm_kwargs=hf_processor_mm_kwargs
            )
            return PromptUpdateDetails.select_token_id(tokenizer.encode(repl, add_special_tokens=False), image_token_id)

        return [PromptReplacement(modality="image", target=[image_token_id], replacement=get_replacement)]


class Lfm2VlMultiModalProjector(nn.Module):
    def __init__(self, config: Lfm2VlConfig) -> None:
        super().__init__()
        self.factor = config.downsample_factor
        width = config.vision_config.hidden_size * self.factor**2
        self.layer_norm = nn.LayerNorm(width) if getattr(config, "projector_use_layernorm", True) else None
        bias = getattr(config, "projector_bias", True)
        self.linear_1 = nn.Linear(width, config.projector_hidden_size, bias=bias)
        self.act = get_activation(config.projector_hidden_act)
        self.linear_2 = nn.Linear(config.projector_hidden_size, config.text_config.hidden_size, bias=bias)

    def pixel_unshuffle(self, x: torch.Tensor) -> torch.Tensor:
        """[h, w, C] -> [h / f, w / f, C * f**2], HF's channel order."""
        h, w, c, f = *x.shape, self.factor
        x = x.reshape(h, w // f, c * f).transpose(0, 1)  # [w / f, h, C f]
        return x.reshape(w // f, h // f, c * f * f).transpose(0, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """One tile's features [h, w, C] -> its tokens [(h / f) * (w / f), text hidden], row-major."""
        x = self.pixel_unshuffle(features)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        return self.linear_2(self.act(self.linear_1(x))).reshape(-1, self.linear_2.out_features)


@MULTIMODAL_REGISTRY.register_processor(
    Lfm2VlMultiModalProcessor, info=Lfm2VlProcessingInfo, dummy_inputs=Lfm2VlDummyInputsBuilder
)
class Lfm2VlForConditionalGeneration(nn.Module, SupportsMultiModal):
    multimodal_parts = {"vision": "vision_tower", "projector": "multi_modal_projector"}
    supports_tensor_parallel = False  # LFM2's convolutions are not split over ranks yet
    hf_to_tessera_prefixes = {
        "model.language_model.": "language_model.model.",
        "model.vision_tower.vision_model.": "vision_tower.",
        "model.vision_tower.": "vision_tower.",
        "model.multi_modal_projector.": "multi_modal_projector.",
        "lm_head.": "language_model.lm_head.",
    }

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> Optional[str]:
        return IMAGE_TOKEN if modality == "image" else None

    def __init__(self, config: Lfm2VlConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = Siglip2VisionModel(config.vision_config)
        self.multi_modal_projector = Lfm2VlMultiModalProjector(config)
        self.language_model = ModelRegistry.build_language_model(config)
        self.placeholder_token_id = config.image_token_id

    def get_language_model(self) -> nn.Module:
        return self.language_model

    def get_multimodal_embeddings(self, **kwargs: object) -> Optional[MultiModalEmbeddings]:
        """One [tokens, hidden] tensor per image: its tiles' tokens in order (the thumbnail last)."""
        pixel_values, shapes, num_tiles = (
            kwargs.get("pixel_values"),
            kwargs.get("spatial_shapes"),
            kwargs.get("num_tiles"),
        )
        if pixel_values is None:
            return None
        if isinstance(pixel_values, (list, tuple)):
            pixel_values, shapes = torch.cat(list(pixel_values)), torch.cat([torch.as_tensor(s) for s in shapes])
        dtype, device = module_dtype_device(self.vision_tower)
        shapes = torch.as_tensor(shapes).reshape(-1, 2)
        features = self.vision_tower(pixel_values.to(device=device, dtype=dtype), shapes)
        tiles = [
            self.multi_modal_projector(feature.reshape(int(h), int(w), -1)) for feature, (h, w) in zip(features, shapes)
        ]
        sizes = torch.as_tensor(num_tiles).reshape(-1).tolist()
        out, start = [], 0
        for size in sizes:
            out.append(torch.cat(tiles[start : start + size]))
            start += size
        return out

    def forward(
        self, input_ids: Optional[torch.Tensor], positions: torch.Tensor, inputs_embeds: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        return self.language_model(input_ids, positions, inputs_embeds)
