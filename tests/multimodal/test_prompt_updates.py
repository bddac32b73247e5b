"""The model-author primitives: index targets, update details and updates (vLLM 0.9 semantics).

Expected values come from vLLM's documented behaviour and its unit tests
(tests/multimodal/test_processing.py: the PromptIndexTargets entries of test_find_token_matches /
test_find_text_matches), not from Tessera's output.
"""

from __future__ import annotations

import pytest

from tessera.multimodal.prompt_updates import (
    BoundPromptSequence,
    PromptIndex,
    PromptIndexTargets,
    PromptInsertion,
    PromptReplacement,
    PromptUpdateDetails,
    TokenCodec,
    UpdateMode,
    placeholder_target,
    placeholder_token_id,
)
from testkit import build_tokenizer

IMG = 512  # "<image>" in the llava fixture tokenizer
IM, MAGE, COLON = 43, 288, 28  # "Image:" encodes to these three tokens


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_tokenizer("llava")
    assert tok.convert_tokens_to_ids("<image>") == IMG
    assert tok.encode("Image:", add_special_tokens=False) == [IM, MAGE, COLON]
    return tok


# ---- PromptIndexTargets ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, target, expected",
    [
        # vLLM: start() and end() match even an empty prompt; a missing prefix resolves to None.
        ([], PromptIndexTargets.start(), 0),
        ([], PromptIndexTargets.end(), 0),
        ([], PromptIndexTargets.prefix([IMG]), None),
        ([IMG, IMG, IMG, IMG], PromptIndexTargets.start(), 0),
        ([IMG, IMG, IMG, IMG], PromptIndexTargets.prefix([IMG]), 1),
        ([IMG, IMG, IMG, IMG], PromptIndexTargets.end(), 4),
        ([9, IM, IMG], PromptIndexTargets.prefix([IM, IMG]), None),  # only at the very start
        # A text prefix is encoded (no special tokens) to match token ids.
        ([IM, MAGE, COLON, IMG, 7], PromptIndexTargets.prefix("Image:<image>"), 4),
        ([1, IM, MAGE, COLON], PromptIndexTargets.prefix("Image:"), None),  # BOS is part of the prompt
    ],
)
def test_index_targets_on_token_ids(tokenizer, prompt, target, expected):
    assert target.get_match_index(tokenizer, prompt) == expected


@pytest.mark.parametrize(
    "prompt, target, expected",
    [
        ("", PromptIndexTargets.start(), 0),
        ("", PromptIndexTargets.end(), 0),
        ("", PromptIndexTargets.prefix("<image>"), None),
        ("<image><image><image><image>", PromptIndexTargets.prefix("<image>"), 7),
        ("<image><image><image><image>", PromptIndexTargets.end(), 28),
        ("Image:<image><image><image>Image:<image><image>!", PromptIndexTargets.prefix("Image:<image>"), 13),
        ("Image:<image><image><image>Image:<image><image>!", PromptIndexTargets.end(), 48),
        # A token prefix is decoded to match text.
        ("Image:<image> hi", PromptIndexTargets.prefix([IM, MAGE, COLON, IMG]), 13),
    ],
)
def test_index_targets_on_text(tokenizer, prompt, target, expected):
    assert target.get_match_index(tokenizer, prompt) == expected


def test_index_targets_name_their_position_for_error_messages():
    assert PromptIndexTargets.start().description == "the start of the prompt"
    assert PromptIndexTargets.end().description == "the end of the prompt"
    assert PromptIndexTargets.prefix("Images:").description == "the end of the prefix 'Images:'"
    # A PromptIndex built as in vLLM (one argument) still works and has a neutral name.
    custom = PromptIndex(lambda tokenizer, prompt: 1)
    assert custom.get_match_index(None, [5, 6]) == 1
    assert "PromptIndex" in custom.description


# ---- PromptUpdateDetails -----------------------------------------------------------------------


def is_embed_of(details: PromptUpdateDetails, tokenizer):
    mask = details.is_embed(BoundPromptSequence(TokenCodec(tokenizer), details.full))
    return mask.tolist()


