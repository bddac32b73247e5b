"""A llama.cpp vision-model pair (``model.gguf`` + ``mmproj.gguf``) as the Hugging Face model it was converted
from: its config, the processor configuration the files imply, and the tokens the processor names.

The language-model file gives the text config (`gguf_file.load_gguf_config`) and the tokenizer; the mmproj
(`gguf_mmproj.read_mmproj`) gives the vision tower's and projector's sizes; `FAMILIES` maps each projector
type onto the transformers architecture Tessera runs, and fills in what neither file says from the released
checkpoints' own configs (Qwen2-VL's pixel range, Qwen2.5-VL's 112-pixel windows...). The processor
configuration is written, with the file's chat template, into a small folder (`processor_folder`) that
`AutoProcessor.from_pretrained` reads as it reads a model folder; the weights stay in the two files.

A pair is checked as llama.cpp checks it: the projector's output width must be the language model's width
(else the mmproj belongs to another model), and the language model must be of the architecture the projector
type goes with.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Union

from transformers import PretrainedConfig

from .gguf_file import load_gguf_config, load_gguf_tokenizer, read_gguf_metadata, read_gguf_values
from .gguf_mmproj import Mmproj, read_mmproj

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
        vision.update(embed_dim=width, hidden_size=mm.vision("projection_dim"), mlp_ratio=ffn // width if ffn % width == 0 else ffn / width,
                      hidden_act=_activation(mm, "gelu"), model_type="qwen2_vl_vision")  # fmt: skip
    rope = dict(text.rope_parameters or {}, mrope_section=list(sections[:3]))
    model_type = "qwen2_5_vl" if v25 else "qwen2_vl"
    return {"model_type": model_type, "text_config": _text_config(text, model_type + "_text", rope_parameters=rope),
            "vision_config": vision, "image_token_id": ids["image_token"], "video_token_id": ids["video_token"],
            "vision_start_token_id": ids["vision_start_token"], "vision_end_token_id": ids["vision_end_token"]}  # fmt: skip


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
            "scale_factor": int(mm.vision("projector.scale_factor", 2)), "image_token_id": ids["image_token"]}  # fmt: skip


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
        config.update(model_type="llava_next", image_grid_pinpoints=[list(p) for p in zip(pinpoints[::2], pinpoints[1::2])])
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
    "mlp": Family(
        "LlavaForConditionalGeneration", ("llama", "qwen2", "mistral"), {"image_token": "<image>"},
        _llava_config, _llava_processor, lambda mm: mm.shape("mm.2.weight")[0],
    ),
}  # fmt: skip
ARCHITECTURES = {"smolvlm": "SmolVLMForConditionalGeneration", "llava_next": "LlavaNextForConditionalGeneration"}
"""The architecture of a config whose model type its projector type does not fix alone."""


def supported_projectors() -> tuple[str, ...]:
    return tuple(FAMILIES)


# ---- the pair ----------------------------------------------------------------------------------------------


def read_pair_mmproj(mmproj_path: Union[str, Path]) -> tuple[Mmproj, Family]:
    mm = read_mmproj(mmproj_path, supported_projectors())
    return mm, FAMILIES[mm.projector_type]


def load_gguf_vlm_config(lm_path: Union[str, Path], mmproj_path: Union[str, Path]) -> PretrainedConfig:
    """The transformers config of the VLM that the language-model GGUF at `lm_path` and the mmproj at
    `mmproj_path` were converted from; errors name the file and what does not fit."""
    from transformers import AutoConfig

    mm, family = read_pair_mmproj(mmproj_path)
    lm_architecture = read_gguf_metadata(lm_path).architecture
    if lm_architecture == "clip":
        raise ValueError(f"{lm_path} is an mmproj file (a vision projector), not a language model: pass the model's "
                         f"GGUF as the model and {Path(lm_path).name} as mmproj.")  # fmt: skip
    if lm_architecture not in family.language_models:
        raise ValueError(
            f"The mmproj file {mm.path} ({mm.projector_type!r} projector) goes with a "
            f"{' or '.join(family.language_models)} language model, but {lm_path} is a {lm_architecture!r} model; "
            "pass the mmproj file published with this model."
        )
    text = load_gguf_config(lm_path)
    width = family.projector_width(mm)
    if width != text.hidden_size:
        raise ValueError(
            f"The mmproj file {mm.path} does not belong to {lm_path}: its projector gives {width}-wide embeddings "
            f"and the language model is {text.hidden_size} wide (a mismatched pair); pass the mmproj file published "
            "with this model."
        )
    ids = vocabulary_ids(lm_path, family, mm)
    config = family.config(mm, text, ids, read_gguf_values(lm_path))
    architecture = ARCHITECTURES.get(config["model_type"], family.architecture)
    config.update(architectures=[architecture], tie_word_embeddings=text.tie_word_embeddings)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        config.setdefault(key, getattr(text, key, None))
    model_type = config.pop("model_type")
    return AutoConfig.for_model(model_type, **config)


def vocabulary_ids(lm_path: Union[str, Path], family: Family, mm: Mmproj) -> dict[str, int]:
    """The ids of the tokens `family` needs, from the language model's vocabulary."""
    tokens = _reader_tokens(str(lm_path))
    ids, missing = {}, []
    for name, token in family.tokens.items():
        if token in tokens:
            ids[name] = tokens[token]
        else:
            missing.append(token)
    if missing:
        raise ValueError(
            f"The language model {lm_path} has no {', '.join(missing)} token, which a {mm.projector_type!r} "
            f"model's prompts need (the mmproj {mm.path} is of another model?)."
        )
    return ids


def _reader_tokens(path: str) -> dict[str, int]:
    from .gguf_file import _reader

    field = _reader(path).fields.get("tokenizer.ggml.tokens")
    if field is None:
        return {}
    return {bytes(field.parts[i]).decode("utf-8", "replace"): n for n, i in enumerate(field.data)}


def named_tokens(mmproj_path: Union[str, Path]) -> dict[str, str]:
    """The model-specific tokens the pair's processor reads off the tokenizer by name."""
    return dict(read_pair_mmproj(mmproj_path)[1].tokens)


def processor_folder(config: PretrainedConfig, lm_path: Union[str, Path], mmproj_path: Union[str, Path],
                     chat_template: str | None) -> Path:  # fmt: skip
    """A folder with the pair's config.json, processor_config.json, chat template and tokenizer files (the
    language model's), which `AutoProcessor.from_pretrained` reads as a model folder; the weights stay in the GGUF
    files. Named by a hash of its contents and the language model file, so the same pair reuses it."""
    mm, family = read_pair_mmproj(mmproj_path)
    files = {
        "processor_config.json": json.dumps(family.processor(mm, config.to_dict()), indent=2, sort_keys=True),
        "config.json": config.to_json_string(use_diff=False),
    }
    if chat_template:
        files["chat_template.jinja"] = chat_template
    stat = Path(lm_path).stat()
    key = hashlib.sha256(json.dumps([files, str(Path(lm_path).resolve()), stat.st_size, stat.st_mtime_ns]).encode())
    folder = Path(tempfile.gettempdir()) / "tessera-gguf-vlm" / key.hexdigest()[:16]
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".writing-", dir=folder.parent))
    load_gguf_tokenizer(lm_path, **family.tokens).save_pretrained(staging)  # what the processor loads beside ours
    for name, text in files.items():
        (staging / name).write_text(text)
    try:
        staging.rename(folder)  # whole or not at all: a concurrent first use finds the other's folder
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return folder
