"""A tiny LLaVA checkpoint split the way LLaVA pipelines ship: a text Llama folder, a CLIP vision
folder and an mm_projector file, all from the same weights."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer, CLIPImageProcessor, LlamaForCausalLM
from transformers import LlavaForConditionalGeneration as HFLlava


@pytest.fixture(scope="session")
def llava_parts(tiny_llava_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("llava_parts")
    text_dir, vision_dir = root / "tiny-llava-v1.5-7b", root / "clip"
    hf = HFLlava.from_pretrained(tiny_llava_dir, dtype=torch.float32)
    text_model = LlamaForCausalLM(hf.config.text_config)  # transformers 5 keeps the decoder and head apart
    text_model.model.load_state_dict(hf.model.language_model.state_dict())
    text_model.lm_head.load_state_dict(hf.lm_head.state_dict())
    text_model.save_pretrained(text_dir)
    AutoTokenizer.from_pretrained(tiny_llava_dir).save_pretrained(text_dir)
    hf.model.vision_tower.save_pretrained(vision_dir)
    CLIPImageProcessor.from_pretrained(tiny_llava_dir).save_pretrained(vision_dir)
    projector = hf.model.multi_modal_projector
    weights = {  # the original LLaVA-1.5 names (mlp2x_gelu: indices 0 and 2)
        "model.mm_projector.0.weight": projector.linear_1.weight, "model.mm_projector.0.bias": projector.linear_1.bias,
        "model.mm_projector.2.weight": projector.linear_2.weight, "model.mm_projector.2.bias": projector.linear_2.bias,
    }  # fmt: skip
    save_file({k: v.detach().contiguous() for k, v in weights.items()}, str(text_dir / "mm_projector.safetensors"))
    return {"text": text_dir, "vision": vision_dir, "projector": text_dir / "mm_projector.safetensors"}
