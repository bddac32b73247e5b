"""InternVL 3 in its Hugging Face format (InternVLForConditionalGeneration, e.g. OpenGVLab/InternVL3-1B-hf):
an InternViT tower (internvl_vision.py), pixel shuffle by `downsample_ratio`, the projector (LayerNorm,
linear, GELU, linear) and the language model from the text-model registry (qwen2 for InternVL 3).
Processing as transformers 5.23's InternVLProcessor with the GotOcr2 image processor.

Each image is tiled: the grid of cols x rows tiles (1 <= cols * rows within min_patches..max_patches)
whose aspect ratio is nearest the image's (ties go to the larger grid while the image's area exceeds half
the grid's), the image resized to it and cut into tiles of the image processor's `size`, plus a thumbnail
(the whole image at one tile) when there is more than one tile. The processor replaces each
`<IMG_CONTEXT>` of the prompt by `<img>` + image_seq_length `<IMG_CONTEXT>` per tile + `</img>`; all three
are special tokens, so the expansion tokenizes apart from the prompt text and only the `<IMG_CONTEXT>`
tokens take embeddings.

The tiling settings are read as the HF processor reads them: `crop_to_patches` from InternVLProcessor's
class defaults (on), `min_patches` / `max_patches` from the image processor, each overridden by the model's
and the request's mm_processor_kwargs (`multimodal.context.split_mm_kwargs` sends `crop_to_patches`, which the
processor class defaults at call time, to the call).

Videos: every frame is one tile (the video processor resizes it to `size`); the processor replaces each
`<video>` by "Frame1: " + the frame's `<img>...</img>`, then "\\nFrame{i}: " + `<img>...</img>` for each
further frame. "Frame1: " is tokenized with the prompt text before it (it can merge with it), so, as
SmolVLM's videos, we write it into the prompt before `<video>`, tokenize the prompt apart from the items,
and the item's placeholder is the first `<img>` .. last `</img>`, whose inner text lies between special
tokens and so tokenizes alone: the tokens are HF's. Frames are taken as given (the video loader samples
them; HF's InternVLVideoProcessor does not sample by default either), each video processed on its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import numpy as np
import torch
from torch import nn
from transformers import BatchFeature, InternVLConfig, InternVLProcessor

from tessera.layers.activations import get_activation
from tessera.layers.linear import Linear
from tessera.models.interfaces import MultiModalEmbeddings, SupportsMultiModal
from tessera.models.internvl_vision import InternVLVisionModel, check_feature_layer
from tessera.models.registry import ModelRegistry
from tessera.models.utils import module_dtype_device, stack_images
from tessera.multimodal import MULTIMODAL_REGISTRY
from tessera.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargs
from tessera.multimodal.parse import (
    ImageProcessorItems,
    ImageSize,
    MultiModalDataItems,
    VideoProcessorItems,
    image_size_of,
)
from tessera.multimodal.processing import (
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    PromptReplacement,
    PromptUpdate,
    PromptUpdateDetails,
)
from tessera.multimodal.profiling import BaseDummyInputsBuilder
from tessera.multimodal.prompt_updates import placeholder_target, placeholder_token_id

IMG_CONTEXT = "<IMG_CONTEXT>"
VIDEO_TOKEN = "<video>"
FIRST_FRAME = "Frame1: "
FRAME = "\nFrame{index}: "
DEFAULT_MAX_FRAMES = 8  # profiling videos when the video processor names no frame count
TILING_KEYS = ("crop_to_patches", "min_patches", "max_patches")


def supported_grids(min_tiles: int, max_tiles: int) -> list[tuple[int, int]]:
    """(cols, rows) grids of min_tiles..max_tiles tiles, by tile count (GotOcr2's order)."""
    grids = [
        (w, h) for w in range(1, max_tiles + 1) for h in range(1, max_tiles + 1) if min_tiles <= w * h <= max_tiles
    ]
    return sorted(grids, key=lambda g: g[0] * g[1])


def optimal_grid(width: int, height: int, tile_w: int, tile_h: int, min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """transformers' get_optimal_tiled_canvas: the (cols, rows) grid an image of this size is tiled into."""
    aspect, area = width / height, width * height
    best_diff, best = float("inf"), (1, 1)
    for grid in supported_grids(min_tiles, max_tiles):
        diff = abs(aspect - grid[0] / grid[1])
        if diff < best_diff:
            best_diff, best = diff, grid
        elif diff == best_diff and area > 0.5 * tile_h * tile_w * grid[0] * grid[1]:
            best = grid
    return best


class InternVLProcessingInfo(BaseProcessingInfo):
    def get_hf_config(self) -> InternVLConfig:
        return self.ctx.get_hf_config(InternVLConfig)

    def get_hf_processor(self, **kwargs: object) -> InternVLProcessor:
        return self.ctx.get_hf_processor(InternVLProcessor, **kwargs)

    def get_supported_mm_limits(self) -> Mapping[str, Optional[int]]:
        return {"image": None, "video": None}

    def tile_size(self) -> tuple[int, int]:
        """(width, height) of a tile: the image processor's size."""
        size = self.get_hf_processor().image_processor.size
        height, width = (size["height"], size["width"]) if isinstance(size, Mapping) else (size.height, size.width)
        return int(width), int(height)

    def tiling_settings(self, mm_kwargs: Mapping[str, object] = {}) -> dict[str, Any]:
        """The HF processor's tiling settings for a request (see the module docstring)."""
        image_processor = self.get_hf_processor().image_processor
        base = {k: getattr(image_processor, k) for k in TILING_KEYS}
        return self.ctx.get_call_settings(TILING_KEYS, base, mm_kwargs)

    def get_num_patches(self, *, image_width: int, image_height: int, mm_kwargs: Mapping[str, object] = {}) -> int:
        """Tiles of an image of this size, the thumbnail included (GotOcr2's get_number_of_image_patches)."""
        settings = self.tiling_settings(mm_kwargs)
        min_tiles, max_tiles = int(settings["min_patches"]), int(settings["max_patches"])
        if not settings["crop_to_patches"] or max_tiles <= 1:
            return 1
        cols, rows = optimal_grid(image_width, image_height, *self.tile_size(), min_tiles, max_tiles)
        return 1 if cols * rows == 1 else cols * rows + 1

    def get_image_seq_len(self) -> int:
        """`<IMG_CONTEXT>` tokens per tile: the processor's image_seq_length."""
        return int(self.get_hf_processor().image_seq_length)

    def get_num_image_tokens(self, *, image_width: int, image_height: int, mm_kwargs: Mapping[str, object] = {}) -> int:
        """`<IMG_CONTEXT>` tokens (embeddings) of an image of this size."""
        tiles = self.get_num_patches(image_width=image_width, image_height=image_height, mm_kwargs=mm_kwargs)
        return tiles * self.get_image_seq_len()

    def get_image_tokens(self, num_patches: int) -> list[int]:
        """The placeholder of an image of `num_patches` tiles: `<img>`, its context tokens, `</img>`."""
        processor = self.get_hf_processor()
        context = [processor.image_token_id] * (self.get_image_seq_len() * num_patches)
        return [processor.start_image_token_id, *context, processor.end_image_token_id]

    def get_video_tokens(self, num_frames: int) -> list[int]:
        """The placeholder of a video: its frames' `<img>...</img>`, "\\nFrame{i}: " between them."""
        tokenizer = self.get_tokenizer()
        frame = self.get_image_tokens(1)
        tokens = list(frame)
        for index in range(2, num_frames + 1):
            tokens += tokenizer.encode(FRAME.format(index=index), add_special_tokens=False) + frame
        return tokens

    def get_max_video_frames(self) -> int:
        return int(getattr(self.get_hf_processor().video_processor, "num_frames", None) or DEFAULT_MAX_FRAMES)

    def get_image_size_with_most_features(self, mm_kwargs: Mapping[str, object] = {}) -> ImageSize:
        """An image shaped as the grid with the most tiles."""
        settings = self.tiling_settings(mm_kwargs)
        tile_w, tile_h = self.tile_size()
        if not settings["crop_to_patches"]:
            return ImageSize(width=tile_w, height=tile_h)
        grids = supported_grids(int(settings["min_patches"]), int(settings["max_patches"])) or [(1, 1)]
        sizes = [ImageSize(width=tile_w * c, height=tile_h * r) for c, r in grids]
        return max(sizes, key=lambda s: self.get_num_patches(image_width=s.width, image_height=s.height))

    def get_max_image_tokens(self) -> int:
        width, height = self.get_image_size_with_most_features()
        return self.get_num_image_tokens(image_width=width, image_height=height)

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int]) -> Mapping[str, int]:
        """The longest placeholders: an image's `<img>` .. `</img>` with the most tiles; the profiling video's
        frames, with the "Frame1: " the prompt gets before it."""
        first = len(self.get_tokenizer().encode(FIRST_FRAME, add_special_tokens=False))  # written into the prompt
        return {
            "image": self.get_max_image_tokens() + 2,
            "video": len(self.get_video_tokens(self.get_max_video_frames())) + first,
        }


