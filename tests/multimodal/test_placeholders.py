"""Placeholder discovery and full placement (token path, text fallback, Tessera's refusals).

Discovery cases are vLLM 0.9's test_find_mm_placeholders; placement cases state vLLM's rules
(docs/vllm-compatibility.md lists where Tessera deliberately raises instead).
"""

from __future__ import annotations

import pytest

from tessera.multimodal.placeholders import apply_prompt_updates, find_placeholders, place_items
from tessera.multimodal.prompt_matching import resolve_updates
from tessera.multimodal.prompt_updates import (
    PromptIndexTargets,
    PromptInsertion,
    PromptReplacement,
    PromptUpdateDetails,
    TokenCodec,
)
from testkit import build_tokenizer

IMG = 512  # "<image>"; the other ids are ordinary tokens of the llava fixture tokenizer
A, B, C, HI = 43, 288, 28, 340  # "I", "mage", ":", "hi"


@pytest.fixture(scope="module")
def codec():
    return TokenCodec(build_tokenizer("llava"))


def spans(placeholders):
    return {
        m: [(p.offset, p.length, None if p.is_embed is None else p.is_embed.tolist()) for p in ranges]
        for m, ranges in placeholders.items()
        if ranges
    }


# ---- discovery ---------------------------------------------------------------------------------

CONTENTS = {"p1": [32000, 32000], "p2": [], "p3": [1550, 918, 1550], "p4": [32000]}  # p4 shares p1's token


@pytest.mark.parametrize("update_type", [PromptInsertion, PromptReplacement])
@pytest.mark.parametrize(
    "prompt, expected",
    [
        ([1, 9833, 28747, 32000, 9833, 28747, 32000, 32000, 918], {"p1": [(6, 2, None)], "p4": [(3, 1, None)]}),
        (  # p4 finds nothing: p1 is declared first and claims every 32000 run
            [1, 32000, 32000, 9833, 28747, 32000, 32000, 1550, 918, 1550],
            {"p1": [(1, 2, None), (5, 2, None)], "p3": [(7, 3, None)]},
        ),
        (
            [1, 32000, 32000, 32000, 32000, 32000, 1550, 918, 1550],
            {"p1": [(1, 2, None), (3, 2, None)], "p4": [(5, 1, None)], "p3": [(6, 3, None)]},
        ),
    ],
)
def test_find_placeholders_is_one_exclusive_scan(codec, update_type, prompt, expected):
    updates = [update_type(key, [], content) for key, content in CONTENTS.items()]
    resolved = resolve_updates(updates, dict.fromkeys(CONTENTS, 3), codec)
    assert spans(find_placeholders(prompt, resolved)) == expected


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ([A, 8, 8, B, 8, 8, 8, C], [(1, 2, None), (4, 3, None)]),
        ([A, 8, 8, 8, B, 8, 8], [(1, 2, None)]),  # item 1 ([8, 8, 8]) must come after item 0's run
        ([8, 8, 8, A], [(0, 2, None)]),  # partial: only item 0
        ([A, B], []),
    ],
)
def test_find_placeholders_finds_items_in_item_order_and_reports_partial_results(codec, prompt, expected):
    resolved = resolve_updates([PromptReplacement("image", [IMG], lambda i: [8] * (i + 2))], {"image": 2}, codec)
    assert [(p.offset, p.length, p.is_embed) for p in find_placeholders(prompt, resolved)["image"]] == expected


def test_find_placeholders_skips_claimed_spans_and_keeps_is_embed(codec):
    content = PromptUpdateDetails.select_token_id([IMG, IMG, C], IMG)
    resolved = resolve_updates([PromptReplacement("image", [IMG], content)], {"image": 1}, codec)
    prompt = [IMG, IMG, C, A, IMG, IMG, C]
    assert spans(find_placeholders(prompt, resolved)) == {"image": [(0, 3, [True, True, False])]}
    assert spans(find_placeholders(prompt, resolved, claimed=[(1, 2)])) == {"image": [(4, 3, [True, True, False])]}


# ---- applying updates, with the text fallback ----------------------------------------------------

PER_ITEM = lambda base: lambda i: [base + i] * (i + 1)  # noqa: E731  (item i: i + 1 tokens)

