"""Gemma 3 VLM (Gemma3ForConditionalGeneration): a SigLIP tower (siglip.py, no pooling head), the
Gemma 3 projector (average-pool of the patch grid to mm_tokens_per_image, Gemma3RMSNorm, a matrix
product) and the Gemma 3 text model from the text-model registry (gemma3_text). Processing as in
vLLM's gemma3_mm.py, tokens as transformers 5.23's Gemma3Processor.

The HF processor replaces each `<start_of_image>` (boi) of the prompt by "\\n\\n" + boi + image_seq_length
`<image_soft_token>` + `<end_of_image>` (eoi) + "\\n\\n" and tokenizes the whole text. With pan-and-scan
(`do_pan_and_scan`, a processor kwarg) an image cut into n crops becomes "Here is the original image "
+ that sequence + " and here are some crops to help you see better " + n sequences joined by spaces;
pixel_values hold each image then its crops. The newlines and words around the special tokens are
tokenized with the prompt text around them (they can merge with it), so, as SmolVLM's videos, we write
the text before the first boi and the "\\n\\n" after the last eoi into the prompt around its
`<start_of_image>`, tokenize the prompt apart from the images, and the item's placeholder is boi .. last
eoi, whose inner text lies between special tokens and so tokenizes alone: the tokens are HF's. Only
the soft tokens take embeddings; each run of them (the image, each crop) attends to itself both ways
(`is_mm_prefix_lm`), as HF's token_type_ids mask does.

The pan-and-scan settings (`do_pan_and_scan`, `pan_and_scan_min_crop_size`, `..._max_num_crops`,
`..._min_ratio_to_activate`) are read as the HF processor reads them: its class defaults
(Gemma3Processor.images_kwargs; off, 256, 4, 1.2), overridden by the model's and the request's
mm_processor_kwargs; the image processor's saved values do not count (the processor's defaults win).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
from torch import nn
from transformers import BatchFeature, Gemma3Config, Gemma3Processor

from tessera.models.gemma3 import Gemma3RMSNorm
from tessera.models.interfaces import MultiModalEmbeddings, SupportsMultiModal
from tessera.models.registry import ModelRegistry
from tessera.models.siglip import SiglipVisionModel
from tessera.models.utils import module_dtype_device, stack_images
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

BOI_TOKEN = "<start_of_image>"
NEWLINES = "\n\n"
PAS_INTRO = "Here is the original image "
PAS_MIDDLE = " and here are some crops to help you see better "
PAS_KEYS = (
    "do_pan_and_scan",
    "pan_and_scan_min_crop_size",
    "pan_and_scan_max_num_crops",
    "pan_and_scan_min_ratio_to_activate",
)
PAS_DEFAULTS = {
    "do_pan_and_scan": False,
    "pan_and_scan_min_crop_size": 256,
    "pan_and_scan_max_num_crops": 4,
    "pan_and_scan_min_ratio_to_activate": 1.2,
}


def num_pan_and_scan_crops(
    width: int, height: int, *, min_crop_size: int, max_num_crops: int, min_ratio_to_activate: float
) -> int:
    """Crops transformers' Gemma3ImageProcessor.pan_and_scan_batched cuts from an image of this size."""
    if width >= height:
        if width / height < min_ratio_to_activate:
            return 0
        num_w = min(int(math.floor(width / min_crop_size)), int(math.floor(width / height + 0.5)))
        num_w, num_h = min(max_num_crops, max(2, num_w)), 1
    else:
        if height / width < min_ratio_to_activate:
            return 0
        num_h = min(int(math.floor(height / min_crop_size)), int(math.floor(height / width + 0.5)))
        num_w, num_h = 1, min(max_num_crops, max(2, num_h))
    if min(math.ceil(width / num_w), math.ceil(height / num_h)) < min_crop_size:
        return 0
    return num_w * num_h


