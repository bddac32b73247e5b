"""HF processor outputs in the containers model files were written against.

transformers 5.x changed the container of some processor outputs that vLLM-guide model files
unpack by hand. The processing context restores the earlier layout right after the HF call, so
such a file keeps working with a newer transformers by changing its imports only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers import BatchFeature


def _fuyu_image_patches(data: Mapping[str, object], outputs: BatchFeature) -> None:
    """Fuyu: 4.x gave `image_patches` per prompt, [[num_images, Pn, Px * Py * C]]; 5.x gives the
    patches of the prompt's image as one [Pn, Px * Py * C] tensor (one image per prompt: the
    processor refuses more)."""
    patches = outputs.get("image_patches")
    if isinstance(patches, torch.Tensor) and patches.ndim == 2:
        outputs["image_patches"] = [patches[None]]


def tokenize_text_only(hf_processor: Any, text: str, call_kwargs: Mapping[str, object], tokenizer: Any) -> BatchFeature:
    """`text` tokenized as the processor's own call tokenizes it, without its items: transformers 5
    processors refuse placeholders (``<image>``) whose items are not in the same call, which is how
    the processor-output cache and token prompts send text. The processor's tokenizer gets the text
    options its call would merge (its defaults, the tokenizer's, the call's), e.g. a processor that
    adds no special tokens."""
    tokenizer = getattr(hf_processor, "tokenizer", None) or tokenizer
    text_kwargs: dict[str, Any] = {}
    merge = getattr(hf_processor, "_merge_kwargs", None)
    if merge is not None:
        try:
            merged = merge(tokenizer_init_kwargs=getattr(tokenizer, "init_kwargs", {}), **call_kwargs)
            text_kwargs = dict(merged["text_kwargs"])
        except Exception:  # a processor of another shape: its tokenizer's own defaults
            text_kwargs = {}
    for key in ("return_tensors", "return_mm_token_type_ids", "return_text_replacement_offsets"):
        text_kwargs.pop(key, None)
    return BatchFeature(dict(tokenizer(text, return_tensors="pt", **text_kwargs)))


_RESTORERS: dict[str, Callable[[Mapping[str, object], BatchFeature], None]] = {
    "FuyuProcessor": _fuyu_image_patches,
}


def restore_legacy_layout(hf_processor: Any, data: Mapping[str, object], outputs: BatchFeature) -> BatchFeature:
    """`outputs` of `hf_processor(**data)`, changed in place to the 4.x containers model files expect."""
    for cls in type(hf_processor).__mro__:
        restore = _RESTORERS.get(cls.__name__)
        if restore is not None:
            restore(data, outputs)
            break
    return outputs