APPLY_CASES = [
    # (prompt, updates, counts, expected ids, expected placeholders)
    (  # replacement: item i takes the i-th match
        [A, IMG, B, IMG, C],
        [PromptReplacement("image", [IMG], PER_ITEM(100))],
        {"image": 2},
        [A, 100, B, 101, 101, C],
        {"image": [(1, 1, None), (3, 2, None)]},
    ),
    (  # insertion: every item after the first match, in item order; the second match stays bare
        [A, IMG, B, IMG],
        [PromptInsertion("image", [IMG], PER_ITEM(50))],
        {"image": 2},
        [A, IMG, 50, 51, 51, B, IMG],
        {"image": [(2, 1, None), (3, 2, None)]},
    ),
    (  # a replacement at an index target takes every item there
        [A, B],
        [PromptReplacement("image", PromptIndexTargets.start(), PER_ITEM(60))],
        {"image": 3},
        [60, 61, 61, 62, 62, 62, A, B],
        {"image": [(0, 1, None), (1, 2, None), (3, 3, None)]},
    ),
    (
        [A, B],
        [PromptReplacement("image", PromptIndexTargets.prefix([A]), PER_ITEM(60))],
        {"image": 2},
        [A, 60, 61, 61, B],
        {"image": [(1, 1, None), (2, 2, None)]},
    ),
    (
        [A, B],
        [PromptInsertion("image", PromptIndexTargets.end(), PER_ITEM(60))],
        {"image": 2},
        [A, B, 60, 61, 61],
        {"image": [(2, 1, None), (3, 2, None)]},
    ),
    (  # two modalities, listed by item, with is_embed
        [C, IMG, C, IMG],
        [
            PromptReplacement("image", [IMG], PromptUpdateDetails.select_token_id([IMG, IMG, B], IMG)),
            PromptReplacement("audio", [C], lambda i: [200 + i, 200 + i]),
        ],
        {"image": 2, "audio": 2},
        [200, 200, IMG, IMG, B, 201, 201, IMG, IMG, B],
        {"image": [(2, 3, [True, True, False]), (7, 3, [True, True, False])], "audio": [(0, 2, None), (5, 2, None)]},
    ),
]


@pytest.mark.parametrize("prompt, updates, counts, expected_ids, expected_placeholders", APPLY_CASES)
def test_apply_prompt_updates(codec, prompt, updates, counts, expected_ids, expected_placeholders):
    ids, placeholders = apply_prompt_updates(prompt, resolve_updates(updates, counts, codec), codec)
    assert ids == expected_ids
    assert spans(placeholders) == expected_placeholders


def encode(codec, text, special=True):
    return codec.tokenizer.encode(text, add_special_tokens=special)


@pytest.mark.parametrize(
    "text, update, count, expected_text",
    [
        # "circle" sits inside the token " circle": matched on the decoded text, then encoded again.
        (
            "What colour is the circle?",
            PromptReplacement("image", "circle", "<image>"),
            1,
            "<s>What colour is the <image>?",
        ),
        # An empty target only matches as text, at the very start (before BOS), taking every item.
        ("USER: hi", PromptReplacement("image", "", "<image>"), 2, "<image><image><s>USER: hi"),
        ("USER: hi", PromptInsertion("image", [], "<image>"), 1, "<image><s>USER: hi"),
    ],
)
def test_text_fallback(codec, text, update, count, expected_text):
    ids, placeholders = apply_prompt_updates(
        encode(codec, text), resolve_updates([update], {"image": count}, codec), codec
    )
    expected = encode(codec, expected_text, special=False)
    assert ids == expected
    starts = [i for i, t in enumerate(expected) if t == IMG]
    assert spans(placeholders) == {"image": [(s, 1, None) for s in starts]}


def test_token_path_equals_vllm_text_path_when_tokens_round_trip(codec):
    # vLLM 0.9 takes the text path for an insertion with 2 items (one match < two items); Tessera
    # stays on token ids. Where decode/encode round-trips, the ids are the same.
    prompt = encode(codec, "USER: <image> hi")
    update = PromptInsertion("image", "USER:", "<image>")
    ids, _ = apply_prompt_updates(prompt, resolve_updates([update], {"image": 2}, codec), codec)
    assert ids == encode(codec, "<s>USER:<image><image> <image> hi", special=False)


# ---- Tessera's refusals (docs/vllm-compatibility.md) -----------------------------------------------


