"""Prompt processing and truncate_prompt_tokens: the last N tokens stay, images stay whole or go."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from tessera.engine.prompt import longest_token_chars, process_prompt
from tessera.errors import InputError, InputTooLargeError
from tessera.multimodal import MULTIMODAL_REGISTRY
from testkit import build_tokenizer, random_images

PROMPT = "USER: <image>\nWhat is this? <image>\nAnd this one? ASSISTANT:"


@pytest.fixture(scope="module")
def engine(tiny_llava_dir):
    """What process_prompt reads of an engine: the LLaVA processor and tokenizer."""
    processor = MULTIMODAL_REGISTRY.create_processor(tiny_llava_dir)
    tokenizer = processor.info.get_tokenizer()
    return SimpleNamespace(processor=processor, tokenizer=tokenizer, model_config=None, vocab_size=len(tokenizer),
                           max_prompt_chars=10_000)  # fmt: skip


@pytest.fixture(scope="module")
def text_engine():
    tokenizer = build_tokenizer("llava")
    return SimpleNamespace(processor=None, tokenizer=tokenizer, model_config=SimpleNamespace(architectures=["Llama"]),
                           vocab_size=len(tokenizer), max_prompt_chars=10_000)  # fmt: skip


@pytest.fixture(scope="module")
def full(engine):
    """The untruncated prompt with two different images."""
    return process_prompt(engine, prompt_with_images())


def prompt_with_images():
    return {"prompt": PROMPT, "multi_modal_data": {"image": random_images([(40, 40), (30, 50)], seed=3)}}


def image_token(engine):
    return engine.tokenizer.convert_tokens_to_ids("<image>")


def assert_placeholders_cover_exactly_the_image_tokens(engine, inputs):
    ids = inputs.token_ids
    covered = set()
    for item in inputs.mm_items:
        assert ids[item.start : item.end] == [image_token(engine)] * item.placeholder.length
        covered |= set(range(item.start, item.end))
    assert covered == {i for i, t in enumerate(ids) if t == image_token(engine)}


def truncate(engine, start, full, caplog):
    """Process the prompt keeping the tokens from `start` of the full prompt on."""
    with caplog.at_level(logging.WARNING, logger="tessera.engine.prompt"):
        return process_prompt(engine, prompt_with_images(), truncate_to=len(full.token_ids) - start)


def test_the_full_prompt_has_two_images_of_16_tokens(engine, full):
    assert [item.placeholder.length for item in full.mm_items] == [16, 16]
    assert full.mm_items[0].hash != full.mm_items[1].hash
    assert_placeholders_cover_exactly_the_image_tokens(engine, full)


@pytest.mark.parametrize("keep", [1, 5, 12])
def test_a_text_prompt_keeps_its_last_tokens(text_engine, keep):
    text = "There are three red squares in the image."
    inputs = process_prompt(text_engine, text, truncate_to=keep)
    assert inputs.token_ids == text_engine.tokenizer.encode(text)[-keep:]
    assert inputs.prompt == text


@pytest.mark.parametrize("extra", [0, 10])
def test_a_prompt_that_fits_is_unchanged(engine, full, caplog, extra):
    with caplog.at_level(logging.WARNING):
        inputs = process_prompt(engine, prompt_with_images(), truncate_to=len(full.token_ids) + extra)
    assert inputs.token_ids == full.token_ids
    assert [item.placeholder for item in inputs.mm_items] == [item.placeholder for item in full.mm_items]
    assert not caplog.records


def test_a_boundary_inside_an_image_drops_it_with_its_tokens(engine, full, caplog):
    first, second = full.mm_items
    inputs = truncate(engine, first.start + 5, full, caplog)
    assert inputs.token_ids == full.token_ids[first.end :]  # fewer than asked: none of its tokens stay
    assert [item.hash for item in inputs.mm_items] == [second.hash]
    assert inputs.mm_items[0].start == second.start - first.end
    assert_placeholders_cover_exactly_the_image_tokens(engine, inputs)
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "dropped 1 image" in caplog.records[0].getMessage()


def test_a_boundary_at_an_image_start_keeps_it(engine, full, caplog):
    first, second = full.mm_items
    inputs = truncate(engine, first.start, full, caplog)
    assert inputs.token_ids == full.token_ids[first.start :]
    assert [item.hash for item in inputs.mm_items] == [first.hash, second.hash]
    assert [item.start for item in inputs.mm_items] == [0, second.start - first.start]
    assert_placeholders_cover_exactly_the_image_tokens(engine, inputs)
    assert not caplog.records


def test_a_boundary_between_images_drops_the_first_and_keeps_exactly_n_tokens(engine, full, caplog):
    first, second = full.mm_items
    start = first.end + 2
    assert start < second.start
    inputs = truncate(engine, start, full, caplog)
    assert inputs.token_ids == full.token_ids[start:]
    assert [item.hash for item in inputs.mm_items] == [second.hash]
    assert_placeholders_cover_exactly_the_image_tokens(engine, inputs)
    assert "dropped 1 image" in caplog.text


def test_a_boundary_inside_the_last_image_drops_both(engine, full, caplog):
    second = full.mm_items[1]
    inputs = truncate(engine, second.end - 1, full, caplog)
    assert inputs.token_ids == full.token_ids[second.end :]
    assert inputs.mm_items == []
    assert image_token(engine) not in inputs.token_ids
    assert "dropped 2 image" in caplog.text


@pytest.mark.parametrize(
    "prompt, match",
    [
        ({"prompt": "a", "prompt_token_ids": [1, 2]}, "exactly one of"),
        ({"multi_modal_data": {}}, "exactly one of"),
        (42, "must be a string, a list of token ids or a dict"),
    ],
)
def test_malformed_prompts_are_value_errors(text_engine, prompt, match):
    with pytest.raises(ValueError, match=match):
        process_prompt(text_engine, prompt)


def test_a_text_only_model_rejects_images(text_engine):
    prompt = {"prompt": "hi", "multi_modal_data": {"image": random_images([(8, 8)])}}
    with pytest.raises(ValueError, match="Llama is a text-only model"):
        process_prompt(text_engine, prompt)


# ---- admission checks --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [[1, 10**6], [1, -5], [1, 2.0], [1, "3"], [True, 2], "not a list"])
def test_token_ids_outside_the_vocabulary_or_not_integers_are_refused(text_engine, bad):
    with pytest.raises(InputError, match="[Tt]oken id|must be a list"):
        process_prompt(text_engine, {"prompt_token_ids": bad})


def test_the_last_token_id_of_the_vocabulary_is_accepted_and_one_past_it_is_not(text_engine):
    last = text_engine.vocab_size - 1
    assert process_prompt(text_engine, [1, last]).token_ids == [1, last]
    with pytest.raises(InputError, match=f"{last + 1} at position 1 is outside the vocabulary"):
        process_prompt(text_engine, [1, last + 1])


def test_numpy_integer_token_ids_become_ints(text_engine):
    np = pytest.importorskip("numpy")
    ids = process_prompt(text_engine, list(np.array([1, 2, 3]))).token_ids
    assert ids == [1, 2, 3] and all(type(i) is int for i in ids)


def test_a_text_longer_than_any_context_is_refused_before_tokenizing(text_engine, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("tokenized")

    monkeypatch.setattr(text_engine.tokenizer, "encode", never)
    with pytest.raises(InputTooLargeError, match="10001 characters"):
        process_prompt(text_engine, "x" * (text_engine.max_prompt_chars + 1))


def test_a_prompt_that_is_not_text_is_refused(text_engine):
    with pytest.raises(InputError, match='"prompt" must be a string'):
        process_prompt(text_engine, {"prompt": 42})


def test_no_token_covers_more_characters_than_the_longest_token_bound(text_engine):
    """The length bound must never refuse a text that fits: tokens x longest >= characters."""
    longest = longest_token_chars(text_engine.tokenizer)
    assert longest == max(len(t) for t in text_engine.tokenizer.get_vocab())
    for text in ["a" * 500, " " * 300, "USER: describe the image in detail " * 20, "\n\n\n" * 50]:
        assert len(text_engine.tokenizer.encode(text, add_special_tokens=False)) * longest >= len(text)


# ---- mm_processor_kwargs and multi_modal_uuids -------------------------------------------------------


@pytest.fixture
def recorded(engine, monkeypatch):
    """What process_prompt handed the processor's apply (which still runs)."""
    calls = []
    original = engine.processor.apply

    def recording(prompt, mm_data, hf_processor_mm_kwargs={}, *, mm_uuids=None):
        calls.append({"kwargs": hf_processor_mm_kwargs, "mm_uuids": mm_uuids})
        return original(prompt, mm_data, hf_processor_mm_kwargs, mm_uuids=mm_uuids)

    monkeypatch.setattr(engine.processor, "apply", recording)
    return calls