class InternVLDummyInputsBuilder(BaseDummyInputsBuilder[InternVLProcessingInfo]):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return IMG_CONTEXT * mm_counts.get("image", 0) + VIDEO_TOKEN * mm_counts.get("video", 0)

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int]):
        width, height = self.info.get_image_size_with_most_features()
        data: dict[str, Any] = {
            "image": self._get_dummy_images(width=width, height=height, num_images=mm_counts.get("image", 0))
        }
        if mm_counts.get("video", 0):
            tile_w, tile_h = self.info.tile_size()
            frames = np.zeros((self.info.get_max_video_frames(), tile_h, tile_w, 3), dtype=np.uint8)
            data["video"] = [frames] * mm_counts["video"]
        return data


class InternVLMultiModalProcessor(BaseMultiModalProcessor[InternVLProcessingInfo]):
    def apply(self, prompt, mm_data, hf_processor_mm_kwargs: Mapping[str, object] = {}, *, mm_uuids=None):
        """Write "Frame1: " into the prompt before each `<video>` (see the module docstring), then process."""
        mm_items = self._to_mm_items(mm_data)
        if "video" in mm_items and mm_items["video"].get_count():
            prompt = self._write_video_texts(prompt, mm_items["video"].get_count())
        return super().apply(prompt, mm_data, hf_processor_mm_kwargs, mm_uuids=mm_uuids)

    def _write_video_texts(self, prompt: Any, count: int) -> Any:
        if isinstance(prompt, str):
            parts = prompt.split(VIDEO_TOKEN)
            out = parts[0]
            for i, part in enumerate(parts[1:]):
                out += (FIRST_FRAME if i < count else "") + VIDEO_TOKEN + part
            return out
        tokenizer = self.info.get_tokenizer()
        video_token_id = placeholder_token_id(tokenizer, VIDEO_TOKEN)
        if video_token_id is None:  # `<video>` is text to this tokenizer: write into the prompt's text
            text = self._write_video_texts(self._codec.decode(list(prompt)), count)
            return tokenizer.encode(text, add_special_tokens=False)
        first = tokenizer.encode(FIRST_FRAME, add_special_tokens=False)
        out_ids: list[int] = []
        written = 0
        for token in prompt:
            if token == video_token_id and written < count:
                out_ids += first
                written += 1
            out_ids.append(token)
        return out_ids

    def _apply_hf_processor_main(
        self, prompt, mm_items: MultiModalDataItems, hf_processor_mm_kwargs, *, enable_hf_prompt_update: bool
    ):
        """Prompts with videos: the text tokenized apart from the items, which are placed by us."""
        if "video" in mm_items:
            enable_hf_prompt_update = False
        return super()._apply_hf_processor_main(
            prompt, mm_items, hf_processor_mm_kwargs, enable_hf_prompt_update=enable_hf_prompt_update
        )

    def _num_patches(self, mm_items: MultiModalDataItems, mm_kwargs: Mapping[str, object]) -> list[int]:
        if "image" not in mm_items:
            return []
        images = mm_items.get_items("image", ImageProcessorItems)
        sizes = [images.get_image_size(i) for i in range(images.get_count())]
        return [
            self.info.get_num_patches(image_width=s.width, image_height=s.height, mm_kwargs=mm_kwargs) for s in sizes
        ]

    def _call_hf_processor(
        self, prompt: str, mm_data: Mapping[str, object], mm_kwargs: Mapping[str, object]
    ) -> BatchFeature:
        """HF's outputs and each image's number of tiles (HF computes it but drops it)."""
        mm_data = dict(mm_data)
        videos = mm_data.pop("videos", None) or []
        mm_data.pop("video_metadata", None)
        if videos:
            prompt = prompt.replace(VIDEO_TOKEN, "")
        processed = self._call_hf_processor_images(prompt, mm_data, mm_kwargs)
        if videos:  # each on its own: HF would pad videos processed together to the longest one's frames
            video_processor = self.info.get_hf_processor(**mm_kwargs).video_processor
            outs = [video_processor(videos=[v], do_sample_frames=False, return_tensors="pt") for v in videos]
            processed["pixel_values_videos"] = torch.cat([out["pixel_values_videos"][0] for out in outs])
            processed["video_num_frames"] = torch.tensor([len(v) for v in videos])
        return processed

    def _call_hf_processor_images(
        self, prompt: str, mm_data: Mapping[str, object], mm_kwargs: Mapping[str, object]
    ) -> BatchFeature:
        processed = super()._call_hf_processor(prompt, mm_data, mm_kwargs)
        images = mm_data.get("images")
        if not images:
            return processed
        sizes = [image_size_of(image) for image in images]
        num_patches = [
            self.info.get_num_patches(image_width=s.width, image_height=s.height, mm_kwargs=mm_kwargs) for s in sizes
        ]
        if processed["pixel_values"].shape[0] != sum(num_patches):
            raise RuntimeError(
                f"The HF processor gave {processed['pixel_values'].shape[0]} tiles for images that should give "
                f"{num_patches}"
            )
        processed["num_patches"] = torch.tensor(num_patches)
        return processed

    def _get_mm_fields_config(
        self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        num_patches = torch.as_tensor(hf_inputs.get("num_patches", torch.empty(0, dtype=torch.long)))
        num_frames = torch.as_tensor(hf_inputs.get("video_num_frames", torch.empty(0, dtype=torch.long)))
        return dict(
            pixel_values=MultiModalFieldConfig.flat_from_sizes("image", num_patches),
            num_patches=MultiModalFieldConfig.batched("image"),
            pixel_values_videos=MultiModalFieldConfig.flat_from_sizes("video", num_frames),
            video_num_frames=MultiModalFieldConfig.batched("video"),
        )

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_mm_kwargs: MultiModalKwargs,
    ) -> Sequence[PromptUpdate]:
        context_id = self.info.get_hf_processor().image_token_id
        num_patches = self._num_patches(mm_items, hf_processor_mm_kwargs)

        def get_replacement(item_idx: int) -> PromptUpdateDetails:
            return PromptUpdateDetails.select_token_id(self.info.get_image_tokens(num_patches[item_idx]), context_id)

        def get_video_replacement(item_idx: int) -> PromptUpdateDetails:
            num_frames = mm_items.get_items("video", VideoProcessorItems).get_num_frames(item_idx)
            return PromptUpdateDetails.select_token_id(self.info.get_video_tokens(num_frames), context_id)

        video_target = placeholder_target(self.info.get_tokenizer(), VIDEO_TOKEN)
        return [
            PromptReplacement(modality="image", target=[context_id], replacement=get_replacement),
            PromptReplacement(modality="video", target=video_target, replacement=get_video_replacement),
        ]


