"""The pipelines as a plugin: the options become hf_overrides naming the pipeline architecture, and
build_model builds that architecture as any other: the text model under the pipeline, its processor,
its chat marker."""

from __future__ import annotations

import pytest

from tessera import ModelRegistry
from tessera.config import ModelConfig, engine_configs
from tessera.models.factory import build_model, build_processor
from tessera.pipelines.adapter import IMAGE_MARKER, PipelineForCausalLM, PipelineMultiModalProcessor
from tessera.pipelines.plugin import PIPELINE_ARCHITECTURE, PIPELINE_SETTINGS
from tessera.tokenizer_utils import load_tokenizer


def test_pipeline_options_build_the_text_model_under_the_pipeline(llava_parts):
    model_config, *_ = engine_configs(str(llava_parts["text"]), device="cpu", multimodal_pipeline="llava-v1.5-7b",
                                      pipeline_params={"vision_tower": str(llava_parts["vision"])})  # fmt: skip
    assert model_config.architectures == [PIPELINE_ARCHITECTURE]
    tokenizer = load_tokenizer(model_config)
    built = build_model(model_config, tokenizer)
    assert isinstance(built.model, PipelineForCausalLM) and isinstance(built.processor, PipelineMultiModalProcessor)
    pipeline = built.model.pipeline
    assert pipeline.name() == "llava-v1.5-7b" and built.processor.info.pipeline is pipeline  # loaded once
    assert type(built.model.language_model).__name__ == "LlamaForCausalLM"
    assert pipeline.tokenizer is tokenizer and pipeline.text_model is built.model.language_model
    assert built.inputs.chat_renderer() == (tokenizer, IMAGE_MARKER)


def test_hf_overrides_alone_select_the_pipeline_as_an_out_of_tree_model(llava_parts):
    """What the options stand for, written by hand: the architecture the plugin registered, and its settings."""
    overrides = {
        "architectures": [PIPELINE_ARCHITECTURE],
        PIPELINE_SETTINGS: {"name": "llava-v1.5-7b", "params": {"vision_tower": str(llava_parts["vision"])}},
    }
    assert PIPELINE_ARCHITECTURE in ModelRegistry.get_supported_archs()
    config = ModelConfig(str(llava_parts["text"]), device="cpu", hf_overrides=overrides)
    tokenizer = load_tokenizer(config)
    built = build_processor(config, tokenizer)  # a front-end's side: the processor, no text weights
    assert built.model_cls is PipelineForCausalLM and built.chat_renderer() == (tokenizer, IMAGE_MARKER)
    assert built.processor.info.pipeline.name() == "llava-v1.5-7b"


def test_a_text_model_the_registry_lacks_is_refused_under_a_pipeline(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    model_config, *_ = engine_configs(str(tmp_path), device="cpu", multimodal_pipeline="auto")
    with pytest.raises(ValueError, match="Unsupported language model 'gpt2'"):
        build_model(model_config, tokenizer=None)


def test_pipeline_params_without_a_pipeline_are_refused(llava_parts):
    with pytest.raises(ValueError, match="pipeline_params need multimodal_pipeline"):
        engine_configs(str(llava_parts["text"]), pipeline_params={"vision_tower": "x"})


def test_pipelines_refuse_tensor_parallelism_before_any_worker_starts(llava_parts, monkeypatch):
    from tessera.engine.executor import local_core

    monkeypatch.setattr(local_core, "start_workers", lambda *a: pytest.fail("a worker was started"))
    configs = engine_configs(str(llava_parts["text"]), device="cpu", multimodal_pipeline="llava-v1.5-7b",
                             tensor_parallel_size=2)  # fmt: skip
    with pytest.raises(ValueError, match=f"{PIPELINE_ARCHITECTURE} .* does not support tensor parallelism"):
        local_core.start_core(configs[0], configs[1], configs[2], configs[3])
