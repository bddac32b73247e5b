"""Routed experts (layers/fused_moe.py) and the MoE VLMs on them, against Hugging Face transformers on tiny
checkpoints (fp32, 8 experts, top-2): Qwen3-VL-MoE (a dense first layer, then routed experts; its experts as
transformers saves them and as the released files hold them, transposed) and Qwen3.5-MoE (a shared expert
in every hybrid layer; experts saved one by one): prefill logits, greedy tokens alone, batched, chunked, from
the prefix cache and under preemption; and the count of experts a step runs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from tessera import LLM, SamplingParams
from tessera.layers.fused_moe import FusedMoE, sigmoid_top_k, softmax_top_k
from testkit import random_images
from testkit.generation import greedy_logprobs
from testkit.qwen_vl import build_tiny_qwen3_5, build_tiny_qwen3_vl_moe

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
ONE_IMAGE = f"<|im_start|>user\n{IMAGE}What colour is the circle?<|im_end|>\n<|im_start|>assistant\n"
TEXT = "<|im_start|>user\nTell me about the experts, all of them.<|im_end|>\n<|im_start|>assistant\n"
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
BUILDERS = {
    "qwen3_vl_moe": lambda folder: build_tiny_qwen3_vl_moe(folder),
    "qwen3_vl_moe-released-layout": lambda folder: build_tiny_qwen3_vl_moe(folder, released_layout=True),
    "qwen3_5_moe": lambda folder: build_tiny_qwen3_5(folder, moe=True),
}


def requests():
    return [
        {"prompt": ONE_IMAGE, "multi_modal_data": {"image": random_images([(50, 100)], seed=1)}},
        {"prompt": TEXT},
    ]


def test_experts_compute_what_a_loop_over_tokens_computes():
    """First principles: each token's output is the weighted sum of its chosen experts' gated MLPs."""
    torch.manual_seed(0)
    moe = FusedMoE(num_experts=8, top_k=2, hidden_size=16, intermediate_size=12)
    with torch.no_grad():
        moe.gate_up_proj.normal_(0, 0.3)
        moe.down_proj.normal_(0, 0.3)
    x, logits = torch.randn(5, 16), torch.randn(5, 8)
    weights, ids = softmax_top_k(logits, 2)
    assert torch.allclose(weights.sum(-1), torch.ones(5))
    expected = torch.zeros_like(x)
    for t in range(5):
        for w, e in zip(weights[t], ids[t]):
            gate, up = (moe.gate_up_proj[e] @ x[t]).chunk(2)
            expected[t] += w * (moe.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    with torch.no_grad():
        torch.testing.assert_close(moe(x, weights, ids), expected)
    assert moe.experts_run == len(set(ids.flatten().tolist())) < 8  # five tokens, top-2: some expert idle
    from tessera.layers import native_kernels
    from tessera.layers.linear import pack_linears_for_cpu

    moe.split_experts()  # each expert as two Linears over the loaded weights, which the layer then drops
    assert len(moe.gate_up) == len(moe.down) == 8 and moe.gate_up_proj.numel() == 0
    with torch.no_grad():
        torch.testing.assert_close(moe(x, weights, ids), expected)
    if native_kernels.available():  # packed for the native GEMV, as the engine packs its CPU linears
        assert pack_linears_for_cpu(moe, mode="auto") == 16 and all(m.weight.numel() == 0 for m in moe.gate_up)
        with torch.no_grad():
            torch.testing.assert_close(moe(x, weights, ids), expected, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def moe_model(request, tmp_path_factory):
    """(name, folder, HF's last-token log-probs for the image request, HF's greedy tokens per request)."""
    folder = BUILDERS[request.param](tmp_path_factory.mktemp(request.param))
    hf_model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    processor = AutoProcessor.from_pretrained(folder)
    expected = []
    with torch.no_grad():
        for i, r in enumerate(requests()):
            images = r.get("multi_modal_data", {}).get("image")
            inputs = processor(text=r["prompt"], images=images, return_tensors="pt")
            if i == 0:
                logprobs = hf_model(**inputs).logits[0, -1].log_softmax(-1)
            out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
            expected.append(out[0, inputs["input_ids"].shape[1] :].tolist())
    return request.param, folder, logprobs, expected


def test_prefill_logits_match_hf(moe_model):
    _, folder, expected, _ = moe_model
    llm = LLM(str(folder), device="cpu", block_size=4, kv_cache_memory="4MiB")
    ((_, logprobs),) = greedy_logprobs(llm, requests()[:1], 1, expected.shape[0])
    torch.testing.assert_close(logprobs[0], expected, atol=1e-4, rtol=0)


# KV bytes a token (attention layers x K and V x 2 heads x head_dim x 4 bytes) and the DeltaNet states of 4
# sequences (Qwen3.5: 2 layers x (conv [64, 3] + recurrent [4, 8, 8]) fp32 each)
KV_BYTES = {"qwen3_vl_moe": (3 * 2 * 2 * 8 * 4, 0), "qwen3_5_moe": (2 * 2 * 2 * 16 * 4, 4 * 2 * (64 * 3 + 256) * 4)}


@pytest.mark.parametrize("options", ["default", "chunked-prefill", "prefix-caching", "preemption"])
def test_greedy_tokens_match_hf_alone_and_batched(moe_model, options):
    name, folder, _, expected = moe_model
    probe = LLM(str(folder), device="cpu", kv_cache_memory="4MiB")
    lengths = [len(probe.engine.input_preprocessor.process(r, GREEDY).token_ids) for r in requests()]
    per_token, states = KV_BYTES[name.removesuffix("-released-layout")]
    kwargs = {
        "default": {"enable_prefix_caching": False},
        "chunked-prefill": {"max_num_batched_tokens": 7, "enable_prefix_caching": False},
        "prefix-caching": {},
        # blocks of 4 for exactly the two prompts: both start, and generating needs a block only a preemption frees
        "preemption": {"kv_cache_memory": sum(-(-n // 4) for n in lengths) * 4 * per_token + states,
                       "max_num_seqs": 4, "enable_prefix_caching": False},
    }[options]  # fmt: skip
    llm = LLM(str(folder), device="cpu", block_size=4, **{"kv_cache_memory": "4MiB", **kwargs})
    assert [tokens(llm, [r])[0] for r in requests()] == expected
    hits = llm.engine.core.block_manager.prefix_hits
    assert tokens(llm, requests()) == expected  # batched: an image request and a text one
    if options == "prefix-caching":
        assert llm.engine.core.block_manager.prefix_hits > hits
    if options == "preemption":
        assert llm.engine.core.scheduler.num_preemptions > 0


def tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_a_decode_step_runs_only_the_routed_experts(moe_model):
    """One sequence decoding: a decode step of one token runs exactly top-k experts in each MoE layer."""
    _, folder, _, _ = moe_model
    llm = LLM(str(folder), device="cpu", kv_cache_memory="4MiB", enable_prefix_caching=False)
    layers = [m for m in llm.engine.core.model.modules() if isinstance(m, FusedMoE)]
    assert layers
    runs = []
    for max_tokens in (1, 6):  # the same prefill, then 5 decode steps more
        before = [m.experts_run for m in layers]
        llm.generate(TEXT, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
        runs.append([m.experts_run - b for m, b in zip(layers, before)])
    assert [b - a for a, b in zip(*runs)] == [5 * m.top_k for m in layers]


@pytest.fixture(scope="module")
def qwen3_moe_text(tmp_path_factory):
    """A tiny Qwen3-MoE text model (layer 0 dense by decoder_sparse_step 2, layer 1 routed; top-k weights not
    renormalised, as norm_topk_prob False says), HF's greedy tokens for two prompts."""
    from transformers import Qwen3MoeConfig
    from transformers import Qwen3MoeForCausalLM as HFQwen3Moe

    from testkit import build_tokenizer
    from testkit.checkpoints import save_widened_random_weights
    from testkit.generation import hf_greedy_tokens

    folder = tmp_path_factory.mktemp("qwen3_moe")
    tokenizer = build_tokenizer("qwen")
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=24, decoder_sparse_step=2, norm_topk_prob=False, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    save_widened_random_weights(HFQwen3Moe, config, folder, seed=0)
    tokenizer.save_pretrained(folder)
    hf_model = HFQwen3Moe.from_pretrained(folder).eval()
    prompts = ["The experts of a mixture are", "One two three four five six seven"]
    return folder, config, prompts, hf_greedy_tokens(hf_model, tokenizer, prompts, MAX_TOKENS)


