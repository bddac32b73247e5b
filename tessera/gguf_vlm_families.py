"""The llama.cpp projector types Tessera maps (`FAMILIES`): for each, the transformers VLM it runs as, the
config that the mmproj's metadata and tensor shapes and the language model's config make, and the processor
configuration, with what neither file says filled in from the released checkpoints' own configs or from
llama.cpp's defaults (Qwen2-VL's token range, Qwen2.5-VL's 112-pixel windows...). `tessera.gguf_vlm` reads the
pair with them."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

from transformers import PretrainedConfig

from .gguf_mmproj import Mmproj

QWEN2_VL_IMAGE_TOKENS = (8, 4096)
"""The fewest and most tokens an image becomes in Qwen2-VL / Qwen2.5-VL where the mmproj says no pixel range
(``clip.vision.image_min_pixels`` / ``image_max_pixels``): llama.cpp's limits for these projectors. A request
may set others (``mm_processor_kwargs={"max_pixels": ...}``), as for any model."""


@dataclass(frozen=True)
class Family:
    """How one projector type becomes a transformers VLM."""

    architecture: str
    language_models: tuple[str, ...]
    """The language-model GGUF architectures (``general.architecture``) this projector goes with."""
    tokens: dict[str, str]
    """Token strings the processor and config need, by the name the tokenizer and config give them."""
    config: Callable[[Mmproj, PretrainedConfig, dict[str, int], dict[str, Any]], dict[str, Any]]
    """(mmproj, text config, token ids, the language-model file's metadata) -> the VLM's config.json dict."""
    processor: Callable[[Mmproj, dict[str, Any]], dict[str, Any]]
    """(mmproj, config dict) -> processor_config.json."""
    projector_width: Callable[[Mmproj], int]
    """The width of the embeddings the projector gives the language model."""
    optional_tokens: dict[str, str] = dataclasses.field(default_factory=dict)
    """Tokens the processor names where the vocabulary has them (a video token, for videos only)."""


def _activation(mm: Mmproj, default: str) -> str:
    if mm.values.get("clip.use_silu"):
        return "silu"
    if mm.values.get("clip.use_gelu"):
        return default if default.startswith("gelu") else "gelu"
    return "quick_gelu"


def _text_config(text: PretrainedConfig, model_type: str, **changes: Any) -> dict[str, Any]:
    config = text.to_dict()
    for key in ("architectures", "_name_or_path", "transformers_version"):
        config.pop(key, None)
    return {**config, "model_type": model_type, **changes}


def _processor_component(class_name: str, **settings: Any) -> dict[str, Any]:
    import transformers

    component = getattr(transformers, class_name)(**settings).to_dict()
    component.pop("_processor_class", None)
    return component


# ---- Qwen2-VL and Qwen2.5-VL -------------------------------------------------------------------------------


def _qwen_vl_config(mm: Mmproj, text: PretrainedConfig, ids: dict[str, int], lm: dict[str, Any],
                    v25: bool) -> dict[str, Any]:  # fmt: skip
    width, merger_in = mm.vision("embedding_length"), mm.shape("mm.0.weight")[1]
    merge = int(mm.vision("spatial_merge_size", 0)) or math.isqrt(merger_in // width)
    sections = lm.get("qwen2vl.rope.dimension_sections") or []  # M-RoPE's (t, h, w) sections, padded to 4
    vision = {"depth": mm.block_count(), "num_heads": mm.vision("attention.head_count"),
              "patch_size": mm.vision("patch_size"), "spatial_merge_size": merge, "temporal_patch_size": 2,
              "in_channels": 3}  # fmt: skip
    ffn = mm.shape("v.blk.0.ffn_up.weight")[0]  # the converter's feed_forward_length is not the tower's
    if v25:
        period = int(mm.vision("n_wa_pattern", 0)) or mm.block_count() + 1
        vision.update(hidden_size=width, intermediate_size=ffn, out_hidden_size=mm.vision("projection_dim"),
                      hidden_act=_activation(mm, "gelu"), window_size=int(mm.vision("window_size", 112)),
                      fullatt_block_indexes=[k * period - 1 for k in range(1, mm.block_count() // period + 1)],
                      model_type="qwen2_5_vl_vision")  # fmt: skip
    else:
        ratio = ffn // width if ffn % width == 0 else ffn / width  # the config takes an int where it is one
        vision.update(embed_dim=width, hidden_size=mm.vision("projection_dim"), mlp_ratio=ratio,
                      hidden_act=_activation(mm, "gelu"), model_type="qwen2_vl_vision")  # fmt: skip
    rope = dict(text.rope_parameters or {}, mrope_section=list(sections[:3]))
    model_type = "qwen2_5_vl" if v25 else "qwen2_vl"
    return {"model_type": model_type, "text_config": _text_config(text, model_type + "_text", rope_parameters=rope),
            "vision_config": vision, "image_token_id": ids["image_token"], "video_token_id": ids["video_token"],
            "vision_start_token_id": ids["vision_start_token"],
            "vision_end_token_id": ids["vision_end_token"]}  # fmt: skip


def _qwen_vl_processor(mm: Mmproj, config: dict[str, Any], v25: bool) -> dict[str, Any]:
    vision = config["vision_config"]
    area = (vision["patch_size"] * vision["spatial_merge_size"]) ** 2  # the pixels of one token
    least, most = QWEN2_VL_IMAGE_TOKENS
    size = {"shortest_edge": mm.vision("image_min_pixels", least * area),
            "longest_edge": mm.vision("image_max_pixels", most * area)}  # fmt: skip
    settings = dict(patch_size=vision["patch_size"], merge_size=vision["spatial_merge_size"], temporal_patch_size=2,
                    image_mean=mm.vision("image_mean"), image_std=mm.vision("image_std"), size=size)  # fmt: skip
    return {"processor_class": "Qwen2_5_VLProcessor" if v25 else "Qwen2VLProcessor",
            "image_processor": _processor_component("Qwen2VLImageProcessor", **settings),
            "video_processor": _processor_component("Qwen2VLVideoProcessor", **settings)}  # fmt: skip


_QWEN_TOKENS = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>"}  # fmt: skip


# ---- SigLIP / CLIP towers: Gemma 3, Idefics3 / SmolVLM, LLaVA ---------------------------------------------


def _tower(mm: Mmproj, model_type: str, activation: str, layers: int | None = None) -> dict[str, Any]:
    up, down = mm.shape("v.blk.0.ffn_up.weight"), mm.shape("v.blk.0.ffn_down.weight")
    return {"model_type": model_type, "hidden_size": mm.vision("embedding_length"),
            "intermediate_size": max(up[0], down[0]),  # the older LLaVA files swap up and down: the wider one
            "num_hidden_layers": mm.block_count() if layers is None else layers,
            "num_attention_heads": mm.vision("attention.head_count"), "image_size": mm.vision("image_size"),
            "patch_size": mm.vision("patch_size"), "layer_norm_eps": mm.vision("attention.layer_norm_epsilon"),
            "hidden_act": _activation(mm, activation), "num_channels": 3}  # fmt: skip


def _gemma3_config(mm: Mmproj, text: PretrainedConfig, ids: dict[str, int], lm: dict[str, Any]) -> dict[str, Any]:
    side = mm.vision("image_size") // mm.vision("patch_size") // int(mm.vision("projector.scale_factor", 4))
    vision = {**_tower(mm, "siglip_vision_model", "gelu_pytorch_tanh"), "vision_use_head": False}
    return {"model_type": "gemma3", "text_config": _text_config(text, "gemma3_text"), "vision_config": vision,
            "mm_tokens_per_image": side * side, "boi_token_index": ids["boi_token"],
            "eoi_token_index": ids["eoi_token"], "image_token_index": ids["image_token"]}  # fmt: skip


def _gemma3_processor(mm: Mmproj, config: dict[str, Any]) -> dict[str, Any]:
    size = mm.vision("image_size")  # llama.cpp: one fixed-size image, no pan and scan
    image = _processor_component("Gemma3ImageProcessor", size={"height": size, "width": size},
                                 image_mean=mm.vision("image_mean"), image_std=mm.vision("image_std"))  # fmt: skip
    return {"processor_class": "Gemma3Processor", "image_processor": image,
            "image_seq_length": config["mm_tokens_per_image"]}  # fmt: skip


def _is_smolvlm(mm: Mmproj, lm: dict[str, Any]) -> bool:
    """Idefics3 and SmolVLM share the "idefics3" projector; the files' names tell them apart."""
    names = [mm.name, *(str(lm.get(key) or "") for key in ("general.name", "general.basename"))]
    return any("smolvlm" in name.lower().replace(" ", "").replace("-", "") for name in names)


def _idefics3_config(mm: Mmproj, text: PretrainedConfig, ids: dict[str, int], lm: dict[str, Any]) -> dict[str, Any]:
    kind = "smolvlm" if _is_smolvlm(mm, lm) else "idefics3"
    return {"model_type": kind, "text_config": _text_config(text, text.model_type),
            "vision_config": _tower(mm, kind + "_vision", "gelu_pytorch_tanh"),
            "scale_factor": int(mm.vision("projector.scale_factor", 2)),
            "image_token_id": ids["image_token"]}  # fmt: skip


def _idefics3_processor(mm: Mmproj, config: dict[str, Any]) -> dict[str, Any]:
    kind = "SmolVLM" if config["model_type"] == "smolvlm" else "Idefics3"
    vision = config["vision_config"]
    tile = vision["image_size"]  # each tile the tower sees; the whole image is first resized to preproc_image_size
    settings = dict(size={"longest_edge": int(mm.vision("preproc_image_size", 4 * tile))},
                    max_image_size={"longest_edge": tile}, image_mean=mm.vision("image_mean"),
                    image_std=mm.vision("image_std"), do_image_splitting=True)  # fmt: skip
    processor = {"processor_class": f"{kind}Processor",
                 "image_processor": _processor_component(f"{kind}ImageProcessor", **settings),
                 "image_seq_len": (tile // vision["patch_size"]) ** 2 // config["scale_factor"] ** 2}  # fmt: skip
    if kind == "SmolVLM":
        settings.pop("do_image_splitting")
        processor["video_processor"] = _processor_component("SmolVLMVideoProcessor", **settings)
    return processor


def _llava_config(mm: Mmproj, text: PretrainedConfig, ids: dict[str, int], lm: dict[str, Any]) -> dict[str, Any]:
    layers = mm.vision("feature_layer", None)  # indices into the hidden states; none: the file's last block
    vision = _tower(mm, "clip_vision_model", "gelu")
    config = {"model_type": "llava", "text_config": _text_config(text, text.model_type), "vision_config": vision,
              "image_token_index": ids["image_token"], "projector_hidden_act": "gelu",
              "vision_feature_layer": (layers[0] if len(layers) == 1 else list(layers)) if layers else -1,
              "vision_feature_select_strategy": "default",
              "image_seq_length": (vision["image_size"] // vision["patch_size"]) ** 2}  # fmt: skip
    pinpoints = mm.vision("image_grid_pinpoints", None)
    if pinpoints:  # LLaVA-NeXT: any-resolution tiles
        grid = [list(pair) for pair in zip(pinpoints[::2], pinpoints[1::2])]  # the file flattens the pairs
        config.update(model_type="llava_next", image_grid_pinpoints=grid)
    return config


def _llava_processor(mm: Mmproj, config: dict[str, Any]) -> dict[str, Any]:
    vision = config["vision_config"]
    size = vision["image_size"]
    settings = dict(size={"shortest_edge": size}, crop_size={"height": size, "width": size},
                    image_mean=mm.vision("image_mean"), image_std=mm.vision("image_std"))  # fmt: skip
    processor = {"patch_size": vision["patch_size"], "vision_feature_select_strategy": "default",
                 "num_additional_image_tokens": 1, "image_token": "<image>"}  # fmt: skip
    if config["model_type"] == "llava_next":
        image = _processor_component("LlavaNextImageProcessor", image_grid_pinpoints=config["image_grid_pinpoints"],
                                     **settings)  # fmt: skip
        return {**processor, "processor_class": "LlavaNextProcessor", "image_processor": image}
    return {**processor, "processor_class": "LlavaProcessor",
            "image_processor": _processor_component("CLIPImageProcessor", **settings)}  # fmt: skip


INTERNVL_TILES = (1, 12)
"""The fewest and most 448-pixel tiles an image is cut into where the mmproj says no other
(``clip.vision.preproc_min_tiles`` / ``preproc_max_tiles``): llama.cpp's and the released processors' range."""


def _internvl_config(mm: Mmproj, text: PretrainedConfig, ids: dict[str, int], lm: dict[str, Any]) -> dict[str, Any]:
    size, patch, scale = mm.vision("image_size"), mm.vision("patch_size"), int(mm.vision("projector.scale_factor", 2))
    tower = _tower(mm, "internvl_vision", "gelu")
    vision = {**{k: v for k, v in tower.items() if k != "num_channels"}, "image_size": [size, size],
              "patch_size": [patch, patch], "attention_bias": "v.blk.0.attn_q.bias" in mm.shapes,
              "use_qk_norm": "v.blk.0.attn_q_norm.weight" in mm.shapes, "norm_type": "layer_norm",
              "use_mean_pooling": True}  # fmt: skip
    return {"model_type": "internvl", "text_config": _text_config(text, text.model_type), "vision_config": vision,
            "downsample_ratio": 1 / scale, "image_token_id": ids["context_image_token"],
            "projector_hidden_act": "gelu", "vision_feature_layer": -1, "vision_feature_select_strategy": "default",
            "image_seq_length": (size // patch) ** 2 // scale**2}  # fmt: skip


def _internvl_processor(mm: Mmproj, config: dict[str, Any]) -> dict[str, Any]:
    size = mm.vision("image_size")
    least, most = (int(mm.vision(key, default)) for key, default in zip(("preproc_min_tiles", "preproc_max_tiles"),
                                                                          INTERNVL_TILES))  # fmt: skip
    settings = dict(size={"height": size, "width": size}, image_mean=mm.vision("image_mean"),
                    image_std=mm.vision("image_std"))  # fmt: skip
    image = _processor_component("GotOcr2ImageProcessor", crop_to_patches=True, min_patches=least, max_patches=most,
                                 **settings)  # fmt: skip
    return {"processor_class": "InternVLProcessor", "image_processor": image,
            "video_processor": _processor_component("InternVLVideoProcessor", **settings),
            "image_seq_length": config["image_seq_length"]}  # fmt: skip


def _pixtral_config(mm: Mmproj, text: PretrainedConfig, ids: dict[str, int], lm: dict[str, Any]) -> dict[str, Any]:
    width, heads = mm.vision("embedding_length"), mm.vision("attention.head_count")
    vision = {"model_type": "pixtral", "hidden_size": width, "intermediate_size": mm.shape("v.blk.0.ffn_up.weight")[0],
              "num_hidden_layers": mm.block_count(), "num_attention_heads": heads, "head_dim": width // heads,
              "image_size": mm.vision("image_size"), "patch_size": mm.vision("patch_size"),
              "hidden_act": _activation(mm, "gelu"), "num_channels": 3}  # fmt: skip
    return {"model_type": "mistral3", "text_config": _text_config(text, text.model_type), "vision_config": vision,
            "spatial_merge_size": int(mm.vision("spatial_merge_size", 1)), "image_token_index": ids["image_token"],
            "projector_hidden_act": "gelu", "vision_feature_layer": -1,
            "multimodal_projector_bias": "mm.1.bias" in mm.shapes}  # fmt: skip


def _pixtral_processor(mm: Mmproj, config: dict[str, Any]) -> dict[str, Any]:
    vision = config["vision_config"]
    patch = vision["patch_size"]
    image = _processor_component("PixtralImageProcessor", size={"longest_edge": vision["image_size"]},
                                 patch_size={"height": patch, "width": patch}, image_mean=mm.vision("image_mean"),
                                 image_std=mm.vision("image_std"))  # fmt: skip
    return {"processor_class": "PixtralProcessor", "image_processor": image, "patch_size": patch,
            "spatial_merge_size": config["spatial_merge_size"], "image_token": "[IMG]",
            "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}  # fmt: skip


FAMILIES: dict[str, Family] = {
    "qwen2vl_merger": Family(
        "Qwen2VLForConditionalGeneration", ("qwen2vl",), _QWEN_TOKENS,
        lambda mm, text, ids, lm: _qwen_vl_config(mm, text, ids, lm, v25=False),
        lambda mm, config: _qwen_vl_processor(mm, config, v25=False),
        lambda mm: mm.shape("mm.2.weight")[0],
    ),
    "qwen2.5vl_merger": Family(
        "Qwen2_5_VLForConditionalGeneration", ("qwen2vl",), _QWEN_TOKENS,
        lambda mm, text, ids, lm: _qwen_vl_config(mm, text, ids, lm, v25=True),
        lambda mm, config: _qwen_vl_processor(mm, config, v25=True),
        lambda mm: mm.shape("mm.2.weight")[0],
    ),
    "gemma3": Family(
        "Gemma3ForConditionalGeneration", ("gemma3",),
        {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
        _gemma3_config, _gemma3_processor, lambda mm: mm.shape("mm.input_projection.weight")[1],
    ),
    "idefics3": Family(
        "Idefics3ForConditionalGeneration", ("llama",),
        {"image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
         "global_image_token": "<global-img>"},
        _idefics3_config, _idefics3_processor, lambda mm: mm.shape("mm.model.fc.weight")[0],
    ),
    "internvl": Family(
        "InternVLForConditionalGeneration", ("qwen2", "llama", "qwen3"),
        {"context_image_token": "<IMG_CONTEXT>", "start_image_token": "<img>", "end_image_token": "</img>"},
        _internvl_config, _internvl_processor, lambda mm: mm.shape("mm.model.mlp.3.weight")[0],
        {"video_token": "<video>"},
    ),
    "pixtral": Family(
        "Mistral3ForConditionalGeneration", ("mistral3", "llama"),
        {"image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"},
        _pixtral_config, _pixtral_processor, lambda mm: mm.shape("mm.2.weight")[0],
    ),
    "mlp": Family(
        "LlavaForConditionalGeneration", ("llama", "qwen2", "mistral"), {"image_token": "<image>"},
        _llava_config, _llava_processor, lambda mm: mm.shape("mm.2.weight")[0],
    ),
}  # fmt: skip
ARCHITECTURES = {"smolvlm": "SmolVLMForConditionalGeneration", "llava_next": "LlavaNextForConditionalGeneration"}
"""The architecture of a config whose model type its projector type does not fix alone."""
