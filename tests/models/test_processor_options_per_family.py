"""mm_processor_kwargs on every family with size options, against Hugging Face transformers (offline, tiny
random checkpoints, fp32): set for the model (`LLM(folder, mm_processor_kwargs=...)`) or for one prompt (its
"mm_processor_kwargs"), an option gives the prompt ids HF's processor gives when called with the same option,
and the greedy tokens HF `generate` gives for those inputs. A prompt of the same picture without options, in
the same `generate` call, still gets HF's default ids and tokens: the processor cache never serves one
setting's result for another.

The options are JSON values (what a CLI or server user writes), chosen so that HF's own model runs
consistently with them, for an image whose token count they change (asserted from HF's outputs, so an
option that went unheard would fail); LLaVA-NeXT and LLaVA-OneVision have no such count option (their
tiling settings are also the model config's, which HF's model reads), so theirs change the pixel values,
and HF's greedy tokens with and without them differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from tessera import LLM, SamplingParams
from testkit import random_images
from testkit.gemma3 import PAN_AND_SCAN, build_tiny_gemma3
from testkit.idefics3 import build_tiny_idefics3, build_tiny_smolvlm
from testkit.internvl import build_tiny_internvl
from testkit.llava_next import build_tiny_llava_next, build_tiny_llava_onevision
from testkit.mistral3 import build_tiny_mistral3
from testkit.qwen_vl import build_tiny_qwen2_5_vl, build_tiny_qwen2_vl, build_tiny_qwen3_vl

MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
QWEN = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n<|im_start|>assistant\n"
IDEFICS3 = "User:<image>What is it?<end_of_utterance>\nAssistant:"
TOKENS_PER_16PX = 16 * 16  # Qwen-VL here: 8-pixel patches merged 2x2, one token per 16x16 pixels

pytestmark = pytest.mark.filterwarnings(  # HF's own call with Qwen-VL's min_pixels / max_pixels, still taken
    "ignore:Passing `min_pixels` and `max_pixels` to a processor call is deprecated:FutureWarning"
)


@dataclass(frozen=True)
class Case:
    options: dict[str, Any]
    size: tuple[int, int]  # (width, height) of the picture the options change
    changes_count: bool = True  # else the options change the pixel values (and HF's greedy tokens)


@dataclass(frozen=True)
class Family:
    build: Callable[..., Any]
    prompt: str
    cases: dict[str, Case]


FAMILIES = {
    "qwen2_vl": Family(build_tiny_qwen2_vl, QWEN, {
        "max_pixels": Case({"max_pixels": 4 * TOKENS_PER_16PX}, (100, 80)),  # 9 image tokens -> 2
        "size": Case({"size": {"shortest_edge": 256, "longest_edge": 6 * TOKENS_PER_16PX}}, (100, 80)),  # -> 4
    }),
    "qwen2_5_vl": Family(build_tiny_qwen2_5_vl, QWEN, {
        "min_pixels": Case({"min_pixels": 8 * TOKENS_PER_16PX}, (20, 20)),  # 1 image token -> 9
        "size": Case({"size": {"shortest_edge": 6 * TOKENS_PER_16PX, "longest_edge": 3072}}, (20, 20)),
    }),
    "qwen3_vl": Family(build_tiny_qwen3_vl, QWEN, {
        "max_pixels": Case({"max_pixels": 4 * TOKENS_PER_16PX}, (100, 80)),
        "size": Case({"size": {"shortest_edge": 256, "longest_edge": 6 * TOKENS_PER_16PX}}, (100, 80)),
    }),
    # the tiles' size and grid are the model config's too: a resize before the 32-pixel centre crop
    "llava_next": Family(build_tiny_llava_next, "USER: <image>\nWhat is it? ASSISTANT:", {
        "size": Case({"size": {"shortest_edge": 48}}, (60, 40), changes_count=False),
    }),
    "llava_onevision": Family(
        build_tiny_llava_onevision, "<|im_start|>user\n<image>\nWhat is it?<|im_end|>\n<|im_start|>assistant\n", {
            "normalize": Case({"image_mean": [0.2, 0.4, 0.6], "image_std": [0.3, 0.3, 0.3]}, (60, 40), False),
        },
    ),
    "idefics3": Family(build_tiny_idefics3, IDEFICS3, {
        "size": Case({"size": {"longest_edge": 64}}, (100, 80)),  # 9 tiles and the image -> 4 and it
        "no-splitting": Case({"do_image_splitting": False}, (100, 80)),  # the global image alone
    }),
    "smolvlm": Family(build_tiny_smolvlm, IDEFICS3, {
        "size": Case({"size": {"longest_edge": 64}}, (100, 80)),
        "no-splitting": Case({"do_image_splitting": False}, (100, 80)),
    }),
    # Gemma3Processor's call defaults (crops of 256+ pixels) override the image processor's own: all are given
    "gemma3": Family(build_tiny_gemma3, "Describe.<start_of_image>What is it?", {
        "pan-and-scan": Case({"do_pan_and_scan": True, **PAN_AND_SCAN}, (200, 30)),  # the image -> it and 3 crops
        "pan-and-scan-2": Case({"do_pan_and_scan": True, **PAN_AND_SCAN, "pan_and_scan_max_num_crops": 2}, (200, 30)),
    }),
    "mistral3": Family(build_tiny_mistral3, "Describe.[IMG]What is it?", {
        "size": Case({"size": {"longest_edge": 24}}, (100, 80)),  # 6x5 patch tokens (merged) -> 3x3
    }),
    # InternVLProcessor crops to tiles by default (its call default), up to the image processor's 4
    "internvl": Family(build_tiny_internvl, "Describe.<IMG_CONTEXT>What is it?", {
        "max-patches": Case({"max_patches": 2}, (200, 30)),  # 4 tiles and a thumbnail -> 2 and it
        "no-crop": Case({"crop_to_patches": False}, (100, 80)),  # 4 tiles and a thumbnail -> one image
    }),
}  # fmt: skip
CASES = [(family, case) for family, spec in FAMILIES.items() for case in spec.cases]


class HFReference:
    """HF's processor and model for one family's folder, and its ids and greedy tokens per (size, options)."""

    def __init__(self, folder, prompt: str) -> None:
        self.prompt = prompt
        self.processor = AutoProcessor.from_pretrained(folder)
        self.model = AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="eager").eval()
        self._runs: dict[tuple, tuple[Any, list[int]]] = {}

    def run(self, size: tuple[int, int], options: dict[str, Any]) -> tuple[Any, list[int]]:
        """(HF's processor called on the prompt and the picture of `size` with `options`; HF's greedy tokens)."""
        key = (size, repr(sorted(options.items())))
        if key not in self._runs:
            inputs = self.processor(text=self.prompt, images=picture(size), return_tensors="pt", **options)
            with torch.no_grad():
                out = self.model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
            self._runs[key] = (inputs, out[0, inputs["input_ids"].shape[1] :].tolist())
        return self._runs[key]

    def ids(self, size, options) -> list[int]:
        return self.run(size, options)[0]["input_ids"][0].tolist()

    def tokens(self, size, options) -> list[int]:
        return self.run(size, options)[1]


def picture(size: tuple[int, int]):
    (image,) = random_images([size], seed=1)
    return image


def make_llm(folder, **options) -> LLM:
    return LLM(str(folder), device="cpu", block_size=4, kv_cache_memory="16MiB", limit_mm_per_prompt={"image": 1},
               **options)  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each family's tiny checkpoint, built on first use."""
    built: dict[str, Any] = {}

    def get(family: str):
        if family not in built:
            built[family] = FAMILIES[family].build(tmp_path_factory.mktemp(family))
        return built[family]

    return get


