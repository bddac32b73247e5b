"""A random vision side for the demo VLM's assembly (`tessera.models.demo_vlm`), for tests: the folder
format the project ships (vision_config.json + vision.safetensors), tiny and seeded."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

TEXT_HIDDEN = 576  # SmolLM2-135M's hidden size: the projector's output


TINY_VISION = dict(
    image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
)


def build_random_vision_dir(folder, *, seed: int = 0, **vision: int) -> Path:
    """A seeded random CLIP tower and 2-layer GELU projector (to SmolLM2's width); `vision` overrides
    TINY_VISION's sizes (the training script starts from its own)."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vision_config = CLIPVisionConfig(**{**TINY_VISION, **vision})
    width = vision_config.hidden_size
    torch.manual_seed(seed)
    tower = CLIPVisionModel(vision_config)
    tensors = {f"vision_tower.{name}": t.detach().contiguous() for name, t in tower.state_dict().items()}
    for name, shape in (("linear_1", (TEXT_HIDDEN, width)), ("linear_2", (TEXT_HIDDEN, TEXT_HIDDEN))):
        tensors[f"multi_modal_projector.{name}.weight"] = torch.randn(shape) * shape[1] ** -0.5
        tensors[f"multi_modal_projector.{name}.bias"] = torch.randn(shape[0]) * 0.02
    tensors = {k: v for k, v in tensors.items() if not k.endswith("position_ids")}
    save_file(tensors, folder / "vision.safetensors", metadata={"format": "pt"})
    settings = {
        "vision_config": vision_config.to_diff_dict() | {"model_type": "clip_vision_model"},
        "projector_hidden_act": "gelu", "vision_feature_layer": -1, "vision_feature_select_strategy": "default",
    }  # fmt: skip
    (folder / "vision_config.json").write_text(json.dumps(settings, indent=2))
    return folder
