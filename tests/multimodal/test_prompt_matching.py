"""Matching targets and applying updates, token- and text-level, as case tables.

Each table is a case of vLLM 0.9's tests/multimodal/test_processing.py (test_find_token_matches,
test_find_text_matches, test_find_update_tokens, test_find_update_text): every "pattern_N" is
its own modality, every modality gets the same item count, and the expected prompts are vLLM's.
"""

from __future__ import annotations

import pytest

from tessera.multimodal.prompt_matching import find_target_matches, resolve_updates, update_prompt
from tessera.multimodal.prompt_updates import (
    PromptIndex,
    PromptIndexTargets,
    PromptInsertion,
    PromptReplacement,
    TokenCodec,
)
from testkit import build_tokenizer

BOTH = [PromptInsertion, PromptReplacement]


@pytest.fixture(scope="module")
def codec():
    return TokenCodec(build_tokenizer("llava"))


def resolve(codec, update_type, targets, contents, count):
    updates = [update_type(key, target, contents.get(key, [])) for key, target in targets.items()]
    return resolve_updates(updates, {key: count for key in targets}, codec)


def matches_by_key(codec, update_type, prompt, targets):
    found = find_target_matches(prompt, resolve(codec, update_type, targets, {}, 1), codec)
    return {key: [(m.start, m.end) for m in found if m.modality == key] for key in targets}


# ---- finding targets ---------------------------------------------------------------------------

FIND_TOKEN_CASES = [
    (
        [],
        {"p1": [], "p2": [32000], "p3": PromptIndexTargets.start(), "p4": PromptIndexTargets.prefix([32000])},
        {"p1": [], "p2": [], "p3": [(0, 0)], "p4": []},
    ),
    ([], {"p5": PromptIndexTargets.end()}, {"p5": [(0, 0)]}),
    (
        [32000, 32000, 32000, 32000],
        {"p1": [32000], "p2": [32000] * 2, "p3": [32000] * 3, "p4": PromptIndexTargets.prefix([32000])},
        {"p1": [(0, 1), (1, 2), (2, 3), (3, 4)], "p2": [(0, 2), (2, 4)], "p3": [(0, 3)], "p4": [(1, 1)]},
    ),
    (
        [9833, 28747, 32000, 32000, 32000, 9833, 28747, 32000, 32000, 918],
        {
            "p1": [28747, 32000],
            "p2": [28747, 32000, 32000, 32000],
            "p3": [28747, 0, 32000],
            "p4": PromptIndexTargets.start(),
            "p5": PromptIndexTargets.prefix([28747, 32000]),
            "p6": PromptIndexTargets.end(),
        },
        {"p1": [(1, 3), (6, 8)], "p2": [(1, 5)], "p3": [], "p4": [(0, 0)], "p5": [], "p6": [(10, 10)]},
    ),
]

FIND_TEXT_CASES = [
    (
        "",
        {"p1": "", "p2": "<image>", "p3": PromptIndexTargets.start(), "p4": PromptIndexTargets.prefix("<image>")},
        {"p1": [(0, 0)], "p2": [], "p3": [(0, 0)], "p4": []},
    ),
    (
        "<image><image><image><image>",
        {"p1": "<image>", "p2": "<image>" * 2, "p3": "<image>" * 3, "p5": PromptIndexTargets.prefix("<image>")},
        {"p1": [(0, 7), (7, 14), (14, 21), (21, 28)], "p2": [(0, 14), (14, 28)], "p3": [(0, 21)], "p5": [(7, 7)]},
    ),
    (
        "Image:<image><image><image>Image:<image><image>!",
        {
            "p1": "Image:<image>",
            "p2": "Image:<image><image><image>",
            "p3": "Image:<unk><image>",
            "p5": PromptIndexTargets.prefix("Image:<image>"),
            "p6": PromptIndexTargets.end(),
        },
        {"p1": [(0, 13), (27, 40)], "p2": [(0, 27)], "p3": [], "p5": [(13, 13)], "p6": [(48, 48)]},
    ),
    (  # regex metacharacters are literal
        "<|image|><image><|image|><image>",
        {"p1": "<|image|>", "p2": "<|image|><image>", "p3": "<|image|><image><|image|>"},
        {"p1": [(0, 9), (16, 25)], "p2": [(0, 16), (16, 32)], "p3": [(0, 25)]},
    ),
]


@pytest.mark.parametrize("update_type", BOTH)
@pytest.mark.parametrize("prompt, targets, expected", FIND_TOKEN_CASES + FIND_TEXT_CASES)
def test_find_target_matches(codec, update_type, prompt, targets, expected):
    assert matches_by_key(codec, update_type, prompt, targets) == expected


