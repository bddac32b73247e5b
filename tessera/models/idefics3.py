"""Idefics3: a SigLIP-like vision tower over image tiles (idefics3_vision.py), a pixel-shuffle connector
with a linear projection, and the language model that text_config.model_type names in the text-model
registry (Llama). Processing as in vLLM's idefics3.py.

The HF processor resizes each image so that its longest edge is `size["longest_edge"]`, rounds both
sides up to multiples of `max_image_size["longest_edge"]` (M) and cuts it into rows x cols tiles of
M x M, followed by the whole image resized to one M x M tile (no split when it fits one tile). Each
`<image>` of the prompt becomes, per tile, `<fake_token_around_image><row_r_col_c>` + image_seq_len
`<image>` tokens, a newline after each row, then `\\n<fake_token_around_image><global-img>` +
image_seq_len `<image>` + `<fake_token_around_image>`. Only the `<image>` tokens take embeddings: a
tile's image_seq_len = (tile patches) / scale_factor**2 pixel-shuffled features, tiles in prompt order.
pixel_values come as [1, tiles of all images, 3, M, M] (with pixel_attention_mask [1, tiles, M, M]);
item i is its num_patches = rows * cols + 1 tiles.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
from torch import nn
from transformers import BatchFeature, Idefics3Config, Idefics3Processor

from tessera.layers.linear import Linear
from tessera.models.idefics3_vision import Idefics3VisionTransformer
from tessera.models.interfaces import MultiModalEmbeddings, SupportsMultiModal
from tessera.models.registry import ModelRegistry
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

MAX_IMAGE_SIZE = 4096  # transformers' absolute bound on a resized side (image_processing_idefics3.py)
FAKE_TOKEN, GLOBAL_TOKEN, IMAGE_TOKEN = "<fake_token_around_image>", "<global-img>", "<image>"


def _rescale_to_max_len(height: int, width: int, max_len: int) -> tuple[int, int]:
    """transformers' _resize_output_size_rescale_to_max_len: the longest side to max_len, the other
    side kept in proportion and made even."""
    aspect_ratio = width / height
    if width >= height:
        width = max_len
        height = int(width / aspect_ratio)
        height += height % 2
    else:
        height = max_len
        width = int(height * aspect_ratio)
        width += width % 2
    return max(height, 1), max(width, 1)


def _scale_below_upper_bound(height: int, width: int, max_len: int) -> tuple[int, int]:
    """transformers' _resize_output_size_scale_below_upper_bound."""
    aspect_ratio = width / height
    if width >= height and width > max_len:
        width = max_len
        height = int(width / aspect_ratio)
    elif height > width and height > max_len:
        height = max_len
        width = int(height * aspect_ratio)
    return max(height, 1), max(width, 1)


def _round_up_to_tiles(height: int, width: int, tile: int) -> tuple[int, int]:
    """transformers' Idefics3ImageProcessor.resize_for_vision_encoder: sides rounded up to multiples
    of the tile, the short one through the aspect ratio as it computes it."""
    aspect_ratio = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect_ratio) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect_ratio) / tile) * tile
    return height, width


