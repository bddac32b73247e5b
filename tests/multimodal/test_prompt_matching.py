"""Applying and finding prompt updates on token ids (and the text fallback)."""

from __future__ import annotations

import pytest

from tessera.multimodal.prompt_matching import apply_prompt_updates, find_applied_placeholders, resolve_updates
from tessera.multimodal.prompt_updates import (
    PromptIndexTargets,
    PromptInsertion,
    PromptReplacement,
    PromptUpdateDetails,
    TokenCodec,
)
from tests.fixtures import build_tokenizer

T, A, B, C = 900, 1, 2, 3  # ids only compared, never decoded (token-level matches need no text)


@pytest.fixture(scope="module")
def codec():
    return TokenCodec(build_tokenizer("llava"))


def apply(codec, prompt, updates, counts):
    return apply_prompt_updates(prompt, resolve_updates(updates, counts, codec), codec)


def spans(placeholders, modality="image"):
    return [(p.offset, p.length) for p in placeholders[modality]]


def test_item_i_replaces_the_ith_match(codec):
    update = PromptReplacement("image", target=[T], replacement=lambda i: [100 + i] * (i + 1))
    ids, placeholders = apply(codec, [A, T, B, T, C], [update], {"image": 2})
    assert ids == [A, 100, B, 101, 101, C]
    assert spans(placeholders) == [(1, 1), (3, 2)]


def test_multi_token_targets_match_without_overlap(codec):
    update = PromptReplacement("image", target=[T, T], replacement=[7])
    ids, placeholders = apply(codec, [T, T, T, A, T, T], [update], {"image": 2})
    assert ids == [7, T, A, 7]
    assert spans(placeholders) == [(0, 1), (3, 1)]


def test_insertion_goes_after_the_ith_match(codec):
    update = PromptInsertion("image", target=[T], insertion=lambda i: [50 + i])
    ids, placeholders = apply(codec, [T, A, T, B], [update], {"image": 2})
    assert ids == [T, 50, A, T, 51, B]
    assert spans(placeholders) == [(1, 1), (4, 1)]


def test_insertions_share_the_first_match_when_matches_are_fewer_than_items(codec):
    update = PromptInsertion("image", target=[T], insertion=lambda i: [50 + i, 60 + i])
    ids, placeholders = apply(codec, [A, T, B], [update], {"image": 3})
    assert ids == [A, T, 50, 60, 51, 61, 52, 62, B]
    assert spans(placeholders) == [(2, 2), (4, 2), (6, 2)]


@pytest.mark.parametrize(
    "target, expected",
    [
        (PromptIndexTargets.start(), [9, A, B]),
        (PromptIndexTargets.end(), [A, B, 9]),
        (PromptIndexTargets.prefix([A]), [A, 9, B]),
    ],
)
def test_index_targets(codec, target, expected):
    ids, placeholders = apply(codec, [A, B], [PromptInsertion("image", target, [9])], {"image": 1})
    assert ids == expected
    assert spans(placeholders) == [(expected.index(9), 1)]


def test_missing_prefix_is_a_clear_error(codec):
    with pytest.raises(ValueError, match="Cannot place the image tokens"):
        apply(codec, [B, A], [PromptInsertion("image", PromptIndexTargets.prefix([A]), [9])], {"image": 1})


def test_text_target_and_content_are_tokenized(codec):
    tokenizer = codec.tokenizer
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    prompt = tokenizer.encode("USER: <image> hi", add_special_tokens=False)
    update = PromptReplacement("image", target="<image>", replacement="<image><image>")
    ids, placeholders = apply(codec, prompt, [update], {"image": 1})
    at = prompt.index(image_id)
    assert ids == prompt[:at] + [image_id, image_id] + prompt[at + 1 :]
    assert spans(placeholders) == [(at, 2)]