@pytest.mark.parametrize(
    "prompt, updates, count, message",
    [
        (  # vLLM: replaces the first and leaves the second <image> in the prompt as a text token
            [A, IMG, B, IMG],
            [PromptReplacement("image", [IMG], [7])],
            1,
            r"2 image placeholder\(s\) \('<image>'\) but 1 image item\(s\) were given; "
            r"1 placeholder\(s\) have no image",
        ),
        (
            [A, IMG, B],
            [PromptReplacement("image", "<image>", [7])],
            3,
            r"1 image placeholder\(s\) \('<image>'\) but 3 .* image items 1 to 2 \(counting from 0\) have none",
        ),
        (
            [A, IMG, B, HI],
            [PromptReplacement("image", [IMG], [7]), PromptReplacement("image", "hi", [8])],
            3,
            r"2 image placeholder\(s\) \('<image>' or 'hi'\) but 3 .* image item 2 \(counting from 0\) has none",
        ),
        (
            [B, A],
            [PromptInsertion("image", PromptIndexTargets.prefix([A]), [9])],
            2,
            r"Cannot place the image tokens: the end of the prefix \[43\] was not found in the prompt",
        ),
        ([B, A], [PromptInsertion("image", "hi", [9])], 1, r"Cannot place the image tokens: 'hi' was not found"),
        ([A, IMG], [PromptReplacement("image", [IMG], [])], 1, r"gives image item 0 no tokens"),
    ],
)
def test_clear_errors(codec, prompt, updates, count, message):
    with pytest.raises(ValueError, match=message):
        apply_prompt_updates(prompt, resolve_updates(updates, {"image": count}, codec), codec)


# ---- placing items: found, or applied ------------------------------------------------------------


def test_place_items_keeps_what_the_hf_processor_expanded(codec):
    resolved = resolve_updates([PromptReplacement("image", [IMG], PER_ITEM(100))], {"image": 2}, codec)
    prompt = [A, 100, B, 101, 101]
    ids, placeholders = place_items(prompt, resolved, codec, maybe_applied=True)
    assert ids == prompt and spans(placeholders) == {"image": [(1, 1, None), (3, 2, None)]}


def test_place_items_claims_each_run_for_one_modality_only(codec):
    # Both modalities use [9]; the audio run is the second one, and audio (not expanded) is placed.
    updates = [PromptReplacement("image", [IMG], [9]), PromptReplacement("audio", [C], [9])]
    resolved = resolve_updates(updates, {"image": 1, "audio": 1}, codec)
    ids, placeholders = place_items([9, A, C], resolved, codec, maybe_applied=True)
    assert ids == [9, A, 9]
    assert spans(placeholders) == {"image": [(0, 1, None)], "audio": [(2, 1, None)]}


def test_place_items_applies_a_modality_the_hf_processor_left_alone(codec):
    # Images expanded (found); audio not (placed here): the image offsets move with the edit.
    updates = [PromptReplacement("image", [IMG], [7, 7]), PromptReplacement("audio", [C], [8, 8, 8])]
    resolved = resolve_updates(updates, {"image": 1, "audio": 1}, codec)
    ids, placeholders = place_items([C, A, 7, 7], resolved, codec, maybe_applied=True)
    assert ids == [8, 8, 8, A, 7, 7]
    assert spans(placeholders) == {"image": [(4, 2, None)], "audio": [(0, 3, None)]}


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([A, 7, 7, B], r"1 image placeholder\(s\) \('<image>'\) but 2 .* image item 1 \(counting from 0\) has none"),
        ([7, 7, 7, 7, 7, 7], r"3 image placeholder\(s\) \('<image>'\) but 2 .* 1 placeholder\(s\) have no image"),
    ],
)
def test_place_items_names_a_wrong_expansion(codec, prompt, message):
    resolved = resolve_updates([PromptReplacement("image", [IMG], [7, 7])], {"image": 2}, codec)
    with pytest.raises(ValueError, match=message):
        place_items(prompt, resolved, codec, maybe_applied=True)


def test_place_items_names_the_missing_item_for_an_insertion(codec):
    resolved = resolve_updates([PromptInsertion("image", PromptIndexTargets.start(), PER_ITEM(7))], {"image": 2}, codec)
    message = r"tokens of 1 of 2 image item\(s\); image item 1 \(counting from 0\) has none"
    with pytest.raises(ValueError, match=message):
        place_items([7, A], resolved, codec, maybe_applied=True)
