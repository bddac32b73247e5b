"""Pipeline module: the LLaVA family as pipelines for a Llama text model.

Imports nothing heavy until a pipeline is actually requested."""

from __future__ import annotations

from typing import Any, Optional

available_pipelines = ["llava-7b", "llava-13b", "llava-llama-2-13b", "llava-v1.5-7b", "llava-v1.5-13b"]


def get_pipeline(name: str, params: dict) -> Optional[Any]:
    if name not in available_pipelines:
        return None
    from .llava import make_pipeline

    return make_pipeline(name, params)


def get_pipeline_from_model_name(model_name: str, params: dict) -> Optional[Any]:
    """Only for names that clearly are a LLaVA fine-tune (the text model was trained with it)."""
    name = model_name.lower()
    if "llava" not in name:
        return None
    if "llama-2" in name:
        return get_pipeline("llava-llama-2-13b", params)
    if "v1.5" in name or "1.5" in name:
        return get_pipeline("llava-v1.5-13b" if "13b" in name else "llava-v1.5-7b", params)
    if "13b" in name:
        return get_pipeline("llava-13b", params)
    if "7b" in name:
        return get_pipeline("llava-7b", params)
    return None
