"""Tiny GGUF vision-model pairs (``model.gguf`` + ``mmproj.gguf``) made as users' files are made: from a tiny
random HF checkpoint of the testkit, by llama.cpp's own converter (`llama_cpp_convert`), language model and
``--mmproj``. LLaVA-1.5 / NeXT mmprojs come from llama.cpp's older `convert_image_encoder_to_gguf.py`, which
no longer runs under transformers 5 (it calls `CLIPVisionModel.vision_model`); `write_legacy_llava_mmproj`
writes what it writes (names, dtypes, the dropped last layer and post-layernorm, the swapped fc1 / fc2) with
the gguf package.

Before converting, each checkpoint is made what a released one looks like to the converter, and its weights are
rounded to float16 values (F16 files are then the checkpoint exactly; the F32 / F16 pair must answer as the
folder does, token for token):
* Gemma 3: the SigLIP tower under ``vision_tower.vision_model.`` (the hub's layout).
* Idefics3 / SmolVLM: ``text_config.architectures`` (the converter picks the language model's class by it).
* Qwen2.5-VL: 112-pixel attention windows, the size every released Qwen2.5-VL has and llama.cpp assumes (the
  mmproj does not carry it).
* Gemma 3: every 6th layer full attention, as released (the converter writes no pattern; llama.cpp assumes 6).
* InternVL: the tower and projector under ``model.`` with the converter's class for them named in the vision
  config (it registers OpenGVLab's remote-code layout by that name; the names map from transformers' too); its
  language model taken out as for LLaVA-NeXT.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from .llama_cpp_convert import convert_to_gguf


def _edit_config(folder: Path, edit: Callable[[dict], None]) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config, indent=2))


def prepare_for_conversion(folder: Path, kind: str) -> Path:
    """Round the checkpoint's weights to float16 values and give it the released layout the converter expects."""
    path = folder / "model.safetensors"
    tensors = {name: tensor.to(torch.float16).to(tensor.dtype) for name, tensor in load_file(path).items()}
    if kind == "gemma3":
        hub, saved = "vision_tower.vision_model.", "vision_tower."
        tensors = {(hub + n[len(saved) :] if n.startswith(saved) and not n.startswith(hub) else n): t
                   for n, t in tensors.items()}  # fmt: skip
    save_file(tensors, path, metadata={"format": "pt"})
    if kind in ("smolvlm", "idefics3"):
        _edit_config(folder, lambda c: c["text_config"].update(architectures=["LlamaForCausalLM"]))
    if kind == "qwen2_5_vl":
        _edit_config(folder, lambda c: c["vision_config"].update(window_size=112))
    if kind == "internvl":  # the hub's transformers layout (OpenGVLab/InternVL3-*-hf), which the converter maps
        tensors = {(f"model.{n}" if n.startswith(("vision_tower.", "multi_modal_projector.")) else n): t
                   for n, t in tensors.items()}  # fmt: skip
        save_file(tensors, path, metadata={"format": "pt"})
        _edit_config(folder, lambda c: c["vision_config"].update(architectures=["InternVisionModel"]))
    if kind == "gemma3":  # the converter writes no sliding-window pattern: llama.cpp takes every 6th layer full
        _edit_config(folder, lambda c: c["text_config"].update(
            layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                         for i in range(c["text_config"]["num_hidden_layers"])]))  # fmt: skip
    return folder


