"""Mistral 3 VLM (Mistral3ForConditionalGeneration: Mistral Small 3.1 and kin): the Pixtral vision tower
(pixtral_vision.py), the Mistral 3 projector (RMSNorm, a patch merger that fuses spatial_merge_size**2
neighbouring patches by a learned matrix, linear_1, GELU, linear_2) and the language model that
text_config.model_type names in the text-model registry (mistral, llama). Processing as in vLLM's
multimodal guide, tokens as transformers 5.23's PixtralProcessor.

The image processor resizes an image, keeping its aspect ratio, so that its longest edge is at most
size["longest_edge"] (never enlarging it), then rounds each side up to a multiple of patch_size *
spatial_merge_size (one language-model token). HF's processor replaces each `[IMG]` of the prompt by
`rows` lines of `columns` `[IMG]` tokens, each line ended by `[IMG_BREAK]` except the last, ended by
`[IMG_END]`; only the `[IMG]` tokens take embeddings (the merged patches, row-major). All three are
special tokens, so the prompt text around them tokenizes alone and HF's prompt update is a plain
replacement of the `[IMG]` it was given.

HF pads the pixel_values of the images of one call to their largest height and width; each item here
keeps only its own image (its image_sizes), so that an item is the same whatever it was processed with
(the processor-output cache). The tower reads each image at its own size, as HF's does once it crops
the patch grid.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Optional

import torch
from torch import nn
from transformers import BatchFeature, Mistral3Config, PixtralProcessor

from tessera.layers.activations import get_activation
from tessera.layers.layernorm import RMSNorm
from tessera.layers.linear import Linear
from tessera.models.interfaces import MultiModalEmbeddings, SupportsMultiModal
from tessera.models.pixtral_vision import PixtralVisionModel
from tessera.models.registry import ModelRegistry
from tessera.models.utils import module_dtype_device
from tessera.multimodal import MULTIMODAL_REGISTRY
from tessera.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargs
from tessera.multimodal.parse import ImageSize, MultiModalDataItems
from tessera.multimodal.processing import (
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    PromptReplacement,
    PromptUpdate,
    PromptUpdateDetails,
)
from tessera.multimodal.profiling import BaseDummyInputsBuilder

IMAGE_TOKEN = "[IMG]"


def resized_image_size(width: int, height: int, *, longest_edge: int, multiple: int) -> ImageSize:
    """The size transformers' PixtralImageProcessor resizes an image of this size to
    (get_resize_output_image_size with the processor's patch_size * spatial_merge_size)."""
    ratio = max(height / longest_edge, width / longest_edge)
    if ratio > 1:
        height, width = int(height // ratio), int(width // ratio)  # floor, as math.floor(height / ratio)
    return ImageSize(width=((width - 1) // multiple + 1) * multiple, height=((height - 1) // multiple + 1) * multiple)


def image_tokens(rows: int, columns: int, ids: tuple[int, int, int]) -> list[int]:
    """HF's replacement of one `[IMG]`: `rows` lines of `columns` [IMG], [IMG_BREAK] after each line but
    the last, [IMG_END] after it. ids: ([IMG], [IMG_BREAK], [IMG_END])."""
    image, brk, end = ids
    tokens = ([image] * columns + [brk]) * rows
    tokens[-1] = end
    return tokens


class Mistral3ProcessingInfo(BaseProcessingInfo):
    def get_hf_config(self) -> Mistral3Config:
        return self.ctx.get_hf_config(Mistral3Config)

    def get_hf_processor(self, **kwargs: object) -> PixtralProcessor:
        return self.ctx.get_hf_processor(PixtralProcessor, **kwargs)

    def get_supported_mm_limits(self) -> Mapping[str, Optional[int]]:
        return {"image": None}

    def get_token_ids(self) -> tuple[int, int, int]:
        """([IMG], [IMG_BREAK], [IMG_END])."""
        processor = self.get_hf_processor()
        return processor.image_token_id, processor.image_break_token_id, processor.image_end_token_id

    def get_token_pixels(self, mm_kwargs: Mapping[str, object] = {}) -> int:
        """Pixels per side of one language-model token: patch_size * spatial_merge_size."""
        processor = self.get_hf_processor(**mm_kwargs)
        return int(processor.patch_size) * int(processor.spatial_merge_size)

    def get_longest_edge(self, mm_kwargs: Mapping[str, object] = {}) -> int:
        size = self.get_hf_processor(**mm_kwargs).image_processor.size
        longest = size.get("longest_edge") if isinstance(size, Mapping) else getattr(size, "longest_edge", None)
        if not longest:
            raise ValueError(f"The Pixtral image processor's size must give longest_edge, got {size}")
        return int(longest)

    def get_image_grid(self, *, image_width: int, image_height: int, mm_kwargs: Mapping[str, object] = {}):
        """(rows, columns) of language-model tokens of an image of this size."""
        step = self.get_token_pixels(mm_kwargs)
        size = resized_image_size(
            image_width, image_height, longest_edge=self.get_longest_edge(mm_kwargs), multiple=step
        )
        return size.height // step, size.width // step

    def get_num_image_tokens(self, *, image_width: int, image_height: int, mm_kwargs: Mapping[str, object] = {}) -> int:
        """[IMG] tokens (embeddings) of an image of this size."""
        rows, columns = self.get_image_grid(image_width=image_width, image_height=image_height, mm_kwargs=mm_kwargs)
        return rows * columns

    def get_image_size_with_most_features(self) -> ImageSize:
        longest = self.get_longest_edge()
        return ImageSize(width=longest, height=longest)

    def get_max_image_tokens(self) -> int:
        width, height = self.get_image_size_with_most_features()
        return self.get_num_image_tokens(image_width=width, image_height=height)

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int]) -> Mapping[str, int]:
        """The longest placeholder: a square image's rows of [IMG] with their breaks and end."""
        width, height = self.get_image_size_with_most_features()
        rows, columns = self.get_image_grid(image_width=width, image_height=height)
        return {"image": rows * (columns + 1)}


class Mistral3DummyInputsBuilder(BaseDummyInputsBuilder[Mistral3ProcessingInfo]):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return IMAGE_TOKEN * mm_counts.get("image", 0)

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int]):
        width, height = self.info.get_image_size_with_most_features()
        return {"image": self._get_dummy_images(width=width, height=height, num_images=mm_counts.get("image", 0))}


