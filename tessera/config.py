"""Configuration dataclasses, checked when built so that mistakes surface at start-up."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

import torch
from transformers import AutoConfig, PretrainedConfig

from .gguf_file import find_gguf_file, find_mmproj_file, gguf_quantization, load_gguf_config, read_gguf_metadata
from .gguf_vlm import load_gguf_vlm_config, processor_folder
from .plugins import plugin_option_names, resolve_plugin_options
from .pooling_params import PoolerConfig

POOLING_ARCHITECTURE_SUFFIXES = ("ForRetrieval", "ForEmbedding", "EmbeddingModel")  # runner="auto" pools these

logger = logging.getLogger(__name__)

DTYPE_NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}  # fmt: skip
"""The dtype names Tessera reads (lower case), for models and plugins' settings alike."""


def parse_dtype(value: "str | torch.dtype", what: str = "dtype") -> torch.dtype:
    if isinstance(value, torch.dtype) and value in DTYPE_NAMES.values():
        return value
    if isinstance(value, str) and value.lower() in DTYPE_NAMES:
        return DTYPE_NAMES[value.lower()]
    raise ValueError(f"Unsupported {what} {value!r}; use float32, bfloat16 or float16.")


QUANTIZATION_METHODS = ("int8", "int4")
"""Weight quantization applied at load (`tessera.layers.quantization`) to the language model's linear layers:
"int8" = int8 weights with a scale per group of 32 inputs of an output channel; "int4" = 4-bit weights with a
scale and zero per group of 32 inputs of an output channel."""


AUTO_QUANTIZATION = "auto"
"""`ModelConfig.quantization="auto"`: a GGUF file's quantized matrices keep the values of its blocks (Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K: `layers.gguf_blocks`) where the native kernels run, and the others are
quantized to the method that keeps them about as small as the file has them (`gguf_file.gguf_quantization`:
4-bit types -> "int4", 8-bit -> "int8", float -> none); other checkpoints are not quantized."""


