"""Text backbones through the engine: greedy tokens identical to Hugging Face generate alone, batched,
with chunked prefill, preemption and prefix caching (fp32, tiny random checkpoints built offline).
Windowed models get windows of 4 to 8 tokens and prompts of 13 to 20, so a wrong window shows."""

from __future__ import annotations

import pytest
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
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
MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
SMALL_CACHE_BLOCKS = 12  # of 4 tokens: one sequence fits, the four together do not

MODELS = {  # HF model class, config class, overrides of build_tiny_text_model's 2 layers, hidden 32, 4/2 heads
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, dict(rope_theta=1e6)),
    "qwen2-window": (
        Qwen2ForCausalLM, Qwen2Config, dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    ),
    "mistral-window": (MistralForCausalLM, MistralConfig, dict(sliding_window=4)),
    "qwen3-window": (
        Qwen3ForCausalLM, Qwen3Config, dict(head_dim=16, use_sliding_window=True, sliding_window=6, max_window_layers=0)
    ),
    "gemma3": (
        Gemma3ForCausalLM, Gemma3TextConfig, dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                                                  layer_types=["sliding_attention", "full_attention"])
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def backbone(tmp_path_factory):
    """name -> (checkpoint folder, HF's greedy tokens per prompt, its config), built once per name."""
    built = {}

    def get(name):
        if name not in built:
            hf_cls, config_cls, overrides = MODELS[name]
            folder = build_tiny_text_model(tmp_path_factory.mktemp(name), hf_cls, config_cls, **overrides)
            hf_model = hf_cls.from_pretrained(folder).eval()
            expected = hf_greedy_tokens(hf_model, build_tokenizer("llava"), PROMPTS, MAX_TOKENS)
            built[name] = (folder, expected, config_cls.from_pretrained(folder))
        return built[name]

    return get


def tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def small_cache(config):
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4  # k and v, fp32
    return SMALL_CACHE_BLOCKS * 4 * bytes_per_token


@pytest.mark.parametrize("options", ["default", "chunked-prefill", "preemption"])
@pytest.mark.parametrize("name", MODELS)
def test_greedy_matches_hf_alone_and_batched(backbone, name, options):
    folder, hf_tokens, config = backbone(name)
    kwargs = {
        "default": {},
        "chunked-prefill": {"block_size": 4, "max_num_batched_tokens": 6},
        # freeing out-of-window blocks off: all-windowed models would fit (tests/engine/test_window_blocks.py
        # covers preemption with it on)
        "preemption": {"block_size": 4, "kv_cache_memory": small_cache(config), "free_out_of_window_blocks": False},
    }[options]
    llm = LLM(str(folder), **{"kv_cache_memory": "8MiB", **kwargs})
    assert [tokens(llm, [p])[0] for p in PROMPTS] == hf_tokens
    assert tokens(llm, PROMPTS) == hf_tokens
    if options == "preemption":
        assert llm.engine.core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("name", MODELS)
def test_prefix_caching_gives_the_same_tokens(backbone, name):
    folder, hf_tokens, _ = backbone(name)
    llm = LLM(str(folder), kv_cache_memory="8MiB", block_size=4)
    assert tokens(llm, [PROMPTS[0]]) == [hf_tokens[0]]
    hits = llm.engine.core.block_manager.prefix_hits
    assert tokens(llm, [PROMPTS[0]]) == [hf_tokens[0]]
    assert llm.engine.core.block_manager.prefix_hits > hits