@pytest.fixture(scope="module")
def hf(folders):
    """Each family's HFReference, made on first use."""
    refs: dict[str, HFReference] = {}

    def get(family: str) -> HFReference:
        if family not in refs:
            refs[family] = HFReference(folders(family), FAMILIES[family].prompt)
        return refs[family]

    return get


@pytest.fixture(scope="module")
def plain_llm(folders):
    """One LLM per family without mm_processor_kwargs, shared by that family's per-request cases."""
    llms: dict[str, LLM] = {}

    def get(family: str) -> LLM:
        if family not in llms:
            llms[family] = make_llm(folders(family))
        return llms[family]

    yield get
    for llm in llms.values():
        llm.shutdown()


def expected(ref: HFReference, case: Case) -> tuple[list[int], list[int]]:
    """HF's (ids, greedy tokens) with the case's options; asserted to differ from HF's default where the
    options should make a difference (the token count; else the pixel values and so the greedy tokens)."""
    ids, tokens = ref.ids(case.size, case.options), ref.tokens(case.size, case.options)
    default_inputs, default_tokens = ref.run(case.size, {})
    if case.changes_count:
        assert len(ids) != len(default_inputs["input_ids"][0]), "the options leave HF's token count as it is"
    else:
        assert ids == default_inputs["input_ids"][0].tolist()
        assert not torch.equal(ref.run(case.size, case.options)[0]["pixel_values"], default_inputs["pixel_values"])
        assert tokens != default_tokens, "HF's greedy tokens do not tell the options from the default"
    return ids, tokens


def request(family: str, case: Case, options: dict[str, Any] | None = None) -> dict[str, Any]:
    prompt = {"prompt": FAMILIES[family].prompt, "multi_modal_data": {"image": picture(case.size)}}
    return prompt if options is None else {**prompt, "mm_processor_kwargs": options}


@pytest.mark.parametrize("family,case", CASES, ids=[f"{f}-{c}" for f, c in CASES])
def test_model_level_options_give_hf_ids_and_tokens(folders, hf, family, case):
    spec = FAMILIES[family].cases[case]
    want_ids, want_tokens = expected(hf(family), spec)
    llm = make_llm(folders(family), mm_processor_kwargs=spec.options)
    try:
        (out,) = llm.generate([request(family, spec)], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert out.prompt_token_ids == want_ids
    assert out.outputs[0].token_ids == want_tokens


@pytest.mark.parametrize("family,case", CASES, ids=[f"{f}-{c}" for f, c in CASES])
def test_request_options_give_hf_ids_and_tokens_beside_the_default(hf, plain_llm, family, case):
    """The same picture without, with and again without the options in one call: each gets HF's answer for
    its setting. (The default first: a Gemma 3 pan-and-scan item starts with the whole image, so its default
    prompt served the cropped item's first crop would still answer right; its cropped prompt served the
    default item would not.)"""
    spec = FAMILIES[family].cases[case]
    ref = hf(family)
    want_ids, want_tokens = expected(ref, spec)
    default = request(family, spec)
    before, with_options, after = plain_llm(family).generate(
        [default, request(family, spec, spec.options), default], GREEDY, use_tqdm=False
    )
    assert with_options.prompt_token_ids == want_ids
    assert with_options.outputs[0].token_ids == want_tokens
    for without in (before, after):
        assert without.prompt_token_ids == ref.ids(spec.size, {})
        assert without.outputs[0].token_ids == ref.tokens(spec.size, {})