def check_quantization(value: Optional[str], *, allow_auto: bool = False) -> Optional[str]:
    """None (no quantization) or a name of QUANTIZATION_METHODS (any case), or "auto" where `allow_auto`;
    anything else raises."""
    if value is None or (isinstance(value, str) and value.lower() in ("none", "")):
        return None
    if isinstance(value, str) and (value.lower() in QUANTIZATION_METHODS or allow_auto and value.lower() == "auto"):
        return value.lower()
    supported = ", ".join(QUANTIZATION_METHODS + ((AUTO_QUANTIZATION,) if allow_auto else ()))
    raise ValueError(f"Unsupported quantization {value!r}; supported: {supported} (or None).")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class MultiModalConfig:
    limit_per_prompt: dict[str, int] = field(default_factory=dict)
    """User limit on items per prompt, per modality (e.g. ``{"image": 4}``); the model's own limit
    applies too. Modalities not named here are limited only by the model."""

    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the HF processor, applied to every request (a request's own
    mm_processor_kwargs override them key by key). Each goes to the processor's constructor, its
    call, or both, as vLLM passes them (e.g. LLaVA's ``vision_feature_select_strategy``, Qwen-VL's
    ``max_pixels``); a key no part of the processor takes is refused at start-up, naming the options."""

    mm_processor_cache_gb: float = 1.0
    """Size of the processor-output cache in GiB; 0 disables it."""

    def __post_init__(self) -> None:
        kwargs = {} if self.mm_processor_kwargs is None else self.mm_processor_kwargs
        if not isinstance(kwargs, Mapping) or not all(isinstance(key, str) for key in kwargs):
            raise ValueError(f"mm_processor_kwargs must be a dict of keyword names to values, got {kwargs!r}")
        self.mm_processor_kwargs = dict(kwargs)  # a copy: the caller's dict may change later
        for modality, limit in self.limit_per_prompt.items():
            if not isinstance(limit, int) or limit < 0:
                raise ValueError(f"limit_mm_per_prompt[{modality!r}] must be an int >= 0, got {limit!r}")
        if self.mm_processor_cache_gb < 0:
            raise ValueError(f"mm_processor_cache_gb must be >= 0, got {self.mm_processor_cache_gb}")

    def get_limit_per_prompt(self, modality: str) -> Optional[int]:
        return self.limit_per_prompt.get(modality)


@dataclass(frozen=True)
class SpeechToTextConfig:
    """How a recording is cut for a speech-to-text model (vLLM's): the rate it hears, the longest window it
    takes in one prompt (None: any length), and where a longer recording is split: at the quietest
    `min_energy_split_window_size` samples within the last `overlap_chunk_second` seconds before each limit."""

    sample_rate: int = 16_000
    max_audio_clip_s: Optional[float] = 30.0
    overlap_chunk_second: float = 1.0
    min_energy_split_window_size: Optional[int] = 1600

    @property
    def allow_audio_chunking(self) -> bool:
        return self.min_energy_split_window_size is not None and self.max_audio_clip_s is not None


@dataclass
class ModelConfig:
    model: str
    """A local folder in Hugging Face format (config.json, weights, tokenizer and processor files),
    or a GGUF file (llama.cpp's format: a ``.gguf`` file, or a folder with no config.json that holds
    exactly one); see `tessera.gguf_file`."""

    tokenizer: Optional[str] = None
    """Folder of the tokenizer (or GGUF file), if not the model's."""

    mmproj: Optional[str] = None
    """With a GGUF `model`: llama.cpp's vision projector file for it (``mmproj-*.gguf``, as ``llama-server
    --mmproj``), making the pair the vision model they were converted from (`tessera.gguf_vlm`). A model folder
    holding one GGUF model and one ``mmproj*.gguf`` pairs them without it."""

    trust_remote_code: bool = False
    multimodal_config: MultiModalConfig = field(default_factory=MultiModalConfig)

    dtype: "str | torch.dtype" = "auto"
    """Language model dtype; "auto" takes config.json's dtype (float32 if absent)."""

    device: Optional[str] = "auto"
    """Device of the language model ("cpu", "cuda", "cuda:1"...); "auto" (or None): cuda if
    available, else cpu."""

    vision_dtype: "Optional[str | torch.dtype]" = None
    """Dtype of the vision tower; None: the language model's."""

    vision_device: Optional[str] = None
    projector_dtype: "Optional[str | torch.dtype]" = None
    """Dtype of the multimodal projector; None: the language model's."""

    projector_device: Optional[str] = None
    quantization: Optional[str] = None
    """Weight quantization at load, one of QUANTIZATION_METHODS ("int8": the language model's linear
    layers, lm_head included, get int8 weights with a scale per group of 32 inputs; "int4": 4-bit weights with
    a scale and zero per group of 32 inputs; the vision tower and projector keep their dtype); "auto": for a
    GGUF file, its quantized blocks as they are where the native kernels run, else the method that keeps its
    matrices about as small as the file has them (AUTO_QUANTIZATION), None otherwise; None: the checkpoint's
    weights in `dtype`."""

    allow_pickle: bool = False
    """Load .bin/.pt weights (pickle, which can run code) when there are no .safetensors."""

    hf_overrides: "Optional[dict[str, Any] | Callable[[PretrainedConfig], PretrainedConfig]]" = None
    """Changes to the model's config.json as read, as vLLM's `hf_overrides`: a dict sets each key (a dict value
    for a nested config, such as `text_config`, updates it key by key), a function returns the changed config.
    E.g. {"architectures": ["MyModelForCausalLM"]} runs a folder with a model class registered out of tree."""

    max_loras: int = 4
    """LoRA adapters held at once (`LLM.generate(..., lora_request=...)`); each is loaded on first use, the least
    recently used idle one unloaded to make room."""

    runner: str = "auto"
    """"generate" (text) or "pooling" (embeddings: `LLM.embed`, `/v1/embeddings`, scores), as vLLM's `runner`;
    "auto": pooling for retrieval and embedding architectures (`*ForRetrieval`, `*ForEmbedding`), else generate."""

    pooler_config: "Optional[PoolerConfig | dict[str, Any]]" = None
    """With runner="pooling", how the final hidden states are pooled (a dict is converted); None: the model class's
    own (ColQwen2: every token), else as the folder's sentence-transformers modules.json says, else the last
    token's, normalized (`pooling_params.PoolerConfig`)."""

    hf_config: PretrainedConfig = field(init=False)

    gguf_file: Optional[str] = field(init=False, default=None)
    """The GGUF file the model is read from, when `model` names one; None for a Hugging Face folder."""

    processor_folder: Optional[str] = field(init=False, default=None)
    """Where the HF processor is read from: the model folder, or for a GGUF pair a folder holding the processor
    configuration the pair implies (`gguf_vlm.processor_folder`)."""

    keep_gguf_blocks: bool = field(init=False, default=False)
    """quantization="auto" on a GGUF file: its quantized matrices keep their blocks' values where the native
    kernels run them (`layers.gguf_blocks`); the rest is quantized by `quantization`."""

    def __post_init__(self) -> None:
        folder = Path(self.model)
        gguf_file = find_gguf_file(folder)
        if gguf_file is None and not (folder / "config.json").is_file():
            raise ValueError(
                f"Model folder {self.model!r} has no config.json; pass a local folder in Hugging Face "
                "format (config.json + *.safetensors + tokenizer/processor files) or a .gguf file."
            )
        self.model = str(folder)
        self.tokenizer = self.tokenizer or self.model
        self.processor_folder = self.model
        if self.mmproj is None and gguf_file is not None:
            self.mmproj = find_mmproj_file(folder)  # a folder holding the model's GGUF and its mmproj
        if self.mmproj is not None and gguf_file is None:
            raise ValueError(
                f"mmproj is llama.cpp's vision projector for a GGUF model; {self.model} is not a GGUF file."
            )
        if self.mmproj is not None:
            self.mmproj = str(Path(self.mmproj))
            self.gguf_file = str(gguf_file)
            self.hf_config = load_gguf_vlm_config(gguf_file, self.mmproj)
            template = read_gguf_metadata(gguf_file).chat_template
            self.processor_folder = str(processor_folder(self.hf_config, gguf_file, self.mmproj, template))
        elif gguf_file is not None:
            self.gguf_file = str(gguf_file)
            self.hf_config = load_gguf_config(gguf_file, trust_remote_code=self.trust_remote_code)
        else:
            self.hf_config = AutoConfig.from_pretrained(self.model, trust_remote_code=self.trust_remote_code)
        if self.hf_overrides is not None:
            self.hf_config = apply_hf_overrides(self.hf_config, self.hf_overrides)
        if self.dtype == "auto":
            self.dtype = getattr(self.hf_config, "dtype", None) or torch.float32
        self.dtype = parse_dtype(self.dtype)
        self.quantization = check_quantization(self.quantization, allow_auto=True)
        file_quantization = gguf_quantization(gguf_file) if gguf_file is not None else None
        if self.quantization == AUTO_QUANTIZATION:
            self.quantization = file_quantization
            self.keep_gguf_blocks = file_quantization is not None
            logger.info("quantization='auto': %s", self.quantization or "none (dense weights)")
        elif self.quantization is None and file_quantization is not None:
            logger.info(
                "The GGUF file's weights are de-quantized to %s; quantization='auto' keeps them %s (less memory, "
                "faster decode with dtype='bfloat16')", self.dtype, file_quantization,
            )  # fmt: skip
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner must be 'auto', 'generate' or 'pooling'; got {self.runner!r}")
        if self.runner == "auto":
            pooling = any(a.endswith(POOLING_ARCHITECTURE_SUFFIXES) for a in self.architectures)
            self.runner = "pooling" if pooling else "generate"
        if isinstance(self.pooler_config, Mapping):
            self.pooler_config = PoolerConfig(**self.pooler_config)
        if self.pooler_config is not None and self.runner != "pooling":
            raise ValueError("pooler_config is for runner='pooling'")
        self.vision_dtype = parse_dtype(self.vision_dtype or self.dtype, "vision_dtype")
        self.projector_dtype = parse_dtype(self.projector_dtype or self.dtype, "projector_dtype")
        self.device = default_device() if self.device in (None, "auto") else self.device
        self.vision_device = self.device if self.vision_device in (None, "auto") else self.vision_device
        self.projector_device = self.device if self.projector_device in (None, "auto") else self.projector_device

    @property
    def architectures(self) -> list[str]:
        return list(getattr(self.hf_config, "architectures", None) or [])


def apply_hf_overrides(config: PretrainedConfig, overrides: Any) -> PretrainedConfig:
    """`config` changed by `overrides` (see ModelConfig.hf_overrides)."""
    if callable(overrides):
        return overrides(config)
    if not isinstance(overrides, Mapping) or not all(isinstance(key, str) for key in overrides):
        raise ValueError(f"hf_overrides must be a dict of config.json keys to values, or a function; got {overrides!r}")
    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, Mapping) and isinstance(current, PretrainedConfig):
            apply_hf_overrides(current, value)  # a nested config, updated key by key
        else:
            setattr(config, key, value)
    return config


