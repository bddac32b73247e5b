"""Incremental detokenization: the same text as decoding everything at once, and stop strings."""

from __future__ import annotations

import pytest

from tessera.engine.detokenizer import IncrementalDetokenizer
from testkit import build_tokenizer

SENTENCES = [
    "The circle is red. The square is blue.",
    "café ünïcode ✓",  # multi-byte characters split over byte tokens
    "日本語 🎉 and 4-byte emoji 🙂🙂",
    "  two leading spaces, a tab\tand\nnew lines  ",
]


@pytest.fixture(scope="module", params=["llava", "fuyu"])
def tokenizer(request):
    return build_tokenizer(request.param)


@pytest.fixture(scope="module")
def llava_tokenizer():
    return build_tokenizer("llava")


def feed(detokenizer, token_ids):
    """Add tokens until one completes a stop string; returns (that token's index, the stop string)."""
    for index, token in enumerate(token_ids):
        stop = detokenizer.add(token)
        if stop is not None:
            return index, stop
    return None, None


@pytest.mark.parametrize("text", SENTENCES)
def test_incremental_text_equals_decoding_all_tokens(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    expected = tokenizer.decode(ids)
    detokenizer = IncrementalDetokenizer(tokenizer, stop=[])
    for count, token in enumerate(ids, 1):
        assert detokenizer.add(token) is None
        # never a half character, never text that a later token would change
        assert "\ufffd" not in detokenizer.text
        assert expected.startswith(detokenizer.text)
        if "\ufffd" not in tokenizer.decode(ids[:count]):
            assert detokenizer.text == tokenizer.decode(ids[:count])
    assert detokenizer.text == expected
    assert detokenizer.finish(stopped_by_string=False) == expected


def test_a_trailing_incomplete_character_is_held_back_until_finish(llava_tokenizer):
    ids = llava_tokenizer.encode("ok ✓", add_special_tokens=False)
    partial = ids[:-1]  # "✓" is 3 bytes: drop its last byte token
    assert llava_tokenizer.decode(partial).endswith("\ufffd")
    detokenizer = IncrementalDetokenizer(llava_tokenizer, stop=[])
    feed(detokenizer, partial)
    assert detokenizer.text == "ok "
    assert detokenizer.finish(stopped_by_string=False) == llava_tokenizer.decode(partial)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_are_skipped_or_kept(llava_tokenizer, skip):
    ids = llava_tokenizer.encode("The circle is red.")  # starts with <s>
    assert ids[0] == llava_tokenizer.bos_token_id
    detokenizer = IncrementalDetokenizer(llava_tokenizer, stop=[], skip_special_tokens=skip)
    feed(detokenizer, ids + [llava_tokenizer.eos_token_id])
    expected = llava_tokenizer.decode(ids + [llava_tokenizer.eos_token_id], skip_special_tokens=skip)
    assert detokenizer.text == expected
    assert ("<s>" in detokenizer.text) is not skip


def first_token_completing(tokenizer, ids, stop):
    return next(i for i in range(len(ids)) if stop in tokenizer.decode(ids[: i + 1]))


@pytest.mark.parametrize(
    "text, stop",
    [
        ("The circle is red. The square is blue.", "square"),
        ("The circle is red. The square is blue.", "The"),  # at the very start: empty text
        ("The circle is red. The square is blue.", "."),
        ("café ünïcode ✓", "ünï"),  # multi-byte characters over several tokens
        ("café ünïcode ✓", "✓"),
    ],
)
def test_a_stop_string_cuts_the_text_before_it(llava_tokenizer, text, stop):
    ids = llava_tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(llava_tokenizer, stop=["never there", stop])
    index, found = feed(detokenizer, ids)
    assert found == stop
    assert index == first_token_completing(llava_tokenizer, ids, stop)
    assert detokenizer.text == text[: text.index(stop)]
    assert detokenizer.finish(stopped_by_string=True) == text[: text.index(stop)]


def test_a_stop_string_spanning_two_tokens_is_found(llava_tokenizer):
    text = "The circle is red. The square is blue."
    ids = llava_tokenizer.encode(text, add_special_tokens=False)
    pieces = [llava_tokenizer.decode([t]) for t in ids]
    i = next(i for i in range(len(ids) - 1) if len(pieces[i]) >= 3 and len(pieces[i + 1]) >= 3)
    stop = pieces[i][-2:] + pieces[i + 1][:2]  # e.g. "le i" across " circle" and " is"
    assert stop not in pieces[i] and stop not in pieces[i + 1]
    detokenizer = IncrementalDetokenizer(llava_tokenizer, stop=[stop])
    index, found = feed(detokenizer, ids)
    assert (index, found) == (i + 1, stop)
    assert detokenizer.text == text[: text.index(stop)]


def test_without_a_stop_string_in_the_text_nothing_stops(llava_tokenizer):
    text = "The circle is red."
    detokenizer = IncrementalDetokenizer(llava_tokenizer, stop=["blue", "squ"])
    assert feed(detokenizer, llava_tokenizer.encode(text, add_special_tokens=False)) == (None, None)
    assert detokenizer.text == text