# ---- applying updates --------------------------------------------------------------------------

UPDATE_TEXT_CASES = [
    # (prompt, targets, contents, {update type: {count: expected}})
    (
        "Image:<image>Image:<image><image>!",
        {"p1": "<image>", "p2": "Image:", "p3": "!"},  # "<image>" first: matches arrive out of order
        {"p1": "<image><image>", "p2": "", "p3": "?!?"},
        {
            PromptInsertion: {
                0: "Image:<image>Image:<image><image>!",
                1: "Image:<image><image><image>Image:<image><image>!?!?",
                2: "Image:<image><image><image><image><image>Image:<image><image>!?!??!?",
            },
            PromptReplacement: {
                0: "Image:<image>Image:<image><image>!",
                1: "<image><image>Image:<image><image>?!?",
                2: "<image><image><image><image><image>?!?",
            },
        },
    ),
    (
        "",
        {"p1": PromptIndexTargets.start(), "p2": PromptIndexTargets.prefix("<image>"), "p3": PromptIndexTargets.end()},
        {"p1": "1", "p2": "2", "p3": "3"},
        {t: {0: "", 1: "13", 2: "1133"} for t in BOTH},
    ),
    (
        "<image>",
        {"p1": PromptIndexTargets.start(), "p2": PromptIndexTargets.prefix("<image>"), "p3": PromptIndexTargets.end()},
        {"p1": "1", "p2": "2", "p3": "3"},
        {t: {0: "<image>", 1: "1<image>23", 2: "11<image>2233"} for t in BOTH},
    ),
    (
        "<image><image><image>",
        {"p1": "<image>"},
        {"p1": lambda i: str(i + 1)},
        {
            PromptInsertion: {0: "<image><image><image>", 1: "<image>1<image><image>", 2: "<image>12<image><image>"},
            PromptReplacement: {0: "<image><image><image>", 1: "1<image><image>", 2: "12<image>"},
        },
    ),
    (
        "<image><image><image>",
        {"p1": PromptIndexTargets.prefix("<image>")},
        {"p1": lambda i: str(i + 1)},
        {t: {0: "<image><image><image>", 1: "<image>1<image><image>", 2: "<image>12<image><image>"} for t in BOTH},
    ),
    (  # an empty text target matches at the start, and that first match takes every item
        "ab<image>",
        {"p1": ""},
        {"p1": lambda i: str(i + 1)},
        {t: {0: "ab<image>", 1: "1ab<image>", 2: "12ab<image>"} for t in BOTH},
    ),
]

UPDATE_TOKEN_CASES = [
    (
        [1, 9833, 28747, 32000, 9833, 28747, 32000, 32000, 918],
        {"p1": [32000], "p2": [9833, 28747], "p3": [918]},
        {"p1": [32000, 32000], "p2": [], "p3": [1550, 918, 1550]},
        {
            PromptInsertion: {
                0: [1, 9833, 28747, 32000, 9833, 28747, 32000, 32000, 918],
                1: [1, 9833, 28747, 32000, 32000, 32000, 9833, 28747, 32000, 32000, 918, 1550, 918, 1550],
                2: [1, 9833, 28747, 32000, 32000, 32000, 32000, 32000, 9833, 28747, 32000, 32000, 918]
                + [1550, 918, 1550, 1550, 918, 1550],
            },
            PromptReplacement: {
                0: [1, 9833, 28747, 32000, 9833, 28747, 32000, 32000, 918],
                1: [1, 32000, 32000, 9833, 28747, 32000, 32000, 1550, 918, 1550],
                2: [1, 32000, 32000, 32000, 32000, 32000, 1550, 918, 1550],
            },
        },
    ),
    (
        [],
        {"p1": PromptIndexTargets.start(), "p2": PromptIndexTargets.prefix([32000]), "p3": PromptIndexTargets.end()},
        {"p1": [-1], "p2": [-2], "p3": [-3]},
        {t: {0: [], 1: [-1, -3], 2: [-1, -1, -3, -3]} for t in BOTH},
    ),
    (
        [32000],
        {"p1": PromptIndexTargets.start(), "p2": PromptIndexTargets.prefix([32000]), "p3": PromptIndexTargets.end()},
        {"p1": [-1], "p2": [-2], "p3": [-3]},
        {t: {0: [32000], 1: [-1, 32000, -2, -3], 2: [-1, -1, 32000, -2, -2, -3, -3]} for t in BOTH},
    ),
    (
        [32000, 32000, 32000],
        {"p1": [32000]},
        {"p1": lambda i: [-(i + 1)]},
        {
            PromptInsertion: {0: [32000] * 3, 1: [32000, -1, 32000, 32000], 2: [32000, -1, -2, 32000, 32000]},
            PromptReplacement: {0: [32000] * 3, 1: [-1, 32000, 32000], 2: [-1, -2, 32000]},
        },
    ),
    (
        [32000, 32000, 32000],
        {"p1": PromptIndexTargets.prefix([32000])},
        {"p1": lambda i: [-(i + 1)]},
        {t: {0: [32000] * 3, 1: [32000, -1, 32000, 32000], 2: [32000, -1, -2, 32000, 32000]} for t in BOTH},
    ),
    (  # an empty token target never matches (the full path then falls back to text)
        [5, 6],
        {"p1": []},
        {"p1": [-1]},
        {t: {0: [5, 6], 1: [5, 6], 2: [5, 6]} for t in BOTH},
    ),
]