class Idefics3ProcessingInfo(BaseProcessingInfo):
    def get_hf_config(self) -> Idefics3Config:
        return self.ctx.get_hf_config(Idefics3Config)

    def get_hf_processor(self, **kwargs: object) -> Idefics3Processor:
        return self.ctx.get_hf_processor(Idefics3Processor, **kwargs)

    def get_supported_mm_limits(self) -> Mapping[str, Optional[int]]:
        return {"image": None}

    def _image_settings(self, mm_kwargs: Mapping[str, object] = {}) -> tuple[bool, bool, int, int]:
        """(do_resize, do_image_splitting, longest edge after resizing, tile side) of the image
        processor, with the request's and the model's mm_processor_kwargs applied."""
        image_processor = self.get_hf_processor(**mm_kwargs).image_processor
        kwargs = self.ctx.get_merged_mm_kwargs(mm_kwargs)

        def edge(value: Any) -> int:
            return int(value["longest_edge"] if isinstance(value, Mapping) else value.longest_edge)

        return (
            bool(kwargs.get("do_resize", image_processor.do_resize)),
            bool(kwargs.get("do_image_splitting", image_processor.do_image_splitting)),
            edge(kwargs.get("size", image_processor.size)),
            edge(kwargs.get("max_image_size", image_processor.max_image_size)),
        )

    def get_image_grid(
        self, *, image_width: int, image_height: int, mm_kwargs: Mapping[str, object] = {}
    ) -> tuple[int, int]:
        """(rows, cols) of tiles the HF processor cuts the image into; (0, 0): one tile, not split."""
        do_resize, do_splitting, longest_edge, tile = self._image_settings(mm_kwargs)
        if not do_splitting:
            return 0, 0
        height, width = image_height, image_width
        if do_resize:
            height, width = _rescale_to_max_len(height, width, longest_edge)
            height, width = _scale_below_upper_bound(height, width, MAX_IMAGE_SIZE)
        height, width = _round_up_to_tiles(height, width, tile)
        if height > tile or width > tile:
            return math.ceil(height / tile), math.ceil(width / tile)
        return 0, 0

    def get_num_patches(self, *, image_width: int, image_height: int, mm_kwargs: Mapping[str, object] = {}) -> int:
        """Tiles of the image: rows * cols + the global one."""
        rows, cols = self.get_image_grid(image_width=image_width, image_height=image_height, mm_kwargs=mm_kwargs)
        return rows * cols + 1

    def get_image_seq_len(self, mm_kwargs: Mapping[str, object] = {}) -> int:
        return self.get_hf_processor(**mm_kwargs).image_seq_len

    def get_num_image_tokens(self, *, image_width: int, image_height: int) -> int:
        """`<image>` tokens (embeddings) of an image of this size."""
        return self.get_num_patches(image_width=image_width, image_height=image_height) * self.get_image_seq_len()

    def get_image_repl(self, *, image_width: int, image_height: int, mm_kwargs: Mapping[str, object] = {}) -> str:
        """The text an image's `<image>` becomes (the HF processor's)."""
        rows, cols = self.get_image_grid(image_width=image_width, image_height=image_height, mm_kwargs=mm_kwargs)
        image = IMAGE_TOKEN * self.get_image_seq_len(mm_kwargs)
        text = ""
        for row in range(rows):
            text += "".join(f"{FAKE_TOKEN}<row_{row + 1}_col_{col + 1}>{image}" for col in range(cols)) + "\n"
        if rows:
            text += "\n"
        return text + f"{FAKE_TOKEN}{GLOBAL_TOKEN}{image}{FAKE_TOKEN}"

    def get_image_size_with_most_features(self) -> ImageSize:
        """A square of the resize's longest edge: the most tiles."""
        _, _, longest_edge, _ = self._image_settings()
        return ImageSize(width=longest_edge, height=longest_edge)

    def get_max_image_tokens(self) -> int:
        width, height = self.get_image_size_with_most_features()
        return self.get_num_image_tokens(image_width=width, image_height=height)

    def get_max_image_placeholder_tokens(self) -> int:
        """Tokens of the largest image's placeholder (its markers and newlines included)."""
        width, height = self.get_image_size_with_most_features()
        repl = self.get_image_repl(image_width=width, image_height=height)
        return len(self.get_tokenizer().encode(repl, add_special_tokens=False))

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int]) -> Mapping[str, int]:
        return {"image": self.get_max_image_placeholder_tokens()}


class Idefics3DummyInputsBuilder(BaseDummyInputsBuilder[Idefics3ProcessingInfo]):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return IMAGE_TOKEN * mm_counts.get("image", 0)

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int]):
        width, height = self.info.get_image_size_with_most_features()
        return {"image": self._get_dummy_images(width=width, height=height, num_images=mm_counts.get("image", 0))}