@pytest.mark.parametrize("case", ["default", "chunked-prefill", "prefix-caching", "preemption"])
def test_qwen3_moe_text_greedy_tokens_match_hf(qwen3_moe_text, case):
    from testkit.generation import assert_engine_case_happened, engine_case_options

    folder, config, prompts, expected = qwen3_moe_text
    probe = LLM(str(folder), device="cpu", kv_cache_memory="4MiB")
    lengths = [len(probe.get_tokenizer().encode(p)) for p in prompts]
    options = engine_case_options(case, text_config=config, prompt_lens=lengths, chunk=3)
    llm = LLM(str(folder), device="cpu", block_size=4, **{"kv_cache_memory": "4MiB", **options})
    assert [tokens(llm, [p])[0] for p in prompts] == expected
    hits = llm.engine.core.block_manager.prefix_hits
    assert tokens(llm, prompts) == expected
    assert_engine_case_happened(llm, case, hits)
    layers = [m for m in llm.engine.core.model.modules() if isinstance(m, FusedMoE)]
    assert len(layers) == 1 and llm.engine.core.model.model.layers[1].mlp.renormalize is False


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_experts_compute_with_their_dequantized_weights(qwen3_moe_text, method):
    """Experts quantize as the model's other linears do (one int8/int4 layer per expert projection, through the
    same kernels); the MoE block then equals HF's with each expert's weights replaced by their de-quantized values
    (int4 groups of 32 inputs: the down projections, 24 inputs wide, keep their float weights)."""
    from transformers import Qwen3MoeForCausalLM as HFQwen3Moe

    from tessera.layers.quantization import dequantized_weight

    folder, _, _, _ = qwen3_moe_text
    llm = LLM(str(folder), device="cpu", dtype="float32", kv_cache_memory="4MiB", quantization=method)
    block = llm.engine.core.model.model.layers[1].mlp
    experts = block.experts
    assert all(layer.quantization == method for layer in experts.gate_up)
    assert all((layer.qweight is not None) == (method == "int8") for layer in experts.down)
    hf_block = HFQwen3Moe.from_pretrained(folder).eval().model.layers[1].mlp
    with torch.no_grad():
        for j in range(experts.num_experts):
            hf_block.experts.gate_up_proj[j] = dequantized_weight(experts.gate_up[j]).float()
            if experts.down[j].qweight is not None:  # (a float layer keeps the checkpoint's weights, as HF's)
                hf_block.experts.down_proj[j] = dequantized_weight(experts.down[j]).float()
        x = torch.randn(7, hf_block.gate.weight.shape[1], generator=torch.Generator().manual_seed(0))
        expected = hf_block(x[None])
        expected = expected[0] if isinstance(expected, tuple) else expected
        torch.testing.assert_close(block(x), expected[0], atol=1e-4, rtol=1e-4)


def test_sigmoid_scoring_chooses_by_biased_scores_and_weights_by_plain_ones():
    """First principles for sigmoid routers: the k best of sigmoid(logit) + bias are chosen, each weighted by its
    unbiased sigmoid score, renormalised over the k when asked."""
    logits = torch.tensor([[2.0, 0.0, -1.0, 1.0]])
    bias = torch.tensor([0.0, 0.9, 0.0, 0.0])  # lifts expert 1 (0.5 + 0.9) above expert 3 (0.73)
    weights, ids = sigmoid_top_k(logits, 2, renormalize=False, correction_bias=bias)
    assert ids.tolist() == [[1, 0]]
    torch.testing.assert_close(weights, torch.sigmoid(torch.tensor([[0.0, 2.0]])))
    weights, ids = sigmoid_top_k(logits, 2)
    expected = torch.sigmoid(torch.tensor([2.0, 1.0]))
    assert ids.tolist() == [[0, 3]]
    torch.testing.assert_close(weights[0], expected / expected.sum())