@pytest.mark.parametrize("prompt, targets, contents, expected_by_type", UPDATE_TEXT_CASES + UPDATE_TOKEN_CASES)
def test_update_prompt(codec, prompt, targets, contents, expected_by_type):
    for update_type, expected_by_count in expected_by_type.items():
        for count, expected in expected_by_count.items():
            result, _ = update_prompt(prompt, resolve(codec, update_type, targets, contents, count), codec)
            assert result == expected, (update_type.__name__, count)


@pytest.mark.parametrize(
    "prompt, targets, count, expected_placed",
    [
        ([32000], {"p1": PromptIndexTargets.prefix([7]), "p2": PromptIndexTargets.end()}, 2, {"p1": 0, "p2": 2}),
        ([7, 32000, 7], {"p1": [7]}, 3, {"p1": 2}),  # replacement: one item per match
        ("<image>", {"p1": "<image>", "p2": "<video>"}, 1, {"p1": 1, "p2": 0}),
    ],
)
def test_update_prompt_reports_how_many_items_it_placed(codec, prompt, targets, count, expected_placed):
    _, placed = update_prompt(prompt, resolve(codec, PromptReplacement, targets, {}, count), codec)
    assert placed == expected_placed


@pytest.mark.parametrize("first", ["index", "replacement"])
def test_a_position_shared_with_a_match_start_is_filled_first(codec, first):
    # vLLM keeps declaration order here and then copies the replaced token back in; Tessera puts the
    # empty match first, whichever modality was declared first.
    updates = {
        "index": PromptInsertion("audio", PromptIndexTargets.start(), [9]),
        "replacement": PromptReplacement("image", [5], [50]),
    }
    ordered = [updates[first]] + [u for k, u in updates.items() if k != first]
    result, _ = update_prompt([5, 6], resolve_updates(ordered, {"audio": 1, "image": 1}, codec), codec)
    assert result == [9, 50, 6]


@pytest.mark.parametrize(
    "prompt, image_target, audio_target",
    [
        ([7, 1, 2], [7, 1], [1, 2]),
        ("x<image>y", "x<image>", "<image>y"),
        ([5, 6, 7], [5, 6, 7], PromptIndex(lambda tokenizer, prompt: 1)),  # a position inside a match
    ],
)
def test_overlapping_targets_are_an_error(codec, prompt, image_target, audio_target):
    updates = [PromptReplacement("image", image_target, [1]), PromptInsertion("audio", audio_target, [2])]
    with pytest.raises(ValueError, match=r"targets of image and audio overlap at position 1"):
        update_prompt(prompt, resolve_updates(updates, {"image": 1, "audio": 1}, codec), codec)


def test_a_modality_without_an_update_is_an_error(codec):
    with pytest.raises(ValueError, match="no prompt update for audio"):
        resolve_updates([PromptReplacement("image", [5], [1])], {"image": 1, "audio": 1}, codec)


def test_several_updates_of_one_modality_share_its_items_in_prompt_order(codec):
    # vLLM pools the matches of all of a modality's updates: item i goes to the i-th match of any of them.
    updates = [
        PromptReplacement("image", [7], lambda i: [100 + i]),
        PromptReplacement("image", [8], lambda i: [200 + i]),
    ]
    resolved = resolve_updates(updates, {"image": 3}, codec)
    assert update_prompt([8, 0, 7, 0, 8], resolved, codec)[0] == [200, 0, 101, 0, 202]