class Gemma3ProcessingInfo(BaseProcessingInfo):
    def get_hf_config(self) -> Gemma3Config:
        return self.ctx.get_hf_config(Gemma3Config)

    def get_hf_processor(self, **kwargs: object) -> Gemma3Processor:
        return self.ctx.get_hf_processor(Gemma3Processor, **kwargs)

    def get_supported_mm_limits(self) -> Mapping[str, Optional[int]]:
        return {"image": None}

    def pan_and_scan_settings(self, mm_kwargs: Mapping[str, object] = {}) -> dict[str, Any]:
        """The HF processor's pan-and-scan settings for a request (see the module docstring)."""
        return self.ctx.get_call_settings(PAS_KEYS, PAS_DEFAULTS, mm_kwargs)

    def get_num_crops(self, *, image_width: int, image_height: int, mm_kwargs: Mapping[str, object] = {}) -> int:
        settings = self.pan_and_scan_settings(mm_kwargs)
        if not settings["do_pan_and_scan"]:
            return 0
        return num_pan_and_scan_crops(
            image_width,
            image_height,
            min_crop_size=int(settings["pan_and_scan_min_crop_size"]),
            max_num_crops=int(settings["pan_and_scan_max_num_crops"]),
            min_ratio_to_activate=float(settings["pan_and_scan_min_ratio_to_activate"]),
        )

    def get_image_seq_len(self) -> int:
        return int(self.get_hf_config().mm_tokens_per_image)

    def get_num_image_tokens(self, *, image_width: int, image_height: int, mm_kwargs: Mapping[str, object] = {}) -> int:
        """Soft tokens (embeddings) of an image of this size: the image's and its crops'."""
        crops = self.get_num_crops(image_width=image_width, image_height=image_height, mm_kwargs=mm_kwargs)
        return (crops + 1) * self.get_image_seq_len()

    def get_image_texts(self, num_crops: int) -> tuple[str, list[int], str]:
        """(the text before the placeholder, the placeholder's tokens: boi .. last eoi, the text after)."""
        config = self.get_hf_config()
        tokenizer = self.get_tokenizer()
        image = [config.boi_token_index, *[config.image_token_index] * self.get_image_seq_len(), config.eoi_token_index]
        if not num_crops:
            return NEWLINES, image, NEWLINES
        middle = tokenizer.encode(NEWLINES + PAS_MIDDLE + NEWLINES, add_special_tokens=False)
        between = tokenizer.encode(NEWLINES + " " + NEWLINES, add_special_tokens=False)
        tokens = image + middle + image
        for _ in range(num_crops - 1):
            tokens += between + image
        return PAS_INTRO + NEWLINES, tokens, NEWLINES

    def get_image_size_with_most_features(self, mm_kwargs: Mapping[str, object] = {}) -> ImageSize:
        """With pan-and-scan, a wide image that gets the most crops; else the image processor's size."""
        settings = self.pan_and_scan_settings(mm_kwargs)
        if settings["do_pan_and_scan"]:
            side = max(int(settings["pan_and_scan_min_crop_size"]), 1)
            return ImageSize(width=side * max(int(settings["pan_and_scan_max_num_crops"]), 2), height=side)
        size = self.get_hf_processor().image_processor.size
        height, width = (size["height"], size["width"]) if isinstance(size, Mapping) else (size.height, size.width)
        return ImageSize(width=int(width), height=int(height))

    def get_max_image_tokens(self) -> int:
        width, height = self.get_image_size_with_most_features()
        return self.get_num_image_tokens(image_width=width, image_height=height)

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int]) -> Mapping[str, int]:
        """The longest placeholder, with the text written around it (which the prompt gets too)."""
        width, height = self.get_image_size_with_most_features()
        before, tokens, after = self.get_image_texts(self.get_num_crops(image_width=width, image_height=height))
        text = len(self.get_tokenizer().encode(before + after, add_special_tokens=False))
        return {"image": len(tokens) + text}


class Gemma3DummyInputsBuilder(BaseDummyInputsBuilder[Gemma3ProcessingInfo]):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return BOI_TOKEN * mm_counts.get("image", 0)

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int]):
        width, height = self.info.get_image_size_with_most_features()
        return {"image": self._get_dummy_images(width=width, height=height, num_images=mm_counts.get("image", 0))}


