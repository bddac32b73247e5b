"""llama.cpp's own converter (`convert_hf_to_gguf.py`, and its `--mmproj` mode) run on tiny HF checkpoints, so
the tests' GGUF pairs are made the way users' files are.

The converter is not on PyPI as a package: it comes from the llama.cpp sources that the llama-cpp-python sdist
vendors (the version of the `bench` extra). `converter_sources()` downloads that sdist once with pip (source
only, no wheel) and unpacks the converter (`convert_hf_to_gguf.py`, its `conversion/` package and the `gguf-py`
it imports, newer than the gguf release on PyPI) into a cache folder. The conversions run in one child process
(`convert_to_gguf`), so the vendored gguf never meets the installed one that Tessera reads files with.

Three harness patches, none of which changes a tensor or a metadata value the mmproj or the model's layers get:
* The tiny tokenizers' pre-tokenizer hash is not one llama.cpp knows ("BPE pre-tokenizer was not recognized"):
  the name is given instead (`tokenizer.ggml.pre`, which only llama.cpp's own tokenizer reads).
* sentencepiece is not installed: the converters that try a `tokenizer.model` first get the FileNotFoundError
  they expect when there is none, instead of an ImportError.
* The mmproj tensor-name map is built for the vision tower's depth, so a projector layer numbered past a tiny
  tower's last block (Qwen2-VL's `merger.mlp.2` with 2 blocks) finds no name: the map is built for at least 8.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tarfile
import threading
from pathlib import Path
from typing import Union

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
CACHE = Path(os.environ.get("TESSERA_CACHE_DIR") or Path.home() / ".cache" / "tessera") / "llama.cpp-converter-0.3.36"
VENDORED = "vendor/llama.cpp/"
_lock = threading.Lock()


def converter_sources() -> Path:
    """The folder holding `convert_hf_to_gguf.py` and `conversion/` (downloaded and unpacked on first use)."""
    with _lock:
        if (CACHE / "convert_hf_to_gguf.py").is_file():
            return CACHE
        download = CACHE.with_name(CACHE.name + ".download")
        download.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        LLAMA_CPP_PYTHON, "-d", str(download)], check=True)  # fmt: skip
        (sdist,) = download.glob("llama_cpp_python-*.tar.gz")
        staging = CACHE.with_name(CACHE.name + ".staging")
        staging.mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                inner = member.name.partition("/")[2]
                if member.isfile() and inner.startswith(VENDORED):
                    path = inner[len(VENDORED) :]
                    if path == "convert_hf_to_gguf.py" or path.startswith(("conversion/", "gguf-py/gguf/")):
                        target = staging / path
                        target.parent.mkdir(parents=True, exist_ok=True)
                        target.write_bytes(tar.extractfile(member).read())
        staging.rename(CACHE)
        for leftover in download.iterdir():
            leftover.unlink()
        download.rmdir()
        return CACHE


def _patch(conversion_base) -> None:
    import gguf

    conversion_base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
    original_sentencepiece = conversion_base.TextModel._create_vocab_sentencepiece

    def sentencepiece(self):
        if not (self.dir_model / "tokenizer.model").is_file():
            raise FileNotFoundError(f"File not found: {self.dir_model / 'tokenizer.model'}")
        return original_sentencepiece(self)

    conversion_base.TextModel._create_vocab_sentencepiece = sentencepiece
    name_map = gguf.get_tensor_name_map

    def deep_enough_map(arch, n_blocks):
        return name_map(arch, max(n_blocks, 8) if arch == gguf.MODEL_ARCH.MMPROJ else n_blocks)

    conversion_base.gguf.get_tensor_name_map = deep_enough_map


def convert_to_gguf(*jobs: tuple[Union[str, Path], Union[str, Path], str, bool]) -> list[Path]:
    """Run the converter on HF checkpoints, each job (folder, out, outtype, mmproj): the language model (or with
    `mmproj`, the vision tower and projector) of `folder` written to `out` as outtype "f32", "f16" or "q8_0"."""
    sources = converter_sources()
    listing = json.dumps([[str(folder), str(out), outtype, bool(mmproj)] for folder, out, outtype, mmproj in jobs])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(sources), str(sources / "gguf-py")])}
    run = f"import runpy; runpy.run_path({__file__!r}, run_name='__main__')"  # not `python FILE`: testkit/ off sys.path
    result = subprocess.run([sys.executable, "-c", run, listing], env=env, cwd=sources, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"llama.cpp's converter failed:\n{result.stderr[-4000:]}")
    return [Path(out) for _, out, _, _ in jobs]


def _convert(listing: str) -> None:
    import gguf
    import torch
    from conversion import ModelBase, ModelType, get_model_architecture, get_model_class
    from conversion import base as conversion_base

    _patch(conversion_base)
    types = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}  # fmt: skip
    for folder, out, outtype, mmproj in json.loads(listing):
        model_type = ModelType.MMPROJ if mmproj else ModelType.TEXT
        with torch.inference_mode():
            hparams = ModelBase.load_hparams(Path(folder), False)
            model_class = get_model_class(get_model_architecture(hparams, model_type), mmproj=mmproj)
            model_class(Path(folder), types[outtype], Path(out), eager=True).write()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    _convert(sys.argv[1])