@pytest.mark.parametrize(
    "uuids, passed",
    [
        (None, None),
        ({}, None),
        ({"image": ["first", None]}, {"image": ["first", None]}),
        ({"image": ("first", "second")}, {"image": ["first", "second"]}),
        ({"image": [None, None]}, {"image": [None, None]}),
    ],
)
def test_item_ids_reach_the_processor(engine, recorded, uuids, passed):
    prompt = {**prompt_with_images(), "multi_modal_uuids": uuids, "mm_processor_kwargs": {"do_normalize": True}}
    inputs = process_prompt(engine, prompt)
    assert recorded == [{"kwargs": {"do_normalize": True}, "mm_uuids": passed}]
    assert len(inputs.mm_items) == 2


def test_a_named_item_is_keyed_by_its_id(engine, full):
    """No processor kwargs: the id is the item's key (processing.py), for the processor and the prefix cache."""
    inputs = process_prompt(engine, {**prompt_with_images(), "multi_modal_uuids": {"image": ["first", None]}})
    assert [item.hash for item in inputs.mm_items] == ["first", full.mm_items[1].hash]
    assert inputs.token_ids == full.token_ids


def test_one_string_names_a_single_item(engine, recorded):
    prompt = {"prompt": "USER: <image>\nHi ASSISTANT:", "multi_modal_data": {"image": random_images([(20, 20)])},
              "multi_modal_uuids": {"image": "only"}}  # fmt: skip
    assert [item.hash for item in process_prompt(engine, prompt).mm_items] == ["only"]
    assert recorded[0]["mm_uuids"] == {"image": ["only"]}