class InternVLMultiModalProjector(nn.Module):
    def __init__(self, config: InternVLConfig) -> None:
        super().__init__()
        width = config.vision_config.hidden_size * int(1 / config.downsample_ratio) ** 2
        hidden = config.text_config.hidden_size
        self.layer_norm = nn.LayerNorm(width)
        self.linear_1 = Linear(width, hidden, bias=True)
        self.act = get_activation(config.projector_hidden_act)
        self.linear_2 = Linear(hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.layer_norm(x))))


def pixel_shuffle(features: torch.Tensor, scale_factor: float) -> torch.Tensor:
    """HF's InternVLModel.pixel_shuffle: [N, W, H, C] -> [N, W * s, H * s, C / s**2]."""
    n, width, height, channels = features.shape
    if height % scale_factor != 0 or width % scale_factor != 0:
        raise ValueError("Height and width must be divisible by scale_factor for proper downsampling.")
    features = features.view(n, width, int(height * scale_factor), int(channels / scale_factor))
    features = features.permute(0, 2, 1, 3).contiguous()
    features = features.view(
        n, int(height * scale_factor), int(width * scale_factor), int(channels / (scale_factor**2))
    )
    return features.permute(0, 2, 1, 3).contiguous()


@MULTIMODAL_REGISTRY.register_processor(
    InternVLMultiModalProcessor, info=InternVLProcessingInfo, dummy_inputs=InternVLDummyInputsBuilder
)
class InternVLForConditionalGeneration(nn.Module, SupportsMultiModal):
    multimodal_parts = {"vision": "vision_tower", "projector": "multi_modal_projector"}
    # transformers 5 saves InternVL in the top-level layout (language_model.model., vision_tower.,
    # multi_modal_projector., language_model.lm_head.), which needs no rename; its in-memory layout
    # nests the parts under "model.".
    hf_to_tessera_prefixes = {
        "model.language_model.": "language_model.model.",
        "model.vision_tower.": "vision_tower.",
        "model.multi_modal_projector.": "multi_modal_projector.",
        "lm_head.": "language_model.lm_head.",
    }

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> Optional[str]:
        return {"image": IMG_CONTEXT, "video": VIDEO_TOKEN}.get(modality)

    def __init__(self, config: InternVLConfig) -> None:
        super().__init__()
        self.config = config
        if config.vision_config.model_type != "internvl_vision":
            raise ValueError(
                f"Unsupported InternVL vision tower {config.vision_config.model_type!r}; supported: internvl_vision"
            )
        if config.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(f"Unsupported vision_feature_select_strategy {config.vision_feature_select_strategy!r}")
        self.feature_layer = check_feature_layer(config.vision_feature_layer)
        self.vision_tower = InternVLVisionModel(config.vision_config)
        self.multi_modal_projector = InternVLMultiModalProjector(config)
        self.language_model = ModelRegistry.build_language_model(config)
        self.placeholder_token_id = config.image_token_id

    def get_language_model(self) -> nn.Module:
        return self.language_model

    def _image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Tiles [N, C, H, W] -> [N, tokens per tile, text hidden] (HF's get_image_features)."""
        dtype, device = module_dtype_device(self.vision_tower)
        features = self.vision_tower(pixel_values.to(device=device, dtype=dtype), self.feature_layer)
        if self.config.vision_feature_select_strategy == "default":
            features = features[:, 1:]
        n, length, _ = features.shape
        side = int(length**0.5)
        features = pixel_shuffle(features.reshape(n, side, side, -1), self.config.downsample_ratio)
        features = features.reshape(n, -1, features.shape[-1])
        dtype, device = module_dtype_device(self.multi_modal_projector)
        return self.multi_modal_projector(features.to(device=device, dtype=dtype))

    def get_multimodal_embeddings(self, **kwargs: object) -> Optional[MultiModalEmbeddings]:
        """One [tiles * image_seq_length, hidden] tensor per image (its tiles' tokens, thumbnail last), or
        per video (its frames', in order; the engine passes one modality per call)."""
        if kwargs.get("pixel_values_videos") is not None:
            return self._embed(kwargs["pixel_values_videos"], kwargs.get("video_num_frames"), "pixel_values_videos")
        if kwargs.get("pixel_values") is None:
            return None
        return self._embed(kwargs["pixel_values"], kwargs.get("num_patches"), "pixel_values")

    def _embed(self, pixel_values: Any, num_patches: Any, name: str) -> list[torch.Tensor]:
        pixel_values = stack_images(pixel_values, name, "tiles")
        if num_patches is None:
            sizes = [1] * pixel_values.shape[0]
        else:
            sizes = [int(n) for n in torch.as_tensor(num_patches).reshape(-1).tolist()]
        if sum(sizes) != pixel_values.shape[0]:
            raise ValueError(f"Tile counts {sizes} do not add up to the {pixel_values.shape[0]} tiles of {name}")
        features = self._image_features(pixel_values)
        return [item.flatten(0, 1) for item in features.split(sizes)]

    def forward(
        self, input_ids: Optional[torch.Tensor], positions: torch.Tensor, inputs_embeds: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Hidden states [T, hidden]; items are merged into inputs_embeds by get_input_embeddings."""
        return self.language_model(input_ids, positions, inputs_embeds)
