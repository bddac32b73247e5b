"""Tiny, randomly initialised Qwen2-VL and Qwen2.5-VL checkpoints in Hugging Face folder format, built offline.

Text: Qwen2-VL's Qwen2 decoder, hidden 32, 2 layers, 4 heads over 2 KV heads (head_dim 8, M-RoPE
sections [1, 1, 2] over its 4 frequencies). Vision: depth 2, embed_dim 32, 2 heads, 8-pixel patches,
2x2 spatial merge, 2 frames per temporal patch. The processor keeps images between 256 and 3072
pixels, i.e. 1 to 12 merged tokens each. The tokenizer is a tiny byte-level BPE with Qwen2-VL's
special tokens (<|im_start|>, <|im_end|>, <|vision_start|>, <|vision_end|>, <|image_pad|>, <|video_pad|>).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)

from .tokenizer import QWEN_VL_CHAT_TEMPLATE, QWEN_VL_SPECIAL_TOKENS, build_tokenizer

PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE = 8, 2, 2
MIN_PIXELS, MAX_PIXELS = 16 * 16, 16 * 16 * 12


def _text_config(tokenizer) -> tuple[dict, dict[str, int]]:
    """Qwen2 decoder, hidden 32, 2 layers, 4 heads over 2 KV heads, M-RoPE sections [1, 1, 2]; the special token ids."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_VL_SPECIAL_TOKENS}
    text = dict(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
    )  # fmt: skip
    return text, ids


