"""ModelRegistry: config.json `architectures` -> model class, built-in or registered out of tree;
and a multimodal model's `text_config.model_type` -> the class of its language model. Plugins
(`tessera.plugins`) are loaded before the first registration or lookup, so that a class a plugin
registers is found, and one the user registers afterwards replaces it."""

from __future__ import annotations

import copy
import importlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Union

from transformers import PretrainedConfig

from ..plugins import load_plugins

if TYPE_CHECKING:
    from torch import nn

logger = logging.getLogger(__name__)

# Built-in architectures, imported on first use so that importing tessera stays cheap.
_BUILTIN_MODELS = {
    "LlavaForConditionalGeneration": "tessera.models.llava:LlavaForConditionalGeneration",
    "LlavaNextForConditionalGeneration": "tessera.models.llava_next:LlavaNextForConditionalGeneration",
    "LlavaOnevisionForConditionalGeneration": "tessera.models.llava_onevision:LlavaOnevisionForConditionalGeneration",
    "Idefics3ForConditionalGeneration": "tessera.models.idefics3:Idefics3ForConditionalGeneration",
    "SmolVLMForConditionalGeneration": "tessera.models.smolvlm:SmolVLMForConditionalGeneration",
    "Gemma3ForConditionalGeneration": "tessera.models.gemma3_mm:Gemma3ForConditionalGeneration",
    "Gemma4ForConditionalGeneration": "tessera.models.gemma4_mm:Gemma4ForConditionalGeneration",
    "ColQwen2ForRetrieval": "tessera.models.colqwen2:ColQwen2ForRetrieval",
    "InternVLForConditionalGeneration": "tessera.models.internvl:InternVLForConditionalGeneration",
    "Mistral3ForConditionalGeneration": "tessera.models.mistral3:Mistral3ForConditionalGeneration",
    "Qwen2VLForConditionalGeneration": "tessera.models.qwen2_vl:Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration": "tessera.models.qwen2_5_vl:Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration": "tessera.models.qwen3_vl:Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration": "tessera.models.qwen3_vl_moe:Qwen3VLMoeForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration": "tessera.models.qwen3_5:Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration": "tessera.models.qwen3_5:Qwen3_5MoeForConditionalGeneration",
    "Lfm2VlForConditionalGeneration": "tessera.models.lfm2_vl:Lfm2VlForConditionalGeneration",
    "Qwen2AudioForConditionalGeneration": "tessera.models.qwen2_audio:Qwen2AudioForConditionalGeneration",
    "VoxtralForConditionalGeneration": "tessera.models.voxtral:VoxtralForConditionalGeneration",
    # Qwen2.5-Omni: its thinker (the whole model's checkpoints too: the talker is not run)
    "Qwen2_5OmniThinkerForConditionalGeneration":
        "tessera.models.qwen2_5_omni_thinker:Qwen2_5OmniThinkerForConditionalGeneration",
    "Qwen2_5OmniForConditionalGeneration":
        "tessera.models.qwen2_5_omni_thinker:Qwen2_5OmniThinkerForConditionalGeneration",
    "Qwen2_5OmniModel": "tessera.models.qwen2_5_omni_thinker:Qwen2_5OmniThinkerForConditionalGeneration",
    "FuyuForCausalLM": "tessera.models.fuyu:FuyuForCausalLM",
    "LlamaForCausalLM": "tessera.models.llama:LlamaForCausalLM",
    "PersimmonForCausalLM": "tessera.models.persimmon:PersimmonForCausalLM",
    "Qwen2ForCausalLM": "tessera.models.qwen2:Qwen2ForCausalLM",
    "MistralForCausalLM": "tessera.models.mistral:MistralForCausalLM",
    "Qwen3ForCausalLM": "tessera.models.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "tessera.models.qwen3_moe:Qwen3MoeForCausalLM",
    "Qwen3_5ForCausalLM": "tessera.models.qwen3_5:Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM": "tessera.models.qwen3_5:Qwen3_5MoeForCausalLM",
    "Lfm2ForCausalLM": "tessera.models.lfm2:Lfm2ForCausalLM",
    "Gemma3ForCausalLM": "tessera.models.gemma3:Gemma3ForCausalLM",
    "Gemma4ForCausalLM": "tessera.models.gemma4:Gemma4ForCausalLM",
}
# Language models a multimodal model builds on, by its text_config.model_type.
_BUILTIN_TEXT_MODELS = {
    "llama": "tessera.models.llama:LlamaForCausalLM",
    "persimmon": "tessera.models.persimmon:PersimmonForCausalLM",
    "qwen2": "tessera.models.qwen2:Qwen2ForCausalLM",
    "qwen2_vl_text": "tessera.models.qwen2:Qwen2ForCausalLM",  # Qwen2-VL's decoder: Qwen2's, M-RoPE positions
    "qwen2_5_vl_text": "tessera.models.qwen2:Qwen2ForCausalLM",  # so is Qwen2.5-VL's
    "qwen2_5_omni_text": "tessera.models.qwen2:Qwen2ForCausalLM",  # and Qwen2.5-Omni's thinker's
    "mistral": "tessera.models.mistral:MistralForCausalLM",
    "qwen3": "tessera.models.qwen3:Qwen3ForCausalLM",
    "qwen3_moe": "tessera.models.qwen3_moe:Qwen3MoeForCausalLM",
    "qwen3_vl_text": "tessera.models.qwen3_vl:Qwen3VLTextForCausalLM",  # Qwen3's, adding DeepStack features
    "qwen3_vl_moe_text": "tessera.models.qwen3_vl_moe:Qwen3VLMoeTextForCausalLM",  # and routed experts
    "qwen3_5_text": "tessera.models.qwen3_5:Qwen3_5ForCausalLM",  # hybrid: Gated DeltaNet + gated attention
    "qwen3_5_moe_text": "tessera.models.qwen3_5:Qwen3_5MoeForCausalLM",  # the same, with routed experts
    "lfm2": "tessera.models.lfm2:Lfm2ForCausalLM",  # hybrid: short convolutions + attention
    "gemma3_text": "tessera.models.gemma3:Gemma3ForCausalLM",
    "gemma4_text": "tessera.models.gemma4:Gemma4ForCausalLM",
}


