"""build_model in pipeline mode: the text model under the pipeline, its processor, its chat marker."""

from __future__ import annotations

from tessera.config import ModelConfig, MultiModalConfig
from tessera.models.factory import build_model
from tessera.models.pipeline_adapter import IMAGE_MARKER, PipelineForCausalLM, PipelineMultiModalProcessor
from tessera.tokenizer_utils import load_tokenizer


def test_pipeline_mode_builds_the_text_model_under_the_pipeline(llava_parts):
    mm = MultiModalConfig(
        multimodal_pipeline="llava-v1.5-7b", pipeline_params={"vision_tower": str(llava_parts["vision"])}
    )
    config = ModelConfig(str(llava_parts["text"]), device="cpu", multimodal_config=mm)
    tokenizer = load_tokenizer(config)
    built = build_model(config, tokenizer)
    assert isinstance(built.model, PipelineForCausalLM) and isinstance(built.processor, PipelineMultiModalProcessor)
    assert built.pipeline.name() == "llava-v1.5-7b" and built.model.pipeline is built.pipeline
    assert type(built.model.language_model).__name__ == "LlamaForCausalLM"
    assert built.pipeline.tokenizer is tokenizer and built.pipeline.text_model is built.model.language_model
    assert built.inputs.chat_renderer() == (tokenizer, IMAGE_MARKER)
