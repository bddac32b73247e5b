"""The built-in llava pipeline: a text Llama + CLIP + projector assembled as a pipeline generates
exactly what the processor-based LLaVA generates from the same weights."""

from __future__ import annotations

import logging

import pytest
import torch

from tessera import LLM, SamplingParams
from tessera.pipelines import load_pipeline
from tessera.pipelines.llava.llava import load_projector
from testkit import random_images

QUESTION = "\nWhat is this? ASSISTANT:"


def pipeline_llm(parts, **options):
    params = {"vision_tower": str(parts["vision"])}  # the projector is found in the model folder
    return LLM(str(parts["text"]), multimodal_pipeline="llava-v1.5-7b", pipeline_params=params,
               kv_cache_memory="64MiB", **options)  # fmt: skip


def test_same_greedy_tokens_as_the_processor_based_llava(tiny_llava_dir, llava_parts):
    images = random_images([(40, 30), (24, 48), (32, 32)], seed=9)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    native = LLM(str(tiny_llava_dir), kv_cache_memory="64MiB")
    prompts = [{"prompt": "USER: <image>" + QUESTION, "multi_modal_data": {"image": image}} for image in images]
    two = {"prompt": "USER: <image><image>" + QUESTION, "multi_modal_data": {"image": images[:2]}}
    expected = native.generate([*prompts, two], params, use_tqdm=False)
    llm = pipeline_llm(llava_parts)
    got = llm.generate([*prompts, two], params, use_tqdm=False)
    image_token = native.engine.model_config.hf_config.image_token_index  # LLaVA's <image>
    placeholder = llm.engine.core.built.model.pipeline.placeholder_token_id()  # v1.5 pipelines: <unk>
    for e, g in zip(expected, got):  # the same prompt, image positions included
        assert g.prompt_token_ids == [placeholder if t == image_token else t for t in e.prompt_token_ids]
        assert g.outputs[0].token_ids == e.outputs[0].token_ids


def test_chat_image_parts_and_model_name_selection(tiny_llava_dir, llava_parts, tmp_path):
    image = random_images([(40, 30)], seed=2)[0]
    path = tmp_path / "x.png"
    image.save(path)
    # multimodal_pipeline="auto": chosen by the folder name ("tiny-llava-v1.5-7b")
    llm = LLM(str(llava_parts["text"]), multimodal_pipeline="auto", kv_cache_memory="64MiB",
              pipeline_params={"vision_tower": str(llava_parts["vision"])})  # fmt: skip
    assert llm.engine.core.built.model.pipeline.name() == "llava-v1.5-7b"
    message = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(path)}},
                                           {"type": "text", "text": "What is this?"}]}  # fmt: skip
    prompt = llm.render_chat(
        [message], chat_template="{% for m in messages %}USER: {{ m.content }} ASSISTANT:{% endfor %}"
    )
    assert prompt["prompt"] == "USER: <image>What is this? ASSISTANT:" and len(prompt["multi_modal_data"]["image"]) == 1


def test_truncation_keeps_only_whole_images_and_counts_the_dropped(llava_parts, caplog):
    llm = pipeline_llm(llava_parts)
    images = random_images([(40, 30), (24, 48), (32, 32)], seed=4)
    num_embeds = llm.engine.core.built.model.pipeline.num_image_embeds()
    prompt = {"prompt": "USER: <image> one <image> two <image>" + QUESTION, "multi_modal_data": {"image": images}}
    keep = num_embeds + 12  # room for the last image and the text after it, not for a second image
    with caplog.at_level(logging.WARNING):
        (out,) = llm.generate(prompt, SamplingParams(max_tokens=2, truncate_prompt_tokens=keep), use_tqdm=False)
    placeholder = llm.engine.core.built.model.pipeline.placeholder_token_id()
    assert out.prompt_token_ids.count(placeholder) == num_embeds  # one whole image left, none cut
    assert len(out.prompt_token_ids) <= keep
    assert "dropped 2 image(s)" in caplog.text


@pytest.mark.parametrize("suffix", [".safetensors", ".bin"])
@pytest.mark.parametrize("layout", ["linear", "mlp"])
def test_projector_shape_is_read_from_the_weights(tmp_path, layout, suffix):
    from safetensors.torch import save_file

    if layout == "linear":  # LLaVA v0: one Linear 1024 -> 4096 (scaled down)
        weights = {"model.mm_projector.weight": torch.randn(12, 8), "model.mm_projector.bias": torch.randn(12)}
    else:
        weights = {"model.mm_projector.0.weight": torch.randn(12, 8), "model.mm_projector.0.bias": torch.randn(12),
                   "model.mm_projector.2.weight": torch.randn(12, 12),
                   "model.mm_projector.2.bias": torch.randn(12)}  # fmt: skip
    path = tmp_path / f"mm_projector{suffix}"
    save_file(weights, str(path)) if suffix == ".safetensors" else torch.save(weights, path)
    projector = load_projector(path)
    x = torch.randn(3, 8)
    if layout == "linear":
        expected = x @ weights["model.mm_projector.weight"].T + weights["model.mm_projector.bias"]
    else:
        hidden = torch.nn.functional.gelu(
            x @ weights["model.mm_projector.0.weight"].T + weights["model.mm_projector.0.bias"]
        )
        expected = hidden @ weights["model.mm_projector.2.weight"].T + weights["model.mm_projector.2.bias"]
    torch.testing.assert_close(projector(x), expected)


def test_missing_parts_are_clear_errors(llava_parts, tmp_path):
    with pytest.raises(ValueError, match="needs a CLIP vision tower folder"):
        load_pipeline("llava-v1.5-7b", params={"model_path": str(tmp_path)})
    with pytest.raises(ValueError, match="needs mm_projector weights"):
        load_pipeline("llava-v1.5-7b", params={"model_path": str(tmp_path), "vision_tower": str(llava_parts["vision"])})


def test_v0_variants_need_their_marker_tokens(llava_parts):
    with pytest.raises(ValueError, match="needs the token '<im_patch>'"):
        LLM(str(llava_parts["text"]), multimodal_pipeline="llava-7b", kv_cache_memory="64MiB",
            pipeline_params={"vision_tower": str(llava_parts["vision"])})  # fmt: skip