class _ModelRegistry:
    def __init__(self) -> None:
        self._models: dict[str, Union[type, str]] = dict(_BUILTIN_MODELS)
        self._text_models: dict[str, Union[type, str]] = dict(_BUILTIN_TEXT_MODELS)

    def register_model(self, architecture: str, model_cls: Union[type, str]) -> None:
        """Register `model_cls` (a class, or "module.path:ClassName" imported lazily) for an
        architecture name as written in config.json, as vLLM plugins do."""
        load_plugins()
        _register(self._models, "Architecture", architecture, model_cls)

    def register_text_model(self, model_type: str, model_cls: Union[type, str]) -> None:
        """Register the language model class (as in register_model) that multimodal models build
        for a `text_config.model_type`; it takes the text config and has the CausalLM interface."""
        load_plugins()
        _register(self._text_models, "Text model type", model_type, model_cls)

    def get_supported_archs(self) -> list[str]:
        load_plugins()
        return sorted(self._models)

    def get_supported_text_model_types(self) -> list[str]:
        load_plugins()
        return sorted(self._text_models)

    def load_model_cls(self, architecture: str) -> type:
        load_plugins()
        return _load(self._models, architecture)

    def resolve_text_model_cls(self, text_config: PretrainedConfig) -> type:
        """The language model class for a multimodal config's `text_config` (by its model_type)."""
        load_plugins()
        model_type = text_config.model_type
        if model_type not in self._text_models:
            raise ValueError(
                f"Unsupported language model {model_type!r} (text_config.model_type). Supported: "
                f"{', '.join(self.get_supported_text_model_types())}. Register another with "
                "tessera.ModelRegistry.register_text_model(model_type, model_cls)."
            )
        return _load(self._text_models, model_type)

    def build_language_model(self, config: PretrainedConfig) -> nn.Module:
        """The language model of a multimodal `config`, built from a copy of its `text_config`. In
        transformers 5 the lm_head belongs to the outer model, so the outer config's `tie_word_embeddings`
        decides whether it is tied (`PreTrainedModel.get_expanded_tied_weights_keys` reads the model's own
        config), whatever the text config says (Mistral 3, InternVL) or when it says nothing (Qwen2-VL,
        Idefics3); the text config's own value counts only where the outer config has none."""
        text_config = copy.copy(config.text_config)
        outer = getattr(config, "tie_word_embeddings", None)
        if outer is not None:
            text_config.tie_word_embeddings = bool(outer)
        return self.resolve_text_model_cls(text_config)(text_config)

    def resolve_model_cls(self, architectures: Sequence[str]) -> tuple[type, str]:
        """The first supported architecture of a config's `architectures` list."""
        load_plugins()
        for arch in architectures:
            if arch in self._models:
                return self.load_model_cls(arch), arch
        raise ValueError(
            f"Model architectures {list(architectures)} are not supported. Supported: "
            f"{', '.join(self.get_supported_archs())}. Register another with "
            "tessera.ModelRegistry.register_model(architecture, model_cls)."
        )


def _register(table: dict[str, Union[type, str]], what: str, key: str, model_cls: Union[type, str]) -> None:
    if not isinstance(model_cls, (type, str)) or (isinstance(model_cls, str) and ":" not in model_cls):
        raise ValueError(f"model_cls must be a class or a 'module.path:ClassName' string, got {model_cls!r}")
    if key in table:
        logger.warning("%s %s is already registered; replacing it with %s.", what, key, model_cls)
    table[key] = model_cls


def _load(table: dict[str, Union[type, str]], key: str) -> type:
    """The class registered under `key`, imported on first use."""
    entry = table[key]
    if isinstance(entry, str):
        module_name, class_name = entry.split(":")
        entry = getattr(importlib.import_module(module_name), class_name)
        table[key] = entry
    return entry


ModelRegistry = _ModelRegistry()