def test_from_seq_leaves_is_embed_unset():
    details = PromptUpdateDetails.from_seq([4, 4])
    assert details.full == [4, 4] and details.is_embed is None


@pytest.mark.parametrize(
    "full, embed_token_id, expected",
    [
        ([IMG, 7, IMG, IMG, 1], IMG, [True, False, True, True, False]),  # Fuyu-style: grid tokens + BOS
        ([7, 8], IMG, [False, False]),
        ("<image>\n<image>", IMG, [True, False, True]),  # text content is encoded first
    ],
)
def test_select_token_id(tokenizer, full, embed_token_id, expected):
    assert is_embed_of(PromptUpdateDetails.select_token_id(full, embed_token_id=embed_token_id), tokenizer) == expected


def test_select_text_marks_every_token_of_the_embed_text(tokenizer):
    # Every token id that occurs in embed_text counts, wherever it sits in `full`.
    details = PromptUpdateDetails.select_text("Image:<image><image>:", "<image>")
    assert is_embed_of(details, tokenizer) == [False, False, False, True, True, False]
    details = PromptUpdateDetails.select_text("Image:<image>", "Image")
    assert is_embed_of(details, tokenizer) == [True, True, False, False]


def test_select_text_ignores_special_tokens_the_tokenizer_would_add(tokenizer):
    # The llava tokenizer prepends <s> (id 1) by default; embed_text is encoded without it, so a
    # BOS inside the content is not an embedding position (vLLM >= 0.10; 0.9 marked it).
    details = PromptUpdateDetails.select_text([1, IMG, IMG], "<image>")
    assert is_embed_of(details, tokenizer) == [False, True, True]


# ---- PromptInsertion / PromptReplacement -------------------------------------------------------


@pytest.mark.parametrize(
    "update_type, mode", [(PromptInsertion, UpdateMode.INSERT), (PromptReplacement, UpdateMode.REPLACE)]
)
def test_content_per_item_or_constant(update_type, mode):
    per_item = update_type("image", [IMG], lambda i: [100 + i] * (i + 1))
    constant = update_type("image", "<image>", "<image><image>")
    assert per_item.mode == constant.mode == mode
    assert [per_item.resolve(i).full for i in range(3)] == [[100], [101, 101], [102, 102, 102]]
    assert constant.resolve(0).full == constant.resolve(5).full == "<image><image>"
    details = PromptUpdateDetails.select_token_id([IMG, 7], IMG)
    assert update_type("image", [IMG], lambda i: details).resolve(1) is details  # details pass through


def test_bound_sequence_converts_both_ways(tokenizer):
    codec = TokenCodec(tokenizer)
    assert BoundPromptSequence(codec, "Image:<image>").token_ids == [IM, MAGE, COLON, IMG]
    assert BoundPromptSequence(codec, [IM, MAGE, COLON, IMG]).text == "Image:<image>"
    assert BoundPromptSequence(codec, []).text == "" and BoundPromptSequence(codec, "").token_ids == []


# ---- placeholders that may or may not be one token ---------------------------------------------


def test_placeholder_is_its_token_only_where_the_tokenizer_has_it_as_one(tokenizer):
    """`<image>` is one (added) token of the fixture tokenizer; `<video>` is not, and
    convert_tokens_to_ids answers the unknown token's id for it, which no prompt holds: such a
    placeholder is a text target (what HF processors replace), matched by its text."""
    assert tokenizer.convert_tokens_to_ids("<video>") == tokenizer.unk_token_id
    assert len(tokenizer.encode("<video>", add_special_tokens=False)) > 1
    assert placeholder_token_id(tokenizer, "<image>") == IMG
    assert placeholder_target(tokenizer, "<image>") == [IMG]
    assert placeholder_token_id(tokenizer, "<video>") is None
    assert placeholder_target(tokenizer, "<video>") == "<video>"
    assert placeholder_target(tokenizer, "Image:") == "Image:"  # three tokens
    assert placeholder_token_id(tokenizer, tokenizer.unk_token) == tokenizer.unk_token_id
