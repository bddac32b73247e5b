"""Prefix-LM models (`is_mm_prefix_lm`, as Gemma 3): the tokens of one image attend to each other
both ways, whatever the chunking, caching or batching; an image never spans two prefill chunks, so
one longer than a step's token budget is refused at admission."""

from __future__ import annotations

import json
import shutil

import pytest

from tessera import LLM, ModelRegistry, SamplingParams
from tessera.models.llava import LlavaForConditionalGeneration
from testkit import random_images

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [
    {"prompt": "USER: <image>\nWhat is this? ASSISTANT:", "multi_modal_data": {"image": random_images([(40, 30)])}},
    {
        "prompt": "USER: <image><image>\nCompare. ASSISTANT:",
        "multi_modal_data": {"image": random_images([(32, 32), (50, 20)], seed=3)},
    },
    {"prompt": "USER: Hello there. ASSISTANT:", "multi_modal_data": {}},
]


class PrefixLMLlava(LlavaForConditionalGeneration):
    is_mm_prefix_lm = True


@pytest.fixture(scope="module")
def prefix_lm_dir(tiny_llava_dir, tmp_path_factory):
    ModelRegistry.register_model("PrefixLMLlava", PrefixLMLlava)
    folder = tmp_path_factory.mktemp("prefix_lm") / "model"
    shutil.copytree(tiny_llava_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["PrefixLMLlava"]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def make_llm(folder, **options):
    return LLM(str(folder), **{"device": "cpu", "block_size": 4, "kv_cache_memory": "8MiB", **options})


@pytest.fixture(scope="module")
def reference(prefix_lm_dir):
    llm = make_llm(prefix_lm_dir)
    return [tokens(llm, [p])[0] for p in PROMPTS]


def test_image_tokens_attend_both_ways(tiny_llava_dir, reference):
    causal = make_llm(tiny_llava_dir)
    ours = tokens(causal, PROMPTS)
    assert ours[2] == reference[2]  # text only: nothing to attend to both ways
    assert ours[:2] != reference[:2]  # the same weights, attending causally, answer otherwise


@pytest.mark.parametrize(
    "options",
    [{}, {"max_num_batched_tokens": 20}, {"kv_cache_memory": "24KiB"}],
    ids=["batched", "chunked", "preemption"],
)
def test_chunking_batching_and_preemption_do_not_change_the_answer(prefix_lm_dir, reference, options):
    llm = make_llm(prefix_lm_dir, **options)
    assert tokens(llm, PROMPTS) == reference
    assert llm.engine.core.scheduler_config.disable_chunked_mm_input
    if "kv_cache_memory" in options:
        assert llm.engine.core.scheduler.num_preemptions > 0


def test_a_prefix_cache_hit_ending_inside_an_image_gives_the_same_answer(prefix_lm_dir, reference):
    """The image sits at tokens [4, 20); a prompt that differs right after it shares blocks [0, 16)
    (block size 8) with the first, so its prefill starts inside the image."""
    image = PROMPTS[0]["multi_modal_data"]
    other = {"prompt": "USER: <image> Why? ASSISTANT:", "multi_modal_data": image}
    fresh = tokens(make_llm(prefix_lm_dir, block_size=8), [other])
    llm = make_llm(prefix_lm_dir, block_size=8)
    assert tokens(llm, PROMPTS[:1]) == reference[:1]
    hits = llm.engine.core.block_manager.prefix_hits
    assert tokens(llm, [other]) == fresh
    assert llm.engine.core.block_manager.prefix_hits == hits + 16  # tokens: the hit ends inside the image


def test_a_step_budget_below_one_image_is_refused_at_start(prefix_lm_dir):
    """The worst-case profile prompt meets the admission rule: an image (16 tokens in the tiny LLaVA)
    must fit one step, so the engine says so when it starts rather than stalling on the first image."""
    with pytest.raises(ValueError, match="takes 16 prompt tokens.*a step holds 12.*raise max_num_batched_tokens"):
        make_llm(prefix_lm_dir, max_num_batched_tokens=12)
