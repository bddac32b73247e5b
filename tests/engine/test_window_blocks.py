"""Releasing KV blocks that fell out of every layer's window (CacheConfig.free_out_of_window_blocks):
greedy tokens stay those of Hugging Face generate (fp32 tiny random Mistral, prompts longer than the
window, 40 tokens generated), each running sequence holds only its window's blocks while it decodes,
and a small cache preempts less. Models with a full-attention layer keep every block."""

from __future__ import annotations

import pytest
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

from tessera import LLM, SamplingParams
from testkit import build_tiny_text_model, build_tokenizer
from testkit.generation import hf_greedy_tokens

PROMPTS = [
    "How many squares are there in the picture?",
    "The circle is red and the square is blue.",
    "A b c d e f g h",
    "one two three four five six seven eight nine ten eleven",
]
PROMPTS += [" ".join(reversed(p.split())) for p in PROMPTS]
MAX_TOKENS = 40
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
WINDOWS = [8, 6]  # 6: not a multiple of the block size, a window straddles blocks
BS = 4
BYTES_PER_TOKEN = 2 * 2 * 2 * 8 * 4  # k and v, 2 layers, 2 KV heads of 8 (hidden 32 / 4 heads), fp32
SMALL_CACHE_BLOCKS = {8: 17, 6: 18}  # blocks of 4 tokens: with freeing on, the 8 sequences still preempt


@pytest.fixture(scope="module", params=WINDOWS, ids=[f"window{w}" for w in WINDOWS])
def mistral(request, tmp_path_factory):
    """(checkpoint folder, HF's greedy tokens per prompt, window)."""
    window = request.param
    folder = build_tiny_text_model(
        tmp_path_factory.mktemp("mistral"), MistralForCausalLM, MistralConfig, sliding_window=window
    )
    return folder, hf_greedy(MistralForCausalLM, folder, window), window


def hf_greedy(hf_cls, folder, window):
    tokenizer = build_tokenizer("llava")
    assert all(len(tokenizer.encode(p)) > window for p in PROMPTS)  # every prompt outgrows the window
    return hf_greedy_tokens(hf_cls.from_pretrained(folder).eval(), tokenizer, PROMPTS, MAX_TOKENS)


def run(llm, prompts):
    """Greedy tokens per prompt, stepping the engine; returns them and the most blocks a sequence
    held. With a window, checks that a decoding sequence never holds more blocks than its window
    needs: once its step is scheduled (its block allocated; also at admission with a cached prefix,
    whose blocks before the window go back at once), and after each step."""
    engine, manager = llm.engine, llm.engine.core.block_manager
    bound = -(-(engine.core.kv_window + BS) // BS) + 1 if engine.core.kv_window is not None else None
    schedule = engine.core.scheduler.schedule

    def checked_schedule():
        out = schedule()
        for step in out.scheduled:
            if bound is not None and step.num_new_tokens == 1:
                held = len(manager.live_blocks_of(step.request))
                assert held <= bound, (step.request.request_id, step.request.num_computed_tokens, held)
        return out

    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    outputs, most = {}, 0
    engine.core.scheduler.schedule = checked_schedule
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                outputs[output.request_id] = output
            for request in engine.core.scheduler.running:
                held = len(manager.live_blocks_of(request))
                most = max(most, held)
                if bound is not None and request.output_token_ids:
                    assert held <= bound, (request.request_id, request.num_computed_tokens, held)
    finally:
        del engine.core.scheduler.schedule
    assert manager.num_free_blocks == engine.core.num_blocks
    assert all(count == 0 for count in manager.ref_counts)
    return [outputs[str(i)].outputs[0].token_ids for i in range(len(prompts))], most


def test_the_model_kv_window_is_its_largest_window_only_if_every_layer_has_one(mistral):
    folder, _, window = mistral
    assert LLM(str(folder), kv_cache_memory="1MiB").engine.core.kv_window == window
    assert LLM(str(folder), kv_cache_memory="1MiB", free_out_of_window_blocks=False).engine.core.kv_window is None


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 6},  # chunked prefill: prompt chunks release blocks too
        {"kv_cache_memory": "small"},  # the eight sequences preempt each other
    ],
    ids=["default", "chunked-prefill", "preemption"],
)
def test_greedy_matches_hf_alone_and_batched_with_blocks_released(mistral, options):
    folder, hf_tokens, window = mistral
    if options.get("kv_cache_memory") == "small":
        options = {"kv_cache_memory": SMALL_CACHE_BLOCKS[window] * BS * BYTES_PER_TOKEN}
    llm = LLM(str(folder), **{"kv_cache_memory": "1MiB", "block_size": BS, **options})
    for prompt, expected in zip(PROMPTS, hf_tokens):
        assert run(llm, [prompt])[0] == [expected]
    assert run(llm, PROMPTS)[0] == hf_tokens
    if "kv_cache_memory" in options:
        assert llm.engine.core.scheduler.num_preemptions > 0


def test_prefix_caching_reuses_released_blocks(mistral):
    folder, hf_tokens, _ = mistral
    llm = LLM(str(folder), kv_cache_memory="1MiB", block_size=BS)
    assert run(llm, [PROMPTS[0]])[0] == [hf_tokens[0]]
    hits = llm.engine.core.block_manager.prefix_hits
    assert run(llm, [PROMPTS[0]])[0] == [hf_tokens[0]]  # its prompt's blocks were released, still cached
    assert llm.engine.core.block_manager.prefix_hits > hits


def test_freeing_fits_more_sequences_in_a_small_cache(mistral):
    folder, hf_tokens, window = mistral

    def preemptions(free):
        llm = LLM(str(folder), kv_cache_memory=SMALL_CACHE_BLOCKS[window] * BS * BYTES_PER_TOKEN, block_size=BS,
                  free_out_of_window_blocks=free)  # fmt: skip
        tokens, most = run(llm, PROMPTS)
        assert tokens == hf_tokens
        return llm.engine.core.scheduler.num_preemptions, most

    (on, most_on), (off, most_off) = preemptions(True), preemptions(False)
    assert on < off
    assert most_on < most_off


@pytest.mark.parametrize(
    "hf_cls, config_cls, overrides",
    [
        (LlamaForCausalLM, LlamaConfig, {}),
        (Gemma3ForCausalLM, Gemma3TextConfig, dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                                                   layer_types=["sliding_attention", "full_attention"])),
    ],
    ids=["llama", "gemma3"],
)  # fmt: skip
def test_a_model_with_a_full_attention_layer_keeps_every_block(tmp_path, hf_cls, config_cls, overrides):
    folder = build_tiny_text_model(tmp_path, hf_cls, config_cls, **overrides)
    llm = LLM(str(folder), kv_cache_memory="1MiB", block_size=BS)
    assert llm.engine.core.kv_window is None
    engine = llm.engine
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        for request in engine.core.scheduler.running:
            blocks = engine.core.block_manager.live_blocks_of(request)
            assert blocks == engine.core.block_manager.blocks_of(request)
            assert len(blocks) == -(-request.num_computed_tokens // BS)