class Mistral3MultiModalProcessor(BaseMultiModalProcessor[Mistral3ProcessingInfo]):
    def _call_hf_processor(
        self, prompt: str, mm_data: Mapping[str, object], mm_kwargs: Mapping[str, object]
    ) -> BatchFeature:
        """HF's outputs, each image's pixel_values cut to its own size (HF pads them to the largest)."""
        processed = super()._call_hf_processor(prompt, mm_data, mm_kwargs)
        if "pixel_values" in processed:
            sizes = torch.as_tensor(processed["image_sizes"]).reshape(-1, 2).tolist()
            processed["pixel_values"] = [p[:, :h, :w] for p, (h, w) in zip(processed["pixel_values"], sizes)]
        return processed

    def _get_mm_fields_config(
        self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        return dict(
            pixel_values=MultiModalFieldConfig.batched("image"), image_sizes=MultiModalFieldConfig.batched("image")
        )

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_mm_kwargs: MultiModalKwargs,
    ) -> Sequence[PromptUpdate]:
        """Each [IMG] becomes its image's token grid, read from the size HF resized it to."""
        ids = self.info.get_token_ids()
        step = self.info.get_token_pixels(hf_processor_mm_kwargs)
        items = out_mm_kwargs.get_items("image") if "image" in out_mm_kwargs.modalities else []

        def get_replacement(item_idx: int) -> PromptUpdateDetails:
            height, width = torch.as_tensor(items[item_idx]["image_sizes"].data).tolist()
            return PromptUpdateDetails.select_token_id(image_tokens(height // step, width // step, ids), ids[0])

        return [PromptReplacement(modality="image", target=[ids[0]], replacement=get_replacement)]


class Mistral3PatchMerger(nn.Module):
    """[N, hidden] patches of images of `grids` (patch rows, patch columns) -> [N / merge**2, hidden]: each
    merge x merge block of an image's patches, concatenated as torch's unfold orders them (channel-major,
    then the block's patches row-major), through merging_layer; the blocks row-major."""

    def __init__(self, config: Mistral3Config) -> None:
        super().__init__()
        hidden = config.vision_config.hidden_size
        self.spatial_merge_size = config.spatial_merge_size
        self.merging_layer = Linear(hidden * self.spatial_merge_size**2, hidden, bias=False)

    def forward(self, features: torch.Tensor, grids: Sequence[tuple[int, int]]) -> torch.Tensor:
        m, d = self.spatial_merge_size, features.shape[-1]
        merged = []
        for tokens, (h, w) in zip(features.split([h * w for h, w in grids]), grids):
            grid = tokens.view(h // m, m, w // m, m, d)  # (block row, row in block, block column, column in block)
            merged.append(grid.permute(0, 2, 4, 1, 3).reshape((h // m) * (w // m), d * m * m))
        return self.merging_layer(torch.cat(merged))


class Mistral3MultiModalProjector(nn.Module):
    def __init__(self, config: Mistral3Config) -> None:
        super().__init__()
        vision, text = config.vision_config, config.text_config
        self.norm = RMSNorm(vision.hidden_size, eps=text.rms_norm_eps)
        self.patch_merger = Mistral3PatchMerger(config)
        self.linear_1 = Linear(vision.hidden_size, text.hidden_size, bias=config.multimodal_projector_bias)
        self.act = get_activation(config.projector_hidden_act)
        self.linear_2 = Linear(text.hidden_size, text.hidden_size, bias=config.multimodal_projector_bias)

    def forward(self, features: torch.Tensor, grids: Sequence[tuple[int, int]]) -> torch.Tensor:
        merged = self.patch_merger(self.norm(features), grids)
        return self.linear_2(self.act(self.linear_1(merged)))


@MULTIMODAL_REGISTRY.register_processor(
    Mistral3MultiModalProcessor, info=Mistral3ProcessingInfo, dummy_inputs=Mistral3DummyInputsBuilder
)
class Mistral3ForConditionalGeneration(nn.Module, SupportsMultiModal):
    multimodal_parts = {"vision": "vision_tower", "projector": "multi_modal_projector"}
    # transformers 5 saves the top-level layout (our names); >= 4.52 in memory, and some checkpoints,
    # nest the parts under "model.".
    hf_to_tessera_prefixes = {
        "model.language_model.": "language_model.model.",
        "model.vision_tower.": "vision_tower.",
        "model.multi_modal_projector.": "multi_modal_projector.",
        "lm_head.": "language_model.lm_head.",
    }

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> Optional[str]:
        return IMAGE_TOKEN if modality == "image" else None

    def __init__(self, config: Mistral3Config) -> None:
        super().__init__()
        self.config = config
        if config.vision_config.model_type != "pixtral":
            raise ValueError(
                f"Unsupported Mistral 3 vision tower {config.vision_config.model_type!r}; supported: pixtral"
            )
        if not isinstance(config.vision_feature_layer, int):
            # HF's projector norms and merges vision-width features: several layers' do not fit it either
            raise ValueError(f"vision_feature_layer must be one layer index, got {config.vision_feature_layer!r}")
        self.vision_tower = PixtralVisionModel(config.vision_config)
        self.multi_modal_projector = Mistral3MultiModalProjector(config)
        self.language_model = ModelRegistry.build_language_model(config)
        self.placeholder_token_id = config.image_token_index

    def get_language_model(self) -> nn.Module:
        return self.language_model

    def _image_features(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        """[C, H, W] images (H, W multiples of patch * merge) -> [(H / step) * (W / step), text hidden] each."""
        dtype, device = module_dtype_device(self.vision_tower)
        patch = self.vision_tower.patch_size
        grids = [(image.shape[-2] // patch, image.shape[-1] // patch) for image in images]
        features = self.vision_tower(
            [image.to(device=device, dtype=dtype) for image in images], self.config.vision_feature_layer
        )
        dtype, device = module_dtype_device(self.multi_modal_projector)
        out = self.multi_modal_projector(features.to(device=device, dtype=dtype), grids)
        m = self.config.spatial_merge_size
        return list(out.split([(h // m) * (w // m) for h, w in grids]))

    def get_multimodal_embeddings(self, **kwargs: object) -> Optional[MultiModalEmbeddings]:
        """One [rows * columns, hidden] tensor per image: its [IMG] tokens' embeddings, row-major."""
        pixel_values = kwargs.get("pixel_values")
        if pixel_values is None:
            return None
        image_sizes = kwargs.get("image_sizes")
        if image_sizes is None:
            raise ValueError("Mistral 3 needs image_sizes (height, width) with its pixel_values")
        sizes = torch.as_tensor(image_sizes).reshape(-1, 2).tolist()
        if isinstance(pixel_values, torch.Tensor):
            pixel_values = list(pixel_values.reshape(-1, *pixel_values.shape[-3:]))
        if len(pixel_values) != len(sizes):
            raise ValueError(f"{len(pixel_values)} images for {len(sizes)} image_sizes")
        images = [torch.as_tensor(p)[..., :h, :w] for p, (h, w) in zip(pixel_values, sizes)]
        return self._image_features(images)

    def forward(
        self, input_ids: Optional[torch.Tensor], positions: torch.Tensor, inputs_embeds: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Hidden states [T, hidden]; items are merged into inputs_embeds by get_input_embeddings."""
        return self.language_model(input_ids, positions, inputs_embeds)
