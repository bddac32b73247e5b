"""build_model: a model folder -> model + processor (or none), as the engine runs them."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from tessera.config import ModelConfig
from tessera.models.factory import BuiltModel, build_model
from tessera.tokenizer_utils import load_tokenizer
from testkit import random_images


def test_a_multimodal_folder_gets_its_registered_processor(tiny_llava_dir):
    config = ModelConfig(str(tiny_llava_dir), device="cpu")
    tokenizer = load_tokenizer(config)
    built = build_model(config, tokenizer)
    assert isinstance(built, BuiltModel)
    assert type(built.model).__name__ == "LlavaForConditionalGeneration" and not built.model.training
    assert type(built.processor).__name__ == "LlavaMultiModalProcessor"
    assert built.processor.info.get_tokenizer() is tokenizer
    renderer, image_text = built.inputs.chat_renderer()
    assert type(renderer).__name__ == "LlavaProcessor" and image_text is None


def test_a_text_model_has_no_processor_and_renders_chat_with_its_tokenizer(tmp_path, tiny_llava_dir):
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=600, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                 num_attention_heads=4)).save_pretrained(tmp_path)  # fmt: skip
    AutoTokenizer.from_pretrained(tiny_llava_dir).save_pretrained(tmp_path)
    config = ModelConfig(str(tmp_path), device="cpu")
    tokenizer = load_tokenizer(config)
    built = build_model(config, tokenizer)
    assert type(built.model).__name__ == "LlamaForCausalLM"
    assert built.processor is None
    assert built.inputs.chat_renderer() == (tokenizer, None)


def test_an_mrope_config_is_refused_for_a_model_without_mrope(tmp_path):
    """A Qwen2-VL-shaped rope (three-axis mrope_section) on a plain Qwen2 text model would run with 1-D
    positions and give wrong outputs: refused at load, naming the interface it lacks."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from testkit import build_tiny_text_model

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    folder = build_tiny_text_model(tmp_path / "m", Qwen2ForCausalLM, Qwen2Config, rope_parameters=rope)
    config = ModelConfig(str(folder), device="cpu")
    with pytest.raises(ValueError, match="M-RoPE.*SupportsMRoPE"):
        build_model(config, load_tokenizer(config))
    plain = build_tiny_text_model(tmp_path / "plain", Qwen2ForCausalLM, Qwen2Config)
    config = ModelConfig(str(plain), device="cpu")
    assert type(build_model(config, load_tokenizer(config)).model).__name__ == "Qwen2ForCausalLM"


def test_an_mrope_config_builds_a_model_that_supports_mrope(tmp_path):
    """The same config is accepted by a model class that declares SupportsMRoPE: its layers then
    rotate by three-axis positions."""
    import json

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tessera import ModelRegistry
    from tessera.layers.mrope import MRotaryEmbedding
    from tessera.models.interfaces import SupportsMRoPE
    from tessera.models.qwen2 import Qwen2ForCausalLM as TesseraQwen2
    from testkit import build_tiny_text_model

    class MRoPEQwen2(TesseraQwen2, SupportsMRoPE):
        pass

    ModelRegistry.register_model("MRoPEQwen2ForTest", MRoPEQwen2)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    folder = build_tiny_text_model(tmp_path / "m", Qwen2ForCausalLM, Qwen2Config, rope_parameters=rope)
    config_json = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config_json, "architectures": ["MRoPEQwen2ForTest"]}))
    config = ModelConfig(str(folder), device="cpu")
    model = build_model(config, load_tokenizer(config)).model
    assert isinstance(model.model.layers[0].self_attn.rotary_emb, MRotaryEmbedding)


def test_build_processor_gives_the_models_processor_side_without_its_weights(tiny_llava_dir, monkeypatch):
    """What a front-end over cores in other processes builds: the same processor, renderer and placeholder
    texts as the loaded model's, and no weights read."""
    from tessera.models import factory

    config = ModelConfig(str(tiny_llava_dir), device="cpu")
    tokenizer = load_tokenizer(config)
    loaded = build_model(config, tokenizer).inputs
    monkeypatch.setattr(factory, "load_model", lambda *a, **k: pytest.fail("build_processor loaded weights"))
    built = factory.build_processor(config, tokenizer)
    assert type(built.processor) is type(loaded.processor) and built.model_cls is loaded.model_cls
    assert type(built.chat_renderer()[0]) is type(loaded.chat_renderer()[0])
    assert built.model_cls.get_placeholder_str("image", 0) == loaded.model_cls.get_placeholder_str("image", 0)
    prompt, image = "USER: <image>\nWhat is this? ASSISTANT:", random_images([(40, 30)], seed=2)[0]
    ours = built.processor.apply(prompt, {"image": image}, {})
    theirs = loaded.processor.apply(prompt, {"image": image}, {})
    assert ours["prompt_token_ids"] == theirs["prompt_token_ids"] and ours["mm_hashes"] == theirs["mm_hashes"]
