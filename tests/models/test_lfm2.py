"""LFM2 (hybrid: short gated convolutions + attention) against Hugging Face transformers on a tiny
checkpoint (fp32, layer types conv/attention/conv/attention, conv biases, an adjusted MLP width): prefill
logits, and greedy tokens alone, batched with a prompt of another length, in prefill chunks, under
preemption, and with a prefix-cache hit continuing from a snapshot of the conv state."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, Lfm2Config
from transformers import Lfm2ForCausalLM as HFLfm2

from tessera import LLM, SamplingParams
from tessera.models.lfm2 import feed_forward_width
from testkit import build_tiny_text_model
from testkit.generation import greedy_logprobs

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    """(folder, HF model, prompts' token ids, HF's last-token log-probs and greedy tokens per prompt); noise on
    every vector (norms, biases: HF initialises them alike, which would hide one in the wrong place)."""
    folder = build_tiny_text_model(
        tmp_path_factory.mktemp("tiny_lfm2"), HFLfm2, Lfm2Config, num_hidden_layers=4,
        layer_types=["conv", "full_attention", "conv", "full_attention"], conv_bias=True, conv_L_cache=3,
        intermediate_size=96, block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.2, block_multiple_of=16,
        norm_eps=1e-5, tie_word_embeddings=True,
    )  # fmt: skip
    model = HFLfm2.from_pretrained(folder).eval()
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.3)
    model.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = [tokenizer.encode(" ".join(f"word{i % 13}" for i in range(20))), tokenizer.encode("A short one")]
    expected = []
    with torch.no_grad():
        for prompt_ids in ids:
            inputs = torch.tensor([prompt_ids])
            logprobs = model(inputs).logits[0, -1].log_softmax(-1)
            out = model.generate(inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
            expected.append((logprobs, out[0, len(prompt_ids) :].tolist()))
    return folder, model, ids, expected


def test_the_mlp_width_is_hfs(lfm2):
    folder, model, _, _ = lfm2
    # 2/3 of 96 = 64; x 1.2 = 76; up to a multiple of 16: 80
    assert feed_forward_width(model.config) == model.model.layers[0].feed_forward.w1.out_features == 80


# 2 attention layers x K and V x 2 heads x 8 dims x 4 bytes = 256 bytes a token; the conv states of 4 sequences
# (2 layers x 32 channels x 2 x 4 bytes each) and 28 blocks of 4: the prompts (102 and 8 tokens: 26 + 2 blocks)
# start together, and the short one needs a third block at its first decode step
PREEMPTION = {"kv_cache_memory": 28 * 4 * 256 + 4 * 512, "max_num_seqs": 4, "enable_prefix_caching": False}


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 7}, PREEMPTION], ids=["", "chunked", "preempted"])
def test_logits_and_greedy_tokens_match_hf(lfm2, options):
    folder, model, ids, expected = lfm2
    llm = LLM(str(folder), device="cpu", block_size=4, **{"kv_cache_memory": "4MiB", **options})
    prompts = [{"prompt_token_ids": i} for i in ids]
    results = greedy_logprobs(llm, prompts, MAX_TOKENS, model.config.vocab_size)  # batched
    for (tokens, logprobs), (want_logprobs, want_tokens) in zip(results, expected):
        assert tokens == want_tokens
        torch.testing.assert_close(logprobs[0], want_logprobs, atol=1e-4, rtol=0)
    if options is PREEMPTION:
        assert llm.engine.core.scheduler.num_preemptions > 0
    for prompt, (_, want_tokens) in zip(prompts, expected):  # alone
        assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want_tokens


def test_a_longer_prompt_continues_from_the_snapshot_of_a_shorter_one(lfm2):
    """The second prompt extends the first: its state comes from the first one's snapshot, and its answer is
    still HF's."""
    folder, model, ids, _ = lfm2
    longer = ids[0] + ids[1]
    with torch.no_grad():
        out = model.generate(torch.tensor([longer]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
    llm = LLM(str(folder), device="cpu", block_size=4, kv_cache_memory="4MiB")
    llm.generate({"prompt_token_ids": ids[0]}, GREEDY, use_tqdm=False)
    assert llm.engine.core.block_manager.prefix_hits == 0
    (got,) = llm.generate({"prompt_token_ids": longer}, GREEDY, use_tqdm=False)
    assert got.outputs[0].token_ids == out[0, len(longer) :].tolist()
    assert llm.engine.core.block_manager.prefix_hits == len(ids[0]) // 4 * 4


def test_the_next_turn_continues_from_the_snapshot_in_the_answer(lfm2):
    """A prompt that repeats the last prompt and its answer (a chat's next turn) starts from the state at the
    last block boundary of the answer, not only of the prompt; its answer is still HF's."""
    folder, model, ids, _ = lfm2
    llm = LLM(str(folder), device="cpu", block_size=4, kv_cache_memory="4MiB")
    (first,) = llm.generate({"prompt_token_ids": ids[0]}, GREEDY, use_tqdm=False)
    answer = list(first.outputs[0].token_ids)
    following = ids[0] + answer + ids[1]
    with torch.no_grad():
        out = model.generate(torch.tensor([following]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
    blocks = llm.engine.core.block_manager
    (got,) = llm.generate({"prompt_token_ids": following}, GREEDY, use_tqdm=False)
    assert got.outputs[0].token_ids == out[0, len(following) :].tolist()
    computed = len(ids[0]) + len(answer) - 1  # the last sampled token is never run through the model
    assert blocks.prefix_hits == computed // 4 * 4 > len(ids[0])


def test_an_aborted_sequence_gives_its_state_row_back(lfm2):
    from tessera.engine.llm_engine import LLMEngine

    folder, _, ids, expected = lfm2
    engine = LLMEngine.from_options(str(folder), device="cpu", block_size=4, kv_cache_memory="4MiB", max_num_seqs=2)
    engine.add_request("a", {"prompt_token_ids": ids[0]}, GREEDY)
    engine.add_request("b", {"prompt_token_ids": ids[1]}, GREEDY)
    engine.step()
    assert engine.stats()["state_slots_used"] == 2
    engine.abort_request("a")
    engine.step()
    assert engine.stats()["state_slots_used"] == 1
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert outputs == {"b": expected[1][1]} and engine.stats()["state_slots_used"] == 0