def test_text_fallback_finds_a_target_inside_a_larger_token(codec):
    tokenizer = codec.tokenizer
    text = "What colour is the circle?"
    prompt = tokenizer.encode(text, add_special_tokens=False)
    target = "circle"
    # Precondition that makes this the fallback case: the target's own tokens are not in the prompt.
    target_ids = tokenizer.encode(target, add_special_tokens=False)
    assert not any(prompt[i : i + len(target_ids)] == target_ids for i in range(len(prompt)))

    update = PromptReplacement("image", target=target, replacement="<image>")
    ids, placeholders = apply(codec, prompt, [update], {"image": 1})
    expected = tokenizer.encode(text.replace(target, "<image>"), add_special_tokens=False)
    assert ids == expected
    assert spans(placeholders) == [(expected.index(tokenizer.convert_tokens_to_ids("<image>")), 1)]


def test_select_token_id_marks_only_that_token(codec):
    content = [5, 6, 5, 7]
    update = PromptReplacement("image", [T], PromptUpdateDetails.select_token_id(content, embed_token_id=5))
    _, placeholders = apply(codec, [A, T], [update], {"image": 1})
    (placeholder,) = placeholders["image"]
    assert placeholder.is_embed.tolist() == [True, False, True, False]
    assert placeholder.get_num_embeds() == 2


def test_select_text_marks_the_tokens_of_that_text(codec):
    tokenizer = codec.tokenizer
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    content = "<image><image>\n"
    update = PromptReplacement("image", [T], PromptUpdateDetails.select_text(content, "<image>"))
    _, placeholders = apply(codec, [T], [update], {"image": 1})
    content_ids = tokenizer.encode(content, add_special_tokens=False)
    assert placeholders["image"][0].is_embed.tolist() == [t == image_id for t in content_ids]


def test_from_seq_embeds_every_token(codec):
    update = PromptReplacement("image", [T], PromptUpdateDetails.from_seq([4, 4, 4]))
    _, placeholders = apply(codec, [T], [update], {"image": 1})
    assert placeholders["image"][0].is_embed is None and placeholders["image"][0].get_num_embeds() == 3


def test_two_modalities_are_placed_independently_and_listed_by_item(codec):
    updates = [
        PromptReplacement("image", [T], lambda i: [100 + i]),
        PromptReplacement("audio", [C], lambda i: [200 + i, 200 + i]),
    ]
    ids, placeholders = apply(codec, [C, T, C, T], updates, {"image": 2, "audio": 2})
    assert ids == [200, 200, 100, 201, 201, 101]
    assert spans(placeholders, "audio") == [(0, 2), (3, 2)]
    assert spans(placeholders, "image") == [(2, 1), (5, 1)]


def test_overlapping_updates_are_rejected(codec):
    updates = [PromptReplacement("image", [T, A], [1]), PromptReplacement("audio", [A, B], [2])]
    with pytest.raises(ValueError, match="overlap"):
        apply(codec, [T, A, B], updates, {"image": 1, "audio": 1})


def test_a_modality_without_an_update_is_an_error(codec):
    with pytest.raises(ValueError, match="no prompt update for audio"):
        resolve_updates([PromptReplacement("image", [T], [1])], {"image": 1, "audio": 1}, codec)


def test_find_applied_placeholders_finds_each_item_in_order(codec):
    resolved = resolve_updates([PromptReplacement("image", [T], lambda i: [8] * (i + 2))], {"image": 2}, codec)
    found = find_applied_placeholders([A, 8, 8, B, 8, 8, 8, C], resolved)
    assert [(p.offset, p.length) for p in found["image"]] == [(1, 2), (4, 3)]


@pytest.mark.parametrize(
    "prompt, expected_count",
    [([A, B], 0), ([8, 8, A], 1), ([8, 8, 8, 8, 8, 8], 3)],  # none / too few / one too many expansions
)
def test_find_applied_placeholders_counts_wrong_expansions(codec, prompt, expected_count):
    resolved = resolve_updates([PromptReplacement("image", [T], [8, 8])], {"image": 2}, codec)
    assert find_applied_placeholders(prompt, resolved)["image"] == expected_count
