"""ModelRegistry: architecture names -> model classes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, PersimmonConfig
from transformers import LlavaForConditionalGeneration as HFLlava

from tessera import ModelRegistry
from tessera.config import ModelConfig
from tessera.layers.attention import AttentionMetadata, attention_metadata
from tessera.layers.kv_cache import allocate_kv_cache
from tessera.models.interfaces import supports_multimodal
from tessera.models.loader import load_model


def test_builtin_architectures_resolve_lazily_to_multimodal_classes():
    for arch in ("LlavaForConditionalGeneration", "FuyuForCausalLM"):
        model_cls, resolved = ModelRegistry.resolve_model_cls(["SomethingElse", arch])
        assert resolved == arch and model_cls.__name__ == arch
        assert supports_multimodal(model_cls)


def test_register_model_by_class_and_by_import_string():
    class Plugin:
        pass

    ModelRegistry.register_model("TestPluginByClass", Plugin)
    ModelRegistry.register_model("TestPluginByString", "collections:OrderedDict")
    assert ModelRegistry.resolve_model_cls(["TestPluginByClass"]) == (Plugin, "TestPluginByClass")
    from collections import OrderedDict

    assert ModelRegistry.resolve_model_cls(["TestPluginByString"])[0] is OrderedDict
    assert {"TestPluginByClass", "TestPluginByString"} <= set(ModelRegistry.get_supported_archs())


@pytest.mark.parametrize("bad", ["no_colon_here", 42])
def test_register_model_rejects_bad_classes(bad):
    with pytest.raises(ValueError, match="must be a class or a 'module.path:ClassName'"):
        ModelRegistry.register_model("TestBad", bad)


def test_unknown_architecture_explains_how_to_register():
    with pytest.raises(ValueError, match="register_model"):
        ModelRegistry.resolve_model_cls(["Unknown"])


def test_text_models_resolve_by_model_type_lazily():
    from tessera.models.llama import LlamaForCausalLM
    from tessera.models.persimmon import PersimmonForCausalLM

    assert {"llama", "persimmon"} <= set(ModelRegistry.get_supported_text_model_types())
    assert ModelRegistry.resolve_text_model_cls(LlamaConfig()) is LlamaForCausalLM
    assert ModelRegistry.resolve_text_model_cls(PersimmonConfig()) is PersimmonForCausalLM


def test_register_text_model_and_unknown_text_model_types():
    ModelRegistry.register_text_model("test-text-by-string", "collections:OrderedDict")
    from collections import OrderedDict

    assert ModelRegistry.resolve_text_model_cls(SimpleNamespace(model_type="test-text-by-string")) is OrderedDict
    with pytest.raises(ValueError, match="register_text_model"):
        ModelRegistry.resolve_text_model_cls(SimpleNamespace(model_type="not-a-registered-type"))
    with pytest.raises(ValueError, match="must be a class or a 'module.path:ClassName'"):
        ModelRegistry.register_text_model("test-text-bad", 42)


def test_a_llava_builds_the_language_model_its_text_config_names(tmp_path):
    """Not only Llama: a LLaVA on a Persimmon backbone loads HF's weights and gives HF's logits."""
    tiny = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
    vision = CLIPVisionConfig(**tiny, image_size=32, patch_size=8, projection_dim=32)
    config = LlavaConfig(vision_config=vision, text_config=PersimmonConfig(**tiny, vocab_size=97), image_token_index=96)
    torch.manual_seed(0)
    HFLlava(config).save_pretrained(tmp_path, safe_serialization=True)
    model = load_model(ModelConfig(str(tmp_path), device="cpu"))
    assert type(model.language_model).__name__ == "PersimmonForCausalLM"
    ids = torch.randint(0, 96, (11,), generator=torch.Generator().manual_seed(1))
    allocate_kv_cache(model, num_blocks=4, block_size=4, dtype=torch.float32)
    with torch.no_grad(), attention_metadata(AttentionMetadata.build([11], [11], [[2, 0, 3]], block_size=4)):
        ours = model.compute_logits(model(None, torch.arange(11), inputs_embeds=model.get_input_embeddings(ids)))
        expected = HFLlava.from_pretrained(tmp_path, attn_implementation="eager")(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


def test_a_language_model_ties_its_head_as_the_outer_config_says():
    """In transformers 5 the lm_head is the outer model's, tied by the outer config's tie_word_embeddings:
    Qwen2-VL's text config has none; a text config that says otherwise does not count, and is not changed."""
    from transformers import Qwen2VLConfig

    rope = {"rope_type": "default", "mrope_section": [1, 1, 2]}
    text = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, rope_parameters=rope)  # fmt: skip
    for tied in (True, False):
        config = Qwen2VLConfig(text_config=text, tie_word_embeddings=tied)
        model = ModelRegistry.build_language_model(config)
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
        config.text_config.tie_word_embeddings = not tied
        model = ModelRegistry.build_language_model(config)
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
        assert config.text_config.tie_word_embeddings is (not tied)