def write_legacy_llava_mmproj(folder: Path, out: Path, *, outtype: str = "f16") -> Path:
    """The mmproj llama.cpp's `convert_image_encoder_to_gguf.py --llava-projector` writes for the LLaVA(-NeXT)
    checkpoint in `folder`: the CLIP tower up to the feature layer, the two projector layers, no post-layernorm;
    matrices F16 (F32 with ``outtype="f32"``), vectors F32; ``image_newline`` for LLaVA-NeXT."""
    import gguf

    config = json.loads((folder / "config.json").read_text())
    vision = config["vision_config"]
    layers = vision["num_hidden_layers"]
    feature = config.get("vision_feature_layer", -2)
    feature_layers = [f if f >= 0 else layers + f + 1 for f in ([feature] if isinstance(feature, int) else feature)]
    blocks = max(feature_layers)
    writer = gguf.GGUFWriter(str(out), "clip")
    writer.add_bool("clip.has_text_encoder", False)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.has_llava_projector", True)
    writer.add_file_type(1 if outtype == "f16" else 0)
    writer.add_string("clip.projector_type", "mlp")
    writer.add_name(folder.name)
    writer.add_uint32("clip.vision.image_size", vision["image_size"])
    writer.add_uint32("clip.vision.patch_size", vision["patch_size"])
    writer.add_uint32("clip.vision.embedding_length", vision["hidden_size"])
    writer.add_uint32("clip.vision.feed_forward_length", vision["intermediate_size"])
    writer.add_uint32("clip.vision.projection_dim", vision.get("projection_dim", 512))
    writer.add_uint32("clip.vision.attention.head_count", vision["num_attention_heads"])
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", vision.get("layer_norm_eps", 1e-5))
    writer.add_uint32("clip.vision.block_count", blocks)
    if "image_grid_pinpoints" in config:
        flat = [n for pair in config["image_grid_pinpoints"] for n in pair]
        writer.add_array("clip.vision.image_grid_pinpoints", flat)
        writer.add_string("clip.vision.mm_patch_merge_type", "spatial_unpad")
    writer.add_array("clip.vision.feature_layer", feature_layers)
    processor = json.loads((folder / "processor_config.json").read_text())["image_processor"]
    writer.add_array("clip.vision.image_mean", processor["image_mean"])
    writer.add_array("clip.vision.image_std", processor["image_std"])
    writer.add_bool("clip.use_gelu", vision.get("hidden_act") == "gelu")
    for name, tensor in load_file(folder / "model.safetensors").items():
        target = _legacy_name(name, blocks)
        if target is None:
            continue
        data = tensor.squeeze().float().numpy()
        matrix = data.ndim in (2, 4) and outtype == "f16"
        writer.add_tensor(target, data.astype(np.float16 if matrix else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _legacy_name(name: str, blocks: int):
    """`convert_image_encoder_to_gguf.get_tensor_name` for a LLaVA checkpoint's vision side; None: not written."""
    if name.startswith("multi_modal_projector."):
        return name.replace("multi_modal_projector.linear_1", "mm.0").replace("multi_modal_projector.linear_2", "mm.2")
    if name == "image_newline":
        return "model.image_newline"
    if not name.startswith("vision_tower.vision_model."):
        return None
    name = name[len("vision_tower.") :]
    if "post_layernorm" in name or (".layers." in name and int(name.split(".layers.")[1].split(".")[0]) >= blocks):
        return None
    for old, new in (("vision_model", "v"), ("encoder.layers", "blk"), ("embeddings.", ""), ("_proj", ""),
                     ("self_attn.", "attn_"), ("layer_norm", "ln"), ("layernorm", "ln"), ("mlp.fc1", "ffn_down"),
                     ("mlp.fc2", "ffn_up"), ("embedding", "embd"), ("final", "post"), ("layrnorm", "ln")):  # fmt: skip
        name = name.replace(old, new)
    return name


def language_model_folder(folder: Path) -> Path:
    """llama.cpp's `llava_surgery_v2.py` for LLaVA-NeXT (and InternVL), whose language model the converter does not
    take from the VLM checkpoint: the language model alone, as a causal-LM folder beside it."""
    out = folder.with_name(folder.name + "-lm")
    out.mkdir(exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    text = config["text_config"]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    text["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[text["model_type"]]]
    (out / "config.json").write_text(json.dumps(text, indent=2))
    tensors = {}
    for name, tensor in load_file(folder / "model.safetensors").items():
        if name.startswith("language_model."):
            tensors[name[len("language_model.") :]] = tensor
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (folder / name).is_file():
            (out / name).write_bytes((folder / name).read_bytes())
    return out


def convert_pairs(jobs: list[tuple[Path, str, Path, tuple[str, ...]]]) -> None:
    """For each (prepared HF folder, kind, output folder, outtypes): ``lm-<type>.gguf`` and ``mmproj-<type>.gguf``
    in the output folder for every outtype, all converted in one run of llama.cpp's converter."""
    conversions = []
    for folder, kind, out, outtypes in jobs:
        out.mkdir(parents=True, exist_ok=True)
        for outtype in outtypes:
            text = language_model_folder(folder) if kind in ("llava_next", "internvl") else folder
            conversions.append((text, out / f"lm-{outtype}.gguf", outtype, False))
            if kind.startswith("llava"):
                write_legacy_llava_mmproj(folder, out / f"mmproj-{outtype}.gguf", outtype=outtype)
            else:
                conversions.append((folder, out / f"mmproj-{outtype}.gguf", outtype, True))
    convert_to_gguf(*conversions)
