"""llama.cpp's ``mmproj`` GGUF files: a vision tower and projector, written by `convert_hf_to_gguf.py --mmproj`
(or, for LLaVA, llama.cpp's older `convert_image_encoder_to_gguf.py`), served beside a language-model GGUF
(``llama-server -m model.gguf --mmproj mmproj.gguf``).

`read_mmproj` reads one and checks it is one: ``general.architecture`` "clip", a vision encoder, a projector
type Tessera maps (`tessera.gguf_vlm`). Every error names the file and what is wrong with it.

What such a file holds (llama.cpp's `tools/mtmd/clip-impl.h` and gguf-py's `constants.py`):
* ``clip.projector_type`` (``clip.vision.projector_type`` in files with several modalities): the family,
  e.g. "qwen2vl_merger", "gemma3", "idefics3", "mlp" (LLaVA). The older LLaVA files have none and say
  ``clip.has_llava_projector`` instead.
* ``clip.vision.*``: image_size, patch_size, embedding_length (tower width), feed_forward_length,
  block_count, attention.head_count, attention.layer_norm_epsilon, image_mean / image_std, projection_dim
  (the language model's width, for the files the current converter writes), and per family
  spatial_merge_size, projector.scale_factor, n_wa_pattern, preproc_image_size, image_grid_pinpoints...
* ``clip.use_gelu`` / ``clip.use_silu``: the tower's activation (neither: quick GELU).
* tensors ``v.*`` (the tower: ``v.blk.N.attn_q``...) and ``mm.*`` (the projector).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from .gguf_reading import gguf_reader, metadata_values

LEGACY_LLAVA_PROJECTOR = "mlp"
"""The projector type of the older LLaVA files, which name none (``clip.has_llava_projector``)."""

_REQUIRED = object()


@dataclass(frozen=True)
class Mmproj:
    """An mmproj file's metadata and tensor shapes (torch order: outermost first)."""

    path: Path
    values: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]
    types: dict[str, str]
    """GGML type name of each tensor ("F16", "Q8_0"...)."""

    @property
    def projector_type(self) -> str:
        kind = self.values.get("clip.projector_type") or self.values.get("clip.vision.projector_type")
        if not kind and self.values.get("clip.has_llava_projector"):
            return LEGACY_LLAVA_PROJECTOR
        return str(kind or "")

    @property
    def name(self) -> str:
        return str(self.values.get("general.name") or self.values.get("general.basename") or "")

    def vision(self, key: str, default: Any = _REQUIRED) -> Any:
        """``clip.vision.<key>``; without a default, a missing key is an error naming the file."""
        value = self.values.get(f"clip.vision.{key}", default)
        if value is _REQUIRED:
            raise ValueError(f"The mmproj file {self.path} lacks clip.vision.{key}; the file is incomplete.")
        return value

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.shapes:
            raise ValueError(
                f"The mmproj file {self.path} has no tensor {name!r}, which a {self.projector_type!r} projector has; "
                "the file is incomplete or of another layout."
            )
        return self.shapes[name]

    def block_count(self) -> int:
        return int(self.vision("block_count"))


def read_mmproj(path: Union[str, Path], supported: tuple[str, ...]) -> Mmproj:
    """The mmproj file at `path`, checked: a readable GGUF file, a vision projector ("clip" architecture) with a
    vision encoder, and a projector type in `supported` (read once per file version)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"The mmproj file {path} does not exist.")
    stat = path.stat()
    return _read_mmproj(path, stat.st_size, stat.st_mtime_ns, supported)


@functools.lru_cache(maxsize=8)
def _read_mmproj(path: Path, size: int, mtime_ns: int, supported: tuple[str, ...]) -> Mmproj:
    reader = gguf_reader(path)
    values = metadata_values(reader)
    architecture = values.get("general.architecture")
    if architecture != "clip":
        raise ValueError(
            f"{path} is not an mmproj file: its general.architecture is {architecture!r}, not 'clip'. Pass the "
            "model's GGUF as the model and its vision projector file (mmproj-*.gguf) as mmproj."
        )
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    mmproj = Mmproj(path, values, shapes, types)
    if values.get("clip.has_vision_encoder") is False or not any(name.startswith("v.") for name in shapes):
        raise ValueError(f"The mmproj file {path} has no vision encoder (an audio-only projector?); Tessera reads "
                         "images through an mmproj's vision tower.")  # fmt: skip
    if mmproj.projector_type not in supported:
        raise ValueError(
            f"The mmproj file {path} has projector type {mmproj.projector_type!r}, which Tessera does not map onto "
            f"a model; supported: {', '.join(supported)}."
        )
    return mmproj
