"""What tests, benchmarks and examples share: tiny Hugging Face-format checkpoints built offline,
seeded inputs, and helpers for a server under test. It lives beside the package, not in it (`pip install`
ships `tessera` only); tests, benchmarks and examples import it from the repository root."""

from .checkpoints import (
    build_llava_15_shaped_processor_folder,
    build_tiny_fuyu,
    build_tiny_llava,
    build_tiny_text_model,
)
from .gguf import build_tiny_gguf
from .inputs import IMAGE_SIZES, LLAVA_PROMPTS, png_bytes, random_images, random_video
from .tokenizer import CHATML_TEMPLATE, build_tokenizer
from .tool_calling import build_tiny_qwen2_tools
from .video import VIDEO_COLORS, video_bytes, video_frame

__all__ = [
    "CHATML_TEMPLATE",
    "IMAGE_SIZES",
    "LLAVA_PROMPTS",
    "VIDEO_COLORS",
    "build_llava_15_shaped_processor_folder",
    "build_tiny_fuyu",
    "build_tiny_gguf",
    "build_tiny_llava",
    "build_tiny_qwen2_tools",
    "build_tiny_text_model",
    "build_tokenizer",
    "png_bytes",
    "random_images",
    "random_video",
    "video_bytes",
    "video_frame",
]
