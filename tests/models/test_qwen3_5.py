"""Qwen3.5 (hybrid: Gated DeltaNet + gated full attention) against Hugging Face transformers on a tiny
checkpoint (fp32, layer_types linear/full/linear/full): the gated delta rule and the causal conv against
HF's torch references, the processor, prefill logits, and greedy tokens alone, batched with prompts of
other lengths, with chunked prefill cutting an image and a video, and under preemption; the state slots
return to the pool."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoProcessor
from transformers import Qwen3_5ForConditionalGeneration as HFQwen3_5
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_modeling

from tessera import LLM, SamplingParams
from tessera.layers.causal_conv1d import causal_conv1d
from tessera.layers.gated_delta_rule import chunked, l2norm, recurrent_step
from tessera.multimodal import MULTIMODAL_REGISTRY
from tessera.multimodal.video import decode_video
from testkit import random_images, video_bytes
from testkit.generation import greedy_logprobs
from testkit.qwen_vl import build_tiny_qwen3_5

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
TEXT = "<|im_start|>user\nWhat is in the image?<|im_end|>\n<|im_start|>assistant\n"
ONE_IMAGE = f"<|im_start|>user\n{IMAGE}What colour is the circle?<|im_end|>\n<|im_start|>assistant\n"
MIXED = f"<|im_start|>user\n{IMAGE} and {VIDEO} Compare them.<|im_end|>\n<|im_start|>assistant\n"
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def test_gated_delta_rule_matches_hf_torch_reference():
    """Chunked (a 150-token prompt over 3 chunks, from a non-zero state) and recurrent forms against HF's."""
    torch.manual_seed(0)
    heads, length, dk, dv = 3, 150, 8, 6
    q, k = (torch.randn(1, length, heads, dk) for _ in range(2))
    v = torch.randn(1, length, heads, dv)
    g = -F.softplus(torch.randn(1, length, heads))
    beta = torch.rand(1, length, heads)
    state = torch.randn(1, heads, dk, dv)
    expected, expected_state = hf_modeling.torch_chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    qn, kn = l2norm(q[0]).transpose(0, 1) * dk**-0.5, l2norm(k[0]).transpose(0, 1)
    out, final = chunked(qn, kn, v[0].transpose(0, 1), g[0].t(), beta[0].t(), state[0])
    torch.testing.assert_close(out.transpose(0, 1), expected[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, expected_state[0], atol=1e-4, rtol=1e-4)
    one = [x[:, :1] for x in (q, k, v, g, beta)]
    expected, expected_state = hf_modeling.torch_recurrent_gated_delta_rule(
        *one, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    q1, k1, v1, g1, b1 = (x[:, 0] for x in one)
    out, final = recurrent_step(l2norm(q1) * dk**-0.5, l2norm(k1), v1, g1, b1, state)
    torch.testing.assert_close(out, expected[:, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, expected_state, atol=1e-5, rtol=1e-5)


def test_causal_conv_over_chunks_and_decode_equals_one_pass():
    """A sequence fed as a chunk of 5, a chunk of 2 and one token (beside another sequence) gives the
    convolution of the whole sequence at once, as HF's torch reference computes it."""
    torch.manual_seed(1)
    channels, width = 6, 4
    weight = torch.randn(channels, width)
    x = torch.randn(8, channels)
    expected = hf_modeling.causal_conv1d_fn(x.t()[None], weight, None, activation=None)[0].t()
    state = torch.zeros(3, channels, width - 1)
    other = torch.randn(3, channels)
    got = [causal_conv1d(x[:5], weight, None, state, [2], [5])]
    out = causal_conv1d(torch.cat([other, x[5:7]]), weight, None, state, [0, 2], [3, 2])
    got.append(out[3:])
    got.append(causal_conv1d(x[7:], weight, None, state, [2], [1]))
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def clip():
    return decode_video(video_bytes(num_frames=24, width=32, height=32, fps=8), num_frames=6)


def mixed_data(clip):
    return {"image": random_images([(60, 40)], seed=7), "video": [clip]}


def hf_inputs(hf_processor, prompt, data):
    videos = data.get("video") or []
    kwargs = {"video_metadata": [v.metadata for v in videos]} if videos else {}
    frames = [v.frames for v in videos] or None
    return hf_processor(
        text=prompt, images=data.get("image"), videos=frames, do_sample_frames=False, return_tensors="pt", **kwargs
    )


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory, clip):
    """(folder, HF processor, HF's last-token log-probs for MIXED, HF's greedy tokens for MIXED and ONE_IMAGE)."""
    folder = build_tiny_qwen3_5(tmp_path_factory.mktemp("tiny_qwen3_5"))
    hf_model = HFQwen3_5.from_pretrained(folder, attn_implementation="eager").eval()
    hf_processor = AutoProcessor.from_pretrained(folder)
    inputs = hf_inputs(hf_processor, MIXED, mixed_data(clip))
    one_image = hf_inputs(hf_processor, ONE_IMAGE, {"image": random_images([(50, 100)], seed=1)})
    with torch.no_grad():
        logprobs = hf_model(**inputs).logits[0, -1].log_softmax(-1)
        expected = []
        for hf in (inputs, one_image):
            out = hf_model.generate(**hf, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
            expected.append(out[0, hf["input_ids"].shape[1] :].tolist())
    return folder, hf_processor, logprobs, expected


def requests(clip):
    return [
        {"prompt": MIXED, "multi_modal_data": mixed_data(clip)},
        {"prompt": ONE_IMAGE, "multi_modal_data": {"image": random_images([(50, 100)], seed=1)}},
    ]


def test_processor_matches_hf(qwen3_5, clip):
    folder, hf_processor, _, _ = qwen3_5
    out = MULTIMODAL_REGISTRY.create_processor(folder).apply(MIXED, mixed_data(clip))
    hf = hf_inputs(hf_processor, MIXED, mixed_data(clip))
    assert out["prompt_token_ids"] == hf["input_ids"][0].tolist()
    (image,) = out["mm_kwargs"].get_items("image")
    torch.testing.assert_close(image["pixel_values"].data, hf["pixel_values"])


def test_prefill_logits_match_hf(qwen3_5, clip):
    folder, _, expected, _ = qwen3_5
    llm = LLM(str(folder), device="cpu", block_size=4, kv_cache_memory="4MiB")
    ((_, logprobs),) = greedy_logprobs(llm, requests(clip)[:1], 1, expected.shape[0])
    torch.testing.assert_close(logprobs[0], expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("options", ["default", "chunked-prefill", "preemption"])
def test_greedy_tokens_match_hf_alone_and_batched(qwen3_5, clip, options):
    folder, _, _, expected = qwen3_5
    kwargs = {
        "default": {},
        # 5-token chunks: the image and the video's runs of pads are cut between chunks, and each chunk of a
        # prompt continues its DeltaNet states from the previous one
        "chunked-prefill": {"max_num_batched_tokens": 5},
        # 2 full-attention layers x K and V x 2 heads x 16 dims x 4 bytes = 512 bytes a token; besides the
        # DeltaNet states of 4 sequences, 30 blocks of 4: the mixed prompt (94 tokens, 24 blocks) and the text
        # one (24 tokens, 6 blocks) start together, and the mixed one needs a 25th block two tokens later
        "preemption": {
            "kv_cache_memory": 30 * 4 * 512 + 4 * SLOT_BYTES,
            "max_num_seqs": 4,
            "enable_prefix_caching": False,
        },
    }[options]
    llm = LLM(str(folder), device="cpu", block_size=4, **{"kv_cache_memory": "4MiB", **kwargs})
    assert [tokens(llm, [r])[0] for r in requests(clip)] == expected
    mixed, one_image = requests(clip)
    assert tokens(llm, [mixed, TEXT, one_image])[::2] == expected  # batched with a shorter text prompt
    if options == "preemption":
        assert llm.engine.core.scheduler.num_preemptions > 0
    stats = llm.engine.core.stats()
    assert stats["state_slots_total"] == (4 if options == "preemption" else 64)
    assert stats["state_slots_used"] == 0  # every sequence's slot returned


# A sequence's DeltaNet states in the tiny model: 2 layers x (conv [2*16 + 32, 3] + recurrent [4, 8, 8]) fp32.
SLOT_BYTES = 2 * (64 * 3 + 4 * 8 * 8) * 4


def tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_the_states_come_from_the_kv_budget(qwen3_5):
    """At most half of kv_cache_memory, a third of that for prefix snapshots; the blocks get the rest."""
    folder, _, _, _ = qwen3_5
    budget, row = 4 * 2**20, SLOT_BYTES
    llm = LLM(str(folder), device="cpu", block_size=4, kv_cache_memory=budget, max_num_seqs=8)
    core = llm.engine.core
    states = core.block_manager.states
    assert (states.num_slots, states.num_snapshots, core.num_state_rows) == (8, 8, 16)
    assert core.num_blocks == (budget - 16 * row) // (4 * 512)
    with pytest.raises(ValueError, match="too small for the model's recurrent state"):
        LLM(str(folder), device="cpu", block_size=4, kv_cache_memory=2 * row)


def test_a_chat_about_one_image_hits_the_prefix_cache_on_every_turn(qwen3_5):
    """Three turns, each prompt the last one + its answer + a question: from the second turn on, the prompt
    continues from the snapshot of the previous prompt's state (the prefix-cache counters say so) and the
    answer is HF's for the whole prompt."""
    folder, hf_processor, _, _ = qwen3_5
    hf_model = HFQwen3_5.from_pretrained(folder, attn_implementation="eager").eval()
    tokenizer = hf_processor.tokenizer
    image = random_images([(50, 100)], seed=1)
    llm = LLM(str(folder), device="cpu", block_size=4, kv_cache_memory="4MiB")
    blocks = llm.engine.core.block_manager
    prompt, hits = ONE_IMAGE, []
    for question in ("And the square?", "Which is larger?", "Thanks."):
        inputs = hf_processor(text=prompt, images=image, return_tensors="pt")
        with torch.no_grad():
            out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
        expected = out[0, inputs["input_ids"].shape[1] :].tolist()
        (got,) = tokens(llm, [{"prompt": prompt, "multi_modal_data": {"image": image}}])
        assert got == expected
        hits.append(blocks.prefix_hits)
        prompt += tokenizer.decode(got) + f"<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    assert hits[0] == 0 < hits[1] < hits[2]  # turn 2 and turn 3 each reused the turn before


@pytest.fixture(scope="module")
def qwen3_5_text(tmp_path_factory):
    """The text model alone (`qwen3_5_text`, Qwen3_5ForCausalLM), noise on every vector (norms, A_log,
    dt_bias: HF initialises them alike, which would hide one in the wrong place)."""
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from testkit import build_tiny_text_model

    folder = build_tiny_text_model(
        tmp_path_factory.mktemp("tiny_qwen3_5_text"), Qwen3_5ForCausalLM, Qwen3_5TextConfig,
        num_hidden_layers=4, layer_types=["linear_attention", "linear_attention", "full_attention", "full_attention"],
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )  # fmt: skip
    model = Qwen3_5ForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.3)
    model.save_pretrained(folder)
    return folder, model, AutoTokenizer.from_pretrained(folder)


def test_text_model_matches_hf_over_long_prompts_in_chunks(qwen3_5_text):
    """Prompts of 150 and 9 tokens (the long one over three chunks of the delta rule, and over prefill chunks
    of 40 tokens): HF's logits after the prompt and its greedy tokens, batched together."""
    folder, hf_model, tokenizer = qwen3_5_text
    prompts = [" ".join(f"word{i % 17}" for i in range(30)), "A short prompt"]
    ids = [tokenizer.encode(p) for p in prompts]
    assert len(ids[0]) > 128 and len(ids[1]) < 16
    expected_logprobs, expected = [], []
    with torch.no_grad():
        for prompt_ids in ids:
            inputs = torch.tensor([prompt_ids])
            expected_logprobs.append(hf_model(inputs).logits[0, -1].log_softmax(-1))
            out = hf_model.generate(inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
            expected.append(out[0, len(prompt_ids) :].tolist())
    for options in ({}, {"max_num_batched_tokens": 40}):
        llm = LLM(str(folder), device="cpu", block_size=4, kv_cache_memory="4MiB", **options)
        results = greedy_logprobs(llm, [{"prompt_token_ids": i} for i in ids], MAX_TOKENS, hf_model.config.vocab_size)
        assert [tokens for tokens, _ in results] == expected
        for (_, logprobs), want in zip(results, expected_logprobs):
            torch.testing.assert_close(logprobs[0], want[: logprobs.shape[1]], atol=1e-4, rtol=0)


def test_another_question_about_the_same_image_starts_after_the_image(qwen3_5):
    """A new prompt that shares only the image with an earlier one continues from the snapshot taken at the
    last block boundary of the image (its tokens and vision encoding not recomputed); HF's answer."""
    folder, hf_processor, _, _ = qwen3_5
    hf_model = HFQwen3_5.from_pretrained(folder, attn_implementation="eager").eval()
    image = random_images([(50, 100)], seed=1)
    other = f"<|im_start|>user\n{IMAGE}Where is the square, and how big is it?<|im_end|>\n<|im_start|>assistant\n"
    llm = LLM(str(folder), device="cpu", block_size=4, kv_cache_memory="4MiB")
    tokens(llm, [{"prompt": ONE_IMAGE, "multi_modal_data": {"image": image}}])
    blocks = llm.engine.core.block_manager
    before = blocks.prefix_hits
    (got,) = tokens(llm, [{"prompt": other, "multi_modal_data": {"image": image}}])
    processed = MULTIMODAL_REGISTRY.create_processor(folder).apply(other, {"image": image})
    (placeholder,) = processed["mm_placeholders"]["image"]
    assert blocks.prefix_hits - before == (placeholder.offset + placeholder.length) // 4 * 4
    inputs = hf_processor(text=other, images=image, return_tensors="pt")
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
    assert got == out[0, inputs["input_ids"].shape[1] :].tolist()


def test_chat_with_a_clip_and_an_image_gets_hfs_answer(qwen3_5, tmp_path):
    """A clip file and an image through LLM.chat (the chat template, the video sampled to 6 frames with its
    timestamps): the prompt and the answer are HF's."""
    folder, hf_processor, _, _ = qwen3_5
    hf_model = HFQwen3_5.from_pretrained(folder, attn_implementation="eager").eval()
    path, image_path = tmp_path / "clip.mp4", tmp_path / "image.png"
    path.write_bytes(video_bytes(num_frames=24, width=32, height=32, fps=8))
    image = random_images([(60, 40)], seed=7)[0]
    image.save(image_path)
    decoded = decode_video(path.read_bytes(), num_frames=6)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(image_path)}},
                                             {"type": "video_url", "video_url": {"url": str(path)}},
                                             {"type": "text", "text": "Compare them."}]}]  # fmt: skip
    hf_messages = [{"role": "user", "content": [{"type": "image"}, {"type": "video"},
                                                {"type": "text", "text": "Compare them."}]}]  # fmt: skip
    text = hf_processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
    inputs = hf_inputs(hf_processor, text, {"image": [image], "video": [decoded]})
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
    llm = LLM(str(folder), device="cpu", kv_cache_memory="4MiB")
    (output,) = llm.chat(messages, GREEDY, use_tqdm=False, media_io_kwargs={"video": {"num_frames": 6}})
    assert output.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert output.outputs[0].token_ids == out[0, inputs["input_ids"].shape[1] :].tolist()


def test_gated_norm_matches_hf():
    from tessera.models.qwen3_5 import GatedRMSNorm

    torch.manual_seed(2)
    hf = hf_modeling.Qwen3_5RMSNormGated(8, eps=1e-6)
    ours = GatedRMSNorm(8, 1e-6)
    with torch.no_grad():
        hf.weight.normal_()
        ours.weight.copy_(hf.weight)
    x, gate = torch.randn(5, 3, 8), torch.randn(5, 3, 8)
    torch.testing.assert_close(ours(x, gate), hf(x, gate), atol=1e-6, rtol=1e-6)