class Gemma3MultiModalProcessor(BaseMultiModalProcessor[Gemma3ProcessingInfo]):
    def apply(self, prompt, mm_data, hf_processor_mm_kwargs: Mapping[str, object] = {}, *, mm_uuids=None):
        """Write the text around each image (see the module docstring) into the prompt, then process."""
        mm_items = self._to_mm_items(mm_data)
        if "image" in mm_items and mm_items["image"].get_count():
            prompt = self._write_image_texts(prompt, mm_items, hf_processor_mm_kwargs)
        return super().apply(prompt, mm_data, hf_processor_mm_kwargs, mm_uuids=mm_uuids)

    def _num_crops(self, mm_items: MultiModalDataItems, mm_kwargs: Mapping[str, object]) -> list[int]:
        if "image" not in mm_items:
            return []
        images = mm_items.get_items("image", ImageProcessorItems)
        sizes = [images.get_image_size(i) for i in range(images.get_count())]
        return [self.info.get_num_crops(image_width=s.width, image_height=s.height, mm_kwargs=mm_kwargs) for s in sizes]

    def _write_image_texts(self, prompt: Any, mm_items: MultiModalDataItems, mm_kwargs: Mapping[str, object]) -> Any:
        texts = [self.info.get_image_texts(n) for n in self._num_crops(mm_items, mm_kwargs)]
        if isinstance(prompt, str):
            parts = prompt.split(BOI_TOKEN)
            out = parts[0]
            for i, part in enumerate(parts[1:]):
                out += (texts[i][0] + BOI_TOKEN + texts[i][2] if i < len(texts) else BOI_TOKEN) + part
            return out
        tokenizer = self.info.get_tokenizer()
        boi_id = self.info.get_hf_config().boi_token_index
        out_ids: list[int] = []
        count = 0
        for token in prompt:
            if token == boi_id and count < len(texts):
                before, _, after = texts[count]
                out_ids += tokenizer.encode(before, add_special_tokens=False) + [token]
                out_ids += tokenizer.encode(after, add_special_tokens=False)
                count += 1
            else:
                out_ids.append(token)
        return out_ids

    def _apply_hf_processor_main(
        self, prompt, mm_items: MultiModalDataItems, hf_processor_mm_kwargs, *, enable_hf_prompt_update: bool
    ):
        """The text tokenized apart from the images (its image texts are already written), which are
        placed by us."""
        return super()._apply_hf_processor_main(prompt, mm_items, hf_processor_mm_kwargs, enable_hf_prompt_update=False)

    def _call_hf_processor(
        self, prompt: str, mm_data: Mapping[str, object], mm_kwargs: Mapping[str, object]
    ) -> BatchFeature:
        """HF's outputs and each image's number of crops (HF computes it but drops it). The pan-and-scan
        settings go to the call (`multimodal.context.split_mm_kwargs`: Gemma3Processor's class defaults
        override what its image processor was constructed with)."""
        processed = super()._call_hf_processor(prompt, mm_data, mm_kwargs)
        images = mm_data.get("images")
        if not images:
            return processed
        sizes = [image_size_of(image) for image in images]
        num_crops = [
            self.info.get_num_crops(image_width=s.width, image_height=s.height, mm_kwargs=mm_kwargs) for s in sizes
        ]
        if processed["pixel_values"].shape[0] != sum(num_crops) + len(num_crops):
            raise RuntimeError(
                f"The HF processor gave {processed['pixel_values'].shape[0]} images and crops for images that "
                f"should give {[n + 1 for n in num_crops]}"
            )
        processed["num_crops"] = torch.tensor(num_crops)
        return processed

    def _get_mm_fields_config(
        self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        num_crops = torch.as_tensor(hf_inputs.get("num_crops", torch.empty(0, dtype=torch.long)))
        return dict(
            pixel_values=MultiModalFieldConfig.flat_from_sizes("image", num_crops + 1),
            num_crops=MultiModalFieldConfig.batched("image"),
        )

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_mm_kwargs: MultiModalKwargs,
    ) -> Sequence[PromptUpdate]:
        config = self.info.get_hf_config()
        num_crops = self._num_crops(mm_items, hf_processor_mm_kwargs)

        def get_replacement(item_idx: int) -> PromptUpdateDetails:
            _, tokens, _ = self.info.get_image_texts(num_crops[item_idx])
            return PromptUpdateDetails.select_token_id(tokens, config.image_token_index)

        return [PromptReplacement(modality="image", target=[config.boi_token_index], replacement=get_replacement)]