_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def parse_bytes(value: "int | str") -> int:
    """ "2GiB", "512MiB", "1.5GB" or a number of bytes."""
    if isinstance(value, int):
        return value
    text = str(value).strip().lower().replace(" ", "")
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(number) :]
    if unit not in _UNITS or not number:
        raise ValueError(f"Cannot read {value!r} as a size; write e.g. '2GiB', '512MiB' or a number of bytes.")
    return int(float(number) * _UNITS[unit])


@dataclass
class CacheConfig:
    block_size: int = 16
    """Tokens per KV-cache block."""

    kv_cache_memory: "int | str" = "1GiB"
    """Memory for the KV cache; the number of blocks follows from it."""

    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prefixes (tokens and images)."""

    encoder_cache_size: Optional[int] = None
    """Vision-encoder outputs kept, in embedding rows; None: enough for the largest prompt's items."""

    free_out_of_window_blocks: bool = True
    """When every attention layer has a sliding window (W the largest), release a running sequence's
    blocks that lie wholly before its last W tokens: no later query sees them, so more sequences fit
    in the cache (a cached block stays reusable by prefix caching). No effect on models with any
    full-attention layer. Off: every sequence keeps all its blocks until it ends (for comparison)."""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prompt chunks + decode tokens)."""

    max_num_seqs: int = 64
    """Sequences running at once."""

    max_model_len: Optional[int] = None
    """Longest prompt + output; None: the model's max_position_embeddings."""

    max_num_encoder_input_tokens: Optional[int] = None
    """Vision-encoder budget of one step, in embedding rows; None: max_num_batched_tokens (or the
    largest item, if larger)."""

    disable_chunked_mm_input: bool = False
    """Never split an item across prefill chunks (a chunk stops before an item that does not fit
    whole). Always on for models whose item tokens attend to each other both ways (Gemma 3)."""

    whole_item_modalities: Optional[tuple[str, ...]] = None
    """With disable_chunked_mm_input, the modalities kept whole (None: all). Set by the engine for a model
    whose items of some modalities only attend both ways (Gemma 4: images and videos, not audio)."""

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    """Ranks the language model is split over (attention heads, MLP channels, vocabulary, KV cache): this
    process is rank 0 and runs the scheduler and the vision encoder; the others are worker processes."""

    distributed_executor_backend: Optional[str] = None
    """Where the other ranks run: "mp" (local processes, the default) or "ray" (Ray actors, on any node of
    the Ray cluster this process is connected to; needs `pip install tessera[ray]`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            choices = ", ".join(DISTRIBUTED_EXECUTOR_BACKENDS)
            raise ValueError(f"Unsupported distributed_executor_backend {backend!r}; use one of {choices}")
        self.distributed_executor_backend = backend or "mp"


_ENGINE_CONFIGS = (ModelConfig, CacheConfig, SchedulerConfig, MultiModalConfig, ParallelConfig)
_RENAMES = {"limit_mm_per_prompt": "limit_per_prompt"}


def engine_configs(model: str, **options: Any) -> tuple[ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig]:
    """The configurations of an engine for a model folder (or GGUF file); options are fields of ModelConfig,
    CacheConfig, SchedulerConfig, ParallelConfig and MultiModalConfig (limit_mm_per_prompt is
    MultiModalConfig.limit_per_prompt), and the options plugins add (`tessera.plugins`). An unknown option
    raises ValueError."""
    groups: dict[type, dict[str, Any]] = {c: {} for c in _ENGINE_CONFIGS}
    settable = {c: {f.name for f in fields(c) if f.init} for c in _ENGINE_CONFIGS}  # not hf_config, gguf_file
    for name, value in resolve_plugin_options(options).items():
        name = _RENAMES.get(name, name)
        owner = next((c for c in groups if name in settable[c]), None)
        if owner is None:
            raise ValueError(f"Unknown LLM option {name!r}")
        groups[owner][name] = value
    mm_config = MultiModalConfig(**groups[MultiModalConfig])
    model_config = ModelConfig(model, multimodal_config=mm_config, **groups[ModelConfig])
    return (
        model_config,
        CacheConfig(**groups[CacheConfig]),
        SchedulerConfig(**groups[SchedulerConfig]),
        ParallelConfig(**groups[ParallelConfig]),
    )


def engine_option_names() -> set[str]:
    """Every option `engine_configs` takes (the plugins' included)."""
    names = {f.name for c in _ENGINE_CONFIGS for f in fields(c) if f.init} - {"multimodal_config"}
    return names | set(_RENAMES) | plugin_option_names()
