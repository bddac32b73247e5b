"""A llama.cpp vision-model pair (``model.gguf`` + ``mmproj.gguf``) as the Hugging Face model it was converted
from: its config, the processor configuration the files imply, and the tokens the processor names.

The language-model file gives the text config (`gguf_file.load_gguf_config`) and the tokenizer; the mmproj
(`gguf_mmproj.read_mmproj`) gives the vision tower's and projector's sizes; `gguf_vlm_families.FAMILIES` maps
each projector type onto the transformers architecture Tessera runs and its config and processor. The processor
configuration is written, with the file's chat template, into a small folder (`processor_folder`) that
`AutoProcessor.from_pretrained` reads as it reads a model folder; the weights stay in the two files.

A pair is checked as llama.cpp checks it: the projector's output width must be the language model's width
(else the mmproj belongs to another model), and the language model must be of the architecture the projector
type goes with.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Union

from transformers import PretrainedConfig

from .gguf_file import load_gguf_config, load_gguf_tokenizer, read_gguf_metadata, read_gguf_values
from .gguf_mmproj import Mmproj, read_mmproj
from .gguf_vlm_families import ARCHITECTURES, FAMILIES, Family


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
    tokens = {token: i for i, token in enumerate(read_gguf_metadata(lm_path).tokens)}
    ids, missing = {}, []
    for name, token in family.tokens.items():
        if token in tokens:
            ids[name] = tokens[token]
        else:
            missing.append(token)
    if missing:
        raise ValueError(
            f"The language model {lm_path} has no {', '.join(missing)} token, which a {mm.projector_type!r} "
            f"model's HF processor writes into prompts: check that the mmproj {mm.path} is this model's; a model "
            "converted from a checkpoint whose vocabulary lacks it (the original LLaVA-1.5 weights, not llava-hf's) "
            "cannot run here."
        )
    return ids


def named_tokens(lm_path: Union[str, Path], mmproj_path: Union[str, Path]) -> dict[str, str]:
    """The model-specific tokens the pair's processor reads off the tokenizer by name (the optional ones where the
    language model's vocabulary has them)."""
    family = read_pair_mmproj(mmproj_path)[1]
    vocabulary = set(read_gguf_metadata(lm_path).tokens)
    return {**family.tokens, **{k: t for k, t in family.optional_tokens.items() if t in vocabulary}}


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
    cache = Path(os.environ.get("TESSERA_CACHE_DIR") or Path.home() / ".cache" / "tessera")
    folder = cache / "gguf-vlm" / key.hexdigest()[:16]
    if (folder / "config.json").is_file():
        return folder
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
    except OSError:  # no writable home (a container's read-only one): this user's folder in the temporary directory
        folder = Path(tempfile.gettempdir()) / f"tessera-{os.getuid()}" / "gguf-vlm" / folder.name
        if (folder / "config.json").is_file():
            return folder
        folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".writing-", dir=folder.parent))
    load_gguf_tokenizer(lm_path, **named_tokens(lm_path, mmproj_path)).save_pretrained(staging)  # loaded, then ours
    for name, text in files.items():
        (staging / name).write_text(text)
    try:
        staging.rename(folder)  # whole or not at all: a concurrent first use finds the other's folder
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return folder