def _vision_token_ids(ids: dict[str, int]) -> dict[str, int]:
    return dict(
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip


def _save(folder: Path, model_cls, config, processor_cls, tokenizer, seed: int, video_processor=None) -> Path:
    """Widened random weights (HF's init leaves small ones), then the processor with the tiny resize bounds."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
        with torch.no_grad():  # HF's init leaves small weights; widen them so outputs depend on the inputs
            for name, param in model.named_parameters():
                if param.ndim >= 2 and "norm" not in name:
                    param.normal_(0, 0.2)
        model.save_pretrained(folder, safe_serialization=True)
    processing = dict(
        patch_size=PATCH_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE, merge_size=MERGE_SIZE,
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
    )  # fmt: skip
    processor = processor_cls(
        image_processor=Qwen2VLImageProcessor(**processing),
        tokenizer=tokenizer,
        video_processor=video_processor or Qwen2VLVideoProcessor(**processing),
        chat_template=QWEN_VL_CHAT_TEMPLATE,
    )
    processor.save_pretrained(folder)
    return folder


def build_tiny_qwen2_vl(folder, *, seed: int = 0) -> Path:
    """Write the checkpoint (config, safetensors, tokenizer, processor) to `folder`; returns it."""
    tokenizer = build_tokenizer("qwen")
    text, ids = _text_config(tokenizer)
    vision = dict(
        depth=2, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=PATCH_SIZE,
        spatial_merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE, hidden_act="quick_gelu",
    )  # fmt: skip
    config = Qwen2VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=False, **_vision_token_ids(ids)
    )  # fmt: skip
    return _save(Path(folder), Qwen2VLForConditionalGeneration, config, Qwen2VLProcessor, tokenizer, seed)


def build_tiny_qwen2_5_vl(folder, *, seed: int = 0) -> Path:
    """Qwen2.5-VL: the same decoder, tokenizer and processing; vision depth 4 (blocks 1 and 3 attend over
    whole frames, 0 and 2 within 32-pixel windows, i.e. 2x2 merged tokens), width 32, 2 heads, SwiGLU 64;
    25 tokens per second (videos without metadata are taken at 24 fps: 2.08 positions per grid frame).
    Write the checkpoint to `folder`; returns it."""
    tokenizer = build_tokenizer("qwen")
    text, ids = _text_config(tokenizer)
    vision = dict(
        depth=4, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"],
        patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE,
        hidden_act="silu", window_size=32, fullatt_block_indexes=[1, 3], tokens_per_second=25,
    )  # fmt: skip
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=False, **_vision_token_ids(ids)
    )  # fmt: skip
    return _save(Path(folder), Qwen2_5_VLForConditionalGeneration, config, Qwen2_5_VLProcessor, tokenizer, seed)


def build_tiny_qwen3_vl(folder, *, seed: int = 0) -> Path:
    """Qwen3-VL: a Qwen3 decoder (q/k RMSNorm, head_dim 8) with interleaved M-RoPE sections [2, 1, 1],
    3 layers; vision depth 3, width 32, 2 heads, 8-pixel patches, a learned 4x4 position table
    resampled to each grid, DeepStack features from vision blocks 0 and 1 added after decoder layers
    0 and 1. Videos are sampled by the HF processor's rules unless frames are given pre-sampled.
    Write the checkpoint to `folder`; returns it."""
    return _build_qwen3_vl(Path(folder), Qwen3VLConfig, Qwen3VLForConditionalGeneration, {}, seed)


def build_tiny_qwen3_vl_moe(folder, *, seed: int = 0, released_layout: bool = False) -> Path:
    """Qwen3-VL-MoE: build_tiny_qwen3_vl's model with 8 routed experts, top-2, width 24 in every decoder layer
    but the first (mlp_only_layers [0]: a dense MLP). With `released_layout` the experts are written as the
    released checkpoints hold them ([E, H, 2I] / [E, I, H]), not as transformers saves them. Returns `folder`."""
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1,
               mlp_only_layers=[0])  # fmt: skip
    folder = _build_qwen3_vl(Path(folder), Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration, moe, seed)
    if released_layout:
        from safetensors.torch import load_file, save_file

        weights = load_file(folder / "model.safetensors")
        for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            weights[name] = weights[name].transpose(1, 2).contiguous()
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _build_qwen3_vl(folder: Path, config_cls, model_cls, text_overrides: dict, seed: int) -> Path:
    """The tiny Qwen3-VL of build_tiny_qwen3_vl (its text config changed by `text_overrides`), saved."""
    tokenizer = build_tokenizer("qwen")
    text, ids = _text_config(tokenizer)
    text.update(
        num_hidden_layers=3, head_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                         "mrope_interleaved": True},
        **text_overrides,
    )  # fmt: skip
    vision = dict(
        depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"],
        patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE,
        hidden_act="gelu_pytorch_tanh", num_position_embeddings=16, deepstack_visual_indexes=[0, 1],
    )  # fmt: skip
    config = config_cls(text_config=text, vision_config=vision, tie_word_embeddings=False, **_vision_token_ids(ids))
    # Qwen3-VL's video processor bounds the pixels of the whole clip (frames x height x width)
    video_processor = Qwen3VLVideoProcessor(
        patch_size=PATCH_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE, merge_size=MERGE_SIZE,
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS * 4},
    )  # fmt: skip
    return _save(folder, model_cls, config, Qwen3VLProcessor, tokenizer, seed, video_processor)


@dataclass(frozen=True)
class MMFeature:
    """One item as the engine hands it to `get_mrope_input_positions` (vLLM's MultiModalFeatureSpec fields)."""

    modality: str
    data: Any
    mm_position: Any


def mm_features(processed) -> list[MMFeature]:
    """The items of a processor output (MultiModalInputs), videos before images: M-RoPE positions must
    follow the placeholders, whatever order the items come in."""
    return [
        MMFeature(modality, item, placeholder)
        for modality in sorted(processed["mm_placeholders"], reverse=True)
        for item, placeholder in zip(processed["mm_kwargs"].get_items(modality), processed["mm_placeholders"][modality])
    ]


QWEN3_5_LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def build_tiny_qwen3_5(folder, *, seed: int = 0, moe: bool = False) -> Path:
    """Qwen3.5: a hybrid decoder of 4 layers (Gated DeltaNet, full attention, DeltaNet, full), hidden 32;
    attention 4 heads over 2 KV heads of 16 dims, half of each rotated (interleaved M-RoPE
    sections [2, 1, 1]); DeltaNet 2 key heads serving 4 value heads of 8 dims, conv width 4. Qwen3-VL's
    tower without DeepStack (depth 2, width 32) and processing. With `moe`, Qwen3.5-MoE: every MLP 8 routed
    experts of width 24, top-2, and a shared expert of width 48 (transformers saves the experts one by one).
    Write the checkpoint to `folder`; returns it."""
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    tokenizer = build_tokenizer("qwen")
    text, ids = _text_config(tokenizer)
    text.update(
        num_hidden_layers=len(QWEN3_5_LAYER_TYPES), layer_types=QWEN3_5_LAYER_TYPES, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    )  # fmt: skip
    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"],
        patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE,
        hidden_act="gelu_pytorch_tanh", num_position_embeddings=16,
    )  # fmt: skip
    config_cls, model_cls = Qwen3_5Config, Qwen3_5ForConditionalGeneration
    if moe:
        text.pop("intermediate_size")
        text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=48)
        config_cls, model_cls = Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
    config = config_cls(text_config=text, vision_config=vision, tie_word_embeddings=False, **_vision_token_ids(ids))
    video_processor = Qwen3VLVideoProcessor(
        patch_size=PATCH_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE, merge_size=MERGE_SIZE,
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS * 4},
    )  # fmt: skip
    return _save(Path(folder), model_cls, config, Qwen3VLProcessor, tokenizer, seed, video_processor)
