"""LLaVA as a pipeline: a CLIP vision tower from a local folder and the `mm_projector` weights
from a local file, for a Llama text model.

The variants (text-generation-webui's llava-7b / llava-13b / llava-llama-2-13b / llava-v1.5-*)
differ in their image markers and placeholder token; the projector (one Linear, or
Linear-GELU-Linear) is read off the weights, and the number of embeddings per image off the
vision tower (patches of its image size), so no count is hard-coded.

params: vision_tower (CLIP folder; default MODEL/vision_tower), mm_projector (a .safetensors or
.bin file; default MODEL/mm_projector.safetensors or .bin), vision_device, vision_bits,
projector_device, projector_bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from PIL import Image
from torch import nn
from transformers import CLIPImageProcessor, CLIPVisionModel

from tessera.pipelines import AbstractMultimodalPipeline


@dataclass(frozen=True)
class LlavaVariant:
    name: str
    image_start: Optional[str]
    image_end: Optional[str]
    placeholder_token: Optional[str]  # None: the tokenizer's unk token (id 0 in LLaMA)
    vision_feature_layer: int = -2  # LLaVA reads the penultimate CLIP layer, without CLS


VARIANTS = {
    v.name: v
    for v in (
        LlavaVariant("llava-7b", "<im_start>", "<im_end>", "<im_patch>"),
        LlavaVariant("llava-13b", "<im_start>", "<im_end>", "<im_patch>"),
        LlavaVariant("llava-llama-2-13b", None, None, None),
        LlavaVariant("llava-v1.5-7b", None, None, None),
        LlavaVariant("llava-v1.5-13b", None, None, None),
    )
}
_PREFIXES = ("model.mm_projector.", "mm_projector.", "multi_modal_projector.", "")


def load_projector(path: Path) -> nn.Module:
    """The projector in `path`: one Linear, or Linear-GELU-Linear (as LLaVA-1.5's mlp2x_gelu)."""
    if not path.is_file():
        raise ValueError(f"The llava pipeline needs mm_projector weights; {path} does not exist.")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        weights = load_file(str(path))
    else:
        weights = torch.load(path, map_location="cpu", weights_only=True)
    for prefix in _PREFIXES:
        state = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
        if "weight" in state:
            out_features, in_features = state["weight"].shape
            projector: nn.Module = nn.Linear(in_features, out_features)
            break
        if "0.weight" in state and "2.weight" in state:
            (hidden, in_features), (out_features, _) = state["0.weight"].shape, state["2.weight"].shape
            projector = nn.Sequential(nn.Linear(in_features, hidden), nn.GELU(), nn.Linear(hidden, out_features))
            break
    else:
        raise ValueError(f"{path} holds no LLaVA projector weights (found {sorted(weights)[:6]} ...).")
    projector.load_state_dict({k: v for k, v in state.items() if k.split(".")[-1] in ("weight", "bias")})
    return projector


class LlavaPipeline(AbstractMultimodalPipeline):
    variant: LlavaVariant = VARIANTS["llava-v1.5-7b"]

    def __init__(self, params: dict) -> None:
        model_path = Path(params.get("model_path") or ".")
        vision_dir = Path(params.get("vision_tower") or model_path / "vision_tower")
        if not (vision_dir / "config.json").is_file():
            raise ValueError(f"The llava pipeline needs a CLIP vision tower folder; {vision_dir} has no config.json.")
        projector_path = params.get("mm_projector")
        if projector_path is None:
            candidates = [model_path / "mm_projector.safetensors", model_path / "mm_projector.bin"]
            projector_path = next((p for p in candidates if p.is_file()), candidates[0])
        self.vision_device = self._get_device("vision_device", params)
        self.vision_dtype = self._get_dtype("vision_bits", params)
        self.projector_device = self._get_device("projector_device", params)
        self.projector_dtype = self._get_dtype("projector_bits", params)
        self.image_processor = CLIPImageProcessor.from_pretrained(vision_dir)
        self.vision_tower = CLIPVisionModel.from_pretrained(vision_dir, dtype=self.vision_dtype)
        self.vision_tower.to(self.vision_device).eval()
        self.mm_projector = load_projector(Path(projector_path)).to(self.projector_device, self.projector_dtype).eval()
        config = self.vision_tower.config
        self._num_embeds = (config.image_size // config.patch_size) ** 2

    @classmethod
    def name(cls) -> str:
        return cls.variant.name

    @classmethod
    def image_start(cls) -> Optional[str]:
        return cls.variant.image_start

    @classmethod
    def image_end(cls) -> Optional[str]:
        return cls.variant.image_end

    def placeholder_token_id(self) -> int:
        token = self.variant.placeholder_token or self.tokenizer.unk_token
        token_id = self.tokenizer.convert_tokens_to_ids(token) if token is not None else None
        if token_id is None or (token_id == self.tokenizer.unk_token_id and token != self.tokenizer.unk_token):
            raise ValueError(f"Pipeline {self.name()!r} needs the token {token!r}, which this tokenizer lacks.")
        return token_id

    def num_image_embeds(self) -> int:
        return self._num_embeds

    @torch.no_grad()
    def embed_images(self, images: list[Image.Image]) -> torch.Tensor:
        pixels = self.image_processor(images, return_tensors="pt")["pixel_values"]
        pixels = pixels.to(self.vision_device, dtype=self.vision_dtype)
        states = self.vision_tower(pixels, output_hidden_states=True).hidden_states[self.variant.vision_feature_layer]
        features = states[:, 1:].to(self.projector_device, dtype=self.projector_dtype)
        return self.mm_projector(features)


def make_pipeline(name: str, params: dict) -> LlavaPipeline:
    cls = type(f"LlavaPipeline_{name}", (LlavaPipeline,), {"variant": VARIANTS[name]})
    return cls(params)
