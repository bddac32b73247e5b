"""LLaVA model code against Hugging Face transformers on the tiny checkpoint (fp32)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoProcessor
from transformers import LlavaForConditionalGeneration as HFLlava

from tessera import LLM, SamplingParams
from tessera.config import ModelConfig
from tessera.models.loader import load_model
from testkit import IMAGE_SIZES as SIZES
from testkit import LLAVA_PROMPTS, build_tiny_llava, random_images
from testkit.generation import greedy_logprobs, hf_recomputed_logprobs


def engine(folder, **options) -> LLM:
    """The engine on the CPU with 4-token blocks (every prompt spans several) and no prefix caching
    (every prompt is computed)."""
    defaults = {"device": "cpu", "block_size": 4, "kv_cache_memory": "16MiB", "enable_prefix_caching": False}
    return LLM(str(folder), **{**defaults, **options})


@pytest.fixture(scope="module")
def llava(tiny_llava_dir):
    hf_model = HFLlava.from_pretrained(tiny_llava_dir, attn_implementation="eager").eval()
    return engine(tiny_llava_dir), hf_model, AutoProcessor.from_pretrained(tiny_llava_dir)


def request(prompt, images):
    return {"prompt": prompt, "multi_modal_data": {"image": images}} if images else prompt


def next_token_logprobs(llm, hf_model, prompt, images):
    """The engine's log-probabilities after the prompt ([vocab]): from the last prompt position's
    logits, the only ones the engine computes."""
    vocab_size = hf_model.config.get_text_config().vocab_size
    ((_, logprobs),) = greedy_logprobs(llm, [request(prompt, images)], 1, vocab_size)
    return logprobs[0]


@pytest.mark.parametrize("num_images", [0, 1, 3])
def test_prefill_logits_match_hf(llava, num_images):
    llm, hf_model, hf_processor = llava
    images = random_images(SIZES[:num_images])
    prompt = LLAVA_PROMPTS[num_images]
    with torch.no_grad():
        logits = hf_model(**hf_processor(text=prompt, images=images or None, return_tensors="pt")).logits[0]
    expected = logits[-1].log_softmax(-1)
    torch.testing.assert_close(next_token_logprobs(llm, hf_model, prompt, images), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("num_images", [0, 1, 3])
def test_greedy_tokens_match_hf_generate(llava, num_images):
    llm, hf_model, hf_processor = llava
    images = random_images(SIZES[:num_images], seed=7)
    prompt = LLAVA_PROMPTS[num_images]
    hf_inputs = hf_processor(text=prompt, images=images or None, return_tensors="pt")
    with torch.no_grad():
        hf_out = hf_model.generate(**hf_inputs, max_new_tokens=16, do_sample=False, eos_token_id=None)
    expected = hf_out[0, hf_inputs["input_ids"].shape[1] :].tolist()
    assert len(expected) == 16
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    (output,) = llm.generate(request(prompt, images), params, use_tqdm=False)
    assert output.outputs[0].token_ids == expected


def test_batch_of_four_equals_each_alone(llava):
    """The four prompts are prefilled in one step (they fit its token budget), then decoded together."""
    llm, hf_model, _ = llava
    vocab_size = hf_model.config.get_text_config().vocab_size
    requests = [
        ("USER: Hi there, who are you? ASSISTANT:", []),
        (LLAVA_PROMPTS[1], random_images([(70, 20)], seed=1)),
        ("USER: <image> and <image>? ASSISTANT:", random_images([(30, 30), (64, 48)], seed=2)),
        (LLAVA_PROMPTS[3], random_images(SIZES, seed=3)),
    ]
    prompts = [request(prompt, images) for prompt, images in requests]
    together = greedy_logprobs(llm, prompts, 4, vocab_size)
    for prompt, (tokens, logprobs) in zip(prompts, together):
        ((alone_tokens, alone_logprobs),) = greedy_logprobs(llm, [prompt], 4, vocab_size)
        assert tokens == alone_tokens
        torch.testing.assert_close(logprobs, alone_logprobs, atol=1e-5, rtol=0)


def test_paged_decode_equals_recomputing_the_sequence(llava, tiny_llava_dir):
    _, hf_model, hf_processor = llava
    vocab_size = hf_model.config.get_text_config().vocab_size
    images = random_images([(40, 40)])
    prompt = request(LLAVA_PROMPTS[1], images)
    # Block size 3 does not divide the prompt: blocks end mid-placeholder and mid-decode.
    ((tokens, logprobs),) = greedy_logprobs(engine(tiny_llava_dir, block_size=3), [prompt], 10, vocab_size)
    ((_, one_block),) = greedy_logprobs(engine(tiny_llava_dir, block_size=64), [prompt], 10, vocab_size)
    torch.testing.assert_close(logprobs, one_block, atol=1e-5, rtol=0)

    # Recomputed: the prompt and every output token but the last in one forward (HF, no KV cache).
    inputs = hf_processor(text=LLAVA_PROMPTS[1], images=images, return_tensors="pt")
    recomputed = hf_recomputed_logprobs(hf_model, inputs, tokens)
    torch.testing.assert_close(logprobs, recomputed, atol=1e-4, rtol=0)


def test_full_select_strategy_matches_hf(tmp_path):
    folder = build_tiny_llava(tmp_path / "full", vision_feature_select_strategy="full")
    hf_model = HFLlava.from_pretrained(folder, attn_implementation="eager").eval()
    images = random_images(SIZES[:2])
    prompt = "USER: <image><image> Same? ASSISTANT:"
    hf_inputs = AutoProcessor.from_pretrained(folder)(text=prompt, images=images, return_tensors="pt")
    with torch.no_grad():
        expected = hf_model(**hf_inputs).logits[0, -1].log_softmax(-1)
    ours = next_token_logprobs(engine(folder), hf_model, prompt, images)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


def test_feature_layer_list_concatenates_the_layers(tmp_path):
    """transformers 4.48 has no vision_feature_layer lists, so the reference is HF's CLIP hidden
    states concatenated and projected by hand (as later transformers and vLLM do)."""
    from safetensors.torch import load_file, save_file
    from transformers import CLIPVisionModel as HFCLIPVisionModel

    layers = [-2, -1]
    folder = build_tiny_llava(tmp_path / "layers", vision_feature_layer=layers)
    weights = load_file(folder / "model.safetensors")
    hidden = weights["multi_modal_projector.linear_2.weight"].shape[0]
    generator = torch.Generator().manual_seed(0)
    # The projector of a multi-layer model reads the concatenation: 2x the vision width.
    weights["multi_modal_projector.linear_1.weight"] = torch.randn(hidden, 2 * 32, generator=generator) * 0.1
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})

    model = load_model(ModelConfig(str(folder), device="cpu"))
    pixel_values = torch.randn(2, 3, 32, 32, generator=generator)
    with torch.no_grad():
        ours = model.get_multimodal_embeddings(pixel_values=pixel_values)
        clip = HFCLIPVisionModel(model.config.vision_config).eval()
        prefix = "vision_tower.vision_model."  # the hub layout; transformers 5's CLIP has no vision_model level
        result = clip.load_state_dict(
            {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}, strict=False
        )
        assert not result.unexpected_keys and set(result.missing_keys) <= {"embeddings.position_ids"}
        states = clip(pixel_values, output_hidden_states=True).hidden_states
        features = torch.cat([states[i][:, 1:] for i in layers], dim=-1)
        w = {k.split("multi_modal_projector.")[1]: v for k, v in weights.items() if "projector" in k}
        expected = torch.nn.functional.gelu(features @ w["linear_1.weight"].T + w["linear_1.bias"])
        expected = expected @ w["linear_2.weight"].T + w["linear_2.bias"]
    assert ours.shape == (2, 16, hidden)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "part_dtypes", [{"vision_dtype": "bfloat16"}, {"vision_dtype": "bfloat16", "projector_dtype": "float16"}]
)
def test_vision_and_projector_run_in_their_own_dtype(llava, tiny_llava_dir, part_dtypes):
    _, hf_model, hf_processor = llava
    model = load_model(ModelConfig(str(tiny_llava_dir), device="cpu", **part_dtypes))
    assert next(model.vision_tower.parameters()).dtype == torch.bfloat16
    assert next(model.language_model.parameters()).dtype == torch.float32
    images = random_images(SIZES[:1])
    with torch.no_grad():
        logits = hf_model(**hf_processor(text=LLAVA_PROMPTS[1], images=images, return_tensors="pt")).logits[0]
    ours = next_token_logprobs(engine(tiny_llava_dir, **part_dtypes), hf_model, LLAVA_PROMPTS[1], images)
    torch.testing.assert_close(ours, logits[-1].log_softmax(-1), atol=2e-2, rtol=0)  # bf16 vision: ~3 digits