class Gemma3MultiModalProjector(nn.Module):
    """[N, patches, vision hidden] -> average-pooled to mm_tokens_per_image, normed, projected."""

    def __init__(self, config: Gemma3Config) -> None:
        super().__init__()
        vision, text = config.vision_config, config.text_config
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vision.hidden_size, text.hidden_size))
        self.mm_soft_emb_norm = Gemma3RMSNorm(vision.hidden_size, eps=vision.layer_norm_eps)
        self.patches_per_image = vision.image_size // vision.patch_size
        tokens_per_side = math.isqrt(config.mm_tokens_per_image)
        if tokens_per_side**2 != config.mm_tokens_per_image or self.patches_per_image % tokens_per_side:
            raise ValueError(
                f"mm_tokens_per_image {config.mm_tokens_per_image} must be a square whose side divides "
                f"{self.patches_per_image} patches per side"
            )
        self.kernel_size = self.patches_per_image // tokens_per_side

    def forward(self, vision_outputs: torch.Tensor) -> torch.Tensor:
        n, _, hidden = vision_outputs.shape
        grid = vision_outputs.transpose(1, 2).reshape(n, hidden, self.patches_per_image, self.patches_per_image)
        pooled = nn.functional.avg_pool2d(grid.contiguous(), self.kernel_size, self.kernel_size)
        normed = self.mm_soft_emb_norm(pooled.flatten(2).transpose(1, 2))
        return torch.matmul(normed, self.mm_input_projection_weight).type_as(vision_outputs)


@MULTIMODAL_REGISTRY.register_processor(
    Gemma3MultiModalProcessor, info=Gemma3ProcessingInfo, dummy_inputs=Gemma3DummyInputsBuilder
)
class Gemma3ForConditionalGeneration(nn.Module, SupportsMultiModal):
    multimodal_parts = {"vision": "vision_tower", "projector": "multi_modal_projector"}
    is_mm_prefix_lm = True
    # Hub checkpoints (google/gemma-3-*) have the top-level layout with the tower's "vision_model."
    # level; transformers 5 saves it without that level, and >= 4.52 nests the parts under "model.".
    hf_to_tessera_prefixes = {
        "model.language_model.": "language_model.model.",
        "model.vision_tower.vision_model.": "vision_tower.vision_model.",
        "model.vision_tower.": "vision_tower.vision_model.",
        "vision_tower.vision_model.": "vision_tower.vision_model.",
        "vision_tower.": "vision_tower.vision_model.",
        "model.multi_modal_projector.": "multi_modal_projector.",
        "lm_head.": "language_model.lm_head.",
    }

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> Optional[str]:
        return BOI_TOKEN if modality == "image" else None

    def __init__(self, config: Gemma3Config) -> None:
        super().__init__()
        self.config = config
        if config.vision_config.model_type != "siglip_vision_model":
            raise ValueError(f"Unsupported Gemma 3 vision tower {config.vision_config.model_type!r}; supported: SigLIP")
        self.vision_tower = SiglipVisionModel(config.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)
        self.language_model = ModelRegistry.build_language_model(config)
        self.placeholder_token_id = config.image_token_index

    def get_language_model(self) -> nn.Module:
        return self.language_model

    def _image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] -> [N, mm_tokens_per_image, text hidden]."""
        dtype, device = module_dtype_device(self.vision_tower)
        last, _ = self.vision_tower(pixel_values.to(device=device, dtype=dtype))
        dtype, device = module_dtype_device(self.multi_modal_projector)
        return self.multi_modal_projector(last.to(device=device, dtype=dtype))

    def get_multimodal_embeddings(self, **kwargs: object) -> Optional[MultiModalEmbeddings]:
        """One [(1 + crops) * mm_tokens_per_image, hidden] tensor per image: the image's, then its crops'."""
        pixel_values = kwargs.get("pixel_values")
        if pixel_values is None:
            return None
        pixel_values = stack_images(pixel_values, "pixel_values", "images and crops")
        num_crops = kwargs.get("num_crops")
        crops = [0] * pixel_values.shape[0] if num_crops is None else torch.as_tensor(num_crops).reshape(-1).tolist()
        features = self._image_features(pixel_values)
        return [item.flatten(0, 1) for item in features.split([int(n) + 1 for n in crops])]

    def forward(
        self, input_ids: Optional[torch.Tensor], positions: torch.Tensor, inputs_embeds: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Hidden states [T, hidden]; items are merged into inputs_embeds by get_input_embeddings."""
        return self.language_model(input_ids, positions, inputs_embeds)