class Idefics3MultiModalProcessor(BaseMultiModalProcessor[Idefics3ProcessingInfo]):
    def _call_hf_processor(
        self, prompt: str, mm_data: Mapping[str, object], mm_kwargs: Mapping[str, object]
    ) -> BatchFeature:
        """HF's outputs with the batch dimension dropped (tiles of all images along dim 0) and each
        image's number of tiles (num_patches), so that items split apart."""
        processed = super()._call_hf_processor(prompt, mm_data, mm_kwargs)
        images = mm_data.get("images")
        if not images:
            return processed
        return self._with_num_patches(processed, list(images), mm_kwargs, "pixel_values", "pixel_attention_mask")

    def _with_num_patches(
        self, processed: BatchFeature, images: list, mm_kwargs: Mapping[str, object], pixels: str, mask: str
    ) -> BatchFeature:
        sizes = [image_size_of(image) for image in images]
        num_patches = [
            self.info.get_num_patches(image_width=s.width, image_height=s.height, mm_kwargs=mm_kwargs) for s in sizes
        ]
        pixel_values = processed[pixels]
        if pixel_values.shape[0] != 1 or pixel_values.shape[1] != sum(num_patches):
            raise RuntimeError(
                f"The HF processor cut {pixel_values.shape[1]} tiles for images that should give {num_patches}"
            )
        processed[pixels] = pixel_values[0]
        if mask in processed:  # absent with do_pad=False: every tile is whole
            processed[mask] = processed[mask][0]
        processed["num_patches"] = torch.tensor(num_patches)
        return processed

    def _get_mm_fields_config(
        self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        num_patches = hf_inputs.get("num_patches", torch.empty(0, dtype=torch.long))
        return dict(
            pixel_values=MultiModalFieldConfig.flat_from_sizes("image", num_patches),
            pixel_attention_mask=MultiModalFieldConfig.flat_from_sizes("image", num_patches),
            num_patches=MultiModalFieldConfig.batched("image"),
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


class Idefics3SimpleMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        input_size = config.vision_config.hidden_size * config.scale_factor**2
        self.proj = Linear(input_size, config.text_config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Idefics3Connector(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.scale_factor = config.scale_factor
        self.modality_projection = Idefics3SimpleMLP(config)

    def pixel_shuffle(self, x: torch.Tensor) -> torch.Tensor:
        """[N, side * side, D] -> [N, side**2 / s**2, D * s**2]: each s x s block of patches into one
        feature, in HF's element order."""
        n, seq, dim = x.shape
        s = self.scale_factor
        side = int(seq**0.5)
        x = x.view(n, side, side // s, dim * s).permute(0, 2, 1, 3)
        x = x.reshape(n, side // s, side // s, dim * s * s).permute(0, 2, 1, 3)
        return x.reshape(n, seq // s**2, dim * s * s)

    def forward(self, image_hidden_states: torch.Tensor) -> torch.Tensor:
        return self.modality_projection(self.pixel_shuffle(image_hidden_states))


def _per_item(data: Any, sizes: list[int]) -> list[torch.Tensor]:
    """Item i's rows of flat `data` (one tensor over all items, or a list with one tensor per item)."""
    if isinstance(data, torch.Tensor):
        return list(data.split(sizes))
    return [torch.as_tensor(d) for d in data]


@MULTIMODAL_REGISTRY.register_processor(
    Idefics3MultiModalProcessor, info=Idefics3ProcessingInfo, dummy_inputs=Idefics3DummyInputsBuilder
)
class Idefics3ForConditionalGeneration(nn.Module, SupportsMultiModal):
    multimodal_parts = {"vision": "vision_model", "projector": "connector"}
    hf_to_tessera_prefixes = {
        "model.text_model.": "language_model.model.",
        "model.vision_model.": "vision_model.",
        "model.connector.": "connector.",
        "lm_head.": "language_model.lm_head.",
    }

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> Optional[str]:
        return IMAGE_TOKEN if modality == "image" else None

    def __init__(self, config: Idefics3Config) -> None:
        super().__init__()
        self.config = config
        self.vision_model = Idefics3VisionTransformer(config.vision_config)
        self.connector = Idefics3Connector(config)
        self.language_model = ModelRegistry.build_language_model(config)
        self.placeholder_token_id = config.image_token_id
        self.patch_size = config.vision_config.patch_size

    def get_language_model(self) -> nn.Module:
        return self.language_model

    def get_multimodal_embeddings(self, **kwargs: object) -> Optional[MultiModalEmbeddings]:
        """One [tiles * image_seq_len, hidden] tensor per image, its tiles in prompt order."""
        if kwargs.get("pixel_values") is None:
            return None
        return self._embed_tiles(kwargs["pixel_values"], kwargs.get("pixel_attention_mask"), kwargs["num_patches"])

    def _embed_tiles(self, pixel_values: Any, pixel_mask: Any, num_tiles: Any) -> list[torch.Tensor]:
        """Items' tiles [sum tiles, 3, H, W] (with their pixel masks [sum tiles, H, W]) -> per item features."""
        sizes = [int(n) for n in torch.as_tensor(num_tiles).reshape(-1)]
        masks = _per_item(pixel_mask, sizes) if pixel_mask is not None else [None] * len(sizes)
        return [self._embed_item(tiles, mask) for tiles, mask in zip(_per_item(pixel_values, sizes), masks)]

    def _embed_item(self, tiles: torch.Tensor, pixel_mask: Optional[torch.Tensor]) -> torch.Tensor:
        dtype, device = module_dtype_device(self.vision_model)
        tiles = tiles.to(device=device, dtype=dtype)
        patch_mask = None
        if pixel_mask is not None:  # a patch is real when any of its pixels is (HF's rule)
            p = self.patch_size
            subgrid = pixel_mask.to(device).unfold(1, p, p).unfold(2, p, p)  # [N, H / p, W / p, p, p]
            patch_mask = subgrid.sum(dim=(-1, -2)) > 0
        states = self.vision_model(tiles, patch_mask)
        dtype, device = module_dtype_device(self.connector)
        features = self.connector(states.to(device=device, dtype=dtype))
        return features.reshape(-1, features.shape[-1])

    def forward(
        self, input_ids: Optional[torch.Tensor], positions: torch.Tensor, inputs_embeds: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Hidden states [T, hidden]; items are merged into inputs_embeds by get_input_embeddings."""
        return self.language_model(input_ids, positions, inputs_embeds)