def test_precomputed_embeddings_are_named_under_their_modality(engine, recorded):
    hidden = engine.processor.info.get_hf_config().text_config.hidden_size
    embeds = torch.randn(1, 16, hidden)
    prompt = {"prompt": "USER: <image>\nHi ASSISTANT:", "multi_modal_data": {"image_embeds": embeds},
              "multi_modal_uuids": {"image": ["emb"]}}  # fmt: skip
    process_prompt(engine, prompt)
    assert recorded[0]["mm_uuids"] == {"image": ["emb"]}


@pytest.mark.parametrize(
    "uuids, match",
    [
        (["a", "b"], r'"multi_modal_uuids" must be a dict .* got a list'),
        ({"video": ["a"]}, r"names the modality 'video', which has no items .* \(modalities given: 'image'\)"),
        ({"image": ["a"]}, r"multi_modal_uuids\['image'\] has 1 id\(s\) for 2 image item\(s\)"),
        ({"image": ["a", "b", "c"]}, r"has 3 id\(s\) for 2 image"),
        ({"image": "a"}, r"has 1 id\(s\) for 2 image"),
        ({"image": ["a", 7]}, r"multi_modal_uuids\['image'\]\[1\] must be a string or null, got a number"),
        ({"image": {"a": 1}}, r"multi_modal_uuids\['image'\] must be a list of ids .* got a dict"),
    ],
)
def test_ids_that_do_not_match_the_items_are_input_errors(engine, recorded, uuids, match):
    with pytest.raises(InputError, match=match):
        process_prompt(engine, {**prompt_with_images(), "multi_modal_uuids": uuids})
    assert recorded == []  # refused before any processing


@pytest.mark.parametrize("kwargs", [["do_normalize"], "do_normalize=False", {1: True}])
def test_processor_kwargs_must_be_a_dict_of_names(engine, text_engine, kwargs):
    for target, prompt in ((engine, prompt_with_images()), (text_engine, {"prompt": "hi"})):
        with pytest.raises(InputError, match='"mm_processor_kwargs" must be a dict of keyword names'):
            process_prompt(target, {**prompt, "mm_processor_kwargs": kwargs})


def test_a_text_only_model_refuses_ids_without_items_and_ignores_good_kwargs(text_engine):
    assert process_prompt(text_engine, {"prompt": "hi", "mm_processor_kwargs": {"x": 1}}).token_ids
    with pytest.raises(InputError, match="names the modality 'image', which has no items .* none"):
        process_prompt(text_engine, {"prompt": "hi", "multi_modal_uuids": {"image": ["a"]}})
