"""The demo VLM's reader stage: conversations about a scene whose image positions hold its slot tokens,
labelled on the answers only, relations and counts most often (some ending in a text-only chat)."""

from __future__ import annotations

import random

import torch

from tools import demo_vlm_data as data
from tools import demo_vlm_reader as reader
from tools import demo_vlm_slots as slots
from tools.demo_vlm_datasets import KINDS


def test_a_conversation_asks_distinct_questions_relations_and_counts_most():
    chats = [("Hello!", "Hello! How can I help you today?")]
    ends_in_chat = 0
    kinds_asked: list[str] = []
    for seed in range(60):
        scene, qas = reader.sample_conversation(random.Random(seed), turns=4, chats=chats, chat_share=0.5)
        kinds = [kind for kind, _, _ in qas]
        assert 1 <= len(kinds) <= 5 and "chat" not in kinds[:-1]
        questions = [q for kind, q, _ in qas if kind != "chat"]
        assert len(questions) == len(set(questions))
        ends_in_chat += kinds[-1] == "chat"
        kinds_asked += kinds
        assert data.layout_split(scene) == "train"
    assert 0 < ends_in_chat < 60
    share = {kind: kinds_asked.count(kind) for kind in KINDS}
    assert share["relation"] > share["colour"] and share["count"] > share["colour"]


def test_kind_weights_change_the_mix():
    asked: list[str] = []
    for seed in range(40):
        _, qas = reader.sample_conversation(random.Random(seed), turns=2, chats=[("Hi", "Hi!")], chat_share=0.0,
                                            kind_weights={"colour": 50.0, "relation": 0.01, "count": 0.01})  # fmt: skip
        asked += [kind for kind, _, _ in qas]
    assert asked.count("colour") > asked.count("relation") + asked.count("count")


def test_no_compound_shares_a_part_with_a_question_asked_alone():
    """Else its answer is in the conversation already, to copy instead of read from the slots."""
    compounds = 0
    for seed in range(40):
        _, qas = reader.sample_conversation(random.Random(seed), turns=6, chats=[("Hi", "Hi!")], chat_share=0.0,
                                            kind_weights={"compound": 20.0, "count": 5.0, "colour": 5.0})  # fmt: skip
        alone = [q[:-1].lower() for kind, q, _ in qas if kind != "compound" and q.endswith("?")]
        for question in (q.lower() for kind, q, _ in qas if kind == "compound"):
            compounds += 1
            assert not [part for part in alone if part in question], question
    assert compounds >= 20


def test_repeats_a_part_sees_a_part_asked_before_or_after():
    count = ("count", "How many stars are there?", "two")
    both = ("compound", "How many stars are there, and what colour is the circle?", "two; red")
    other = ("compound", "How many squares are there, and which colour is the circle?", "one; red")
    assert reader.repeats_a_part(both, [count]) and reader.repeats_a_part(count, [both])
    assert not reader.repeats_a_part(other, [count]) and not reader.repeats_a_part(count, [other])
    assert not reader.repeats_a_part(("greeting", "Hi", "Hello!"), [other])  # "Hi" is in "which", not a part


def test_conversations_hold_the_slots_and_are_labelled_on_their_answers_only(tokenizer):
    scene = data.make_scene(random.Random(0))
    qas = [("colour", "What colour is the star?", "pink"), ("count", "How many shapes are there?", "three")]
    item = reader.reader_conversation(tokenizer, scene, qas)
    ids, labels = item["input_ids"], item["labels"]
    assert ids[item["image_mask"]].tolist() == slots.slot_ids(scene, tokenizer)
    text = tokenizer.decode(ids[~item["image_mask"]])
    assert text.count("<image>") == 0 and "user\n\nWhat colour is the star?" in text  # the image, then "\n"
    assert tokenizer.decode(ids[labels != -100]) == "pink<|im_end|>three<|im_end|>"
    assert torch.equal(labels[labels != -100], ids[labels != -100])
    # each answer (with its <|im_end|>) weighs sqrt(its length) in all: its tokens 1/sqrt(length) each
    lengths = [len(tokenizer.encode(answer + "<|im_end|>", add_special_tokens=False)) for answer in ("pink", "three")]
    expected = torch.cat([torch.full((n,), n**-0.5) for n in lengths])
    assert torch.allclose(item["weights"][labels != -100], expected)
    assert torch.all(item["weights"][labels == -100] == 0)


def test_a_generation_prompt_ends_where_the_answer_starts(tokenizer):
    scene = data.make_scene(random.Random(1))
    image = slots.slot_ids(scene, tokenizer)
    ids, at = reader.chat_ids(tokenizer, [("shape", "What shape is it?", "")], image, generation=True)
    assert ids[at : at + len(image)] == image
    assert tokenizer.decode(ids).endswith("What shape is it?<|im_end|>\n<|im_start|>assistant\n")


def test_collate_pads_every_field():
    items = [
        {"input_ids": torch.arange(n), "labels": torch.arange(n), "weights": torch.ones(n),
         "image_mask": torch.ones(n, dtype=torch.bool)}
        for n in (3, 5)
    ]  # fmt: skip
    batch = reader.collate(items, pad_id=7)
    assert batch["input_ids"][0].tolist() == [0, 1, 2, 7, 7] and batch["labels"][0, 3:].tolist() == [-100, -100]
    assert batch["attention_mask"].sum(1).tolist() == [3, 5] and not batch["image_mask"][0, 3:].any()
    assert batch["weights"][0, 3:].sum() == 0


def test_batched_answers_are_the_one_at_a_time_answers(tokenizer):
    """Left padding must not change an answer: a tiny random Llama answers the same prompts (of different
    lengths, short and long kinds) in one batch and one by one."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    rng = random.Random(3)
    items = [(data.make_scene(rng), kind, question, "")
             for kind, question in [("shape", "What shape is it?"), ("compound", "How many shapes, and which colour?"),
                                    ("count", "How many stars are there in this picture?")]]  # fmt: skip
    lengths = {
        len(reader.chat_ids(tokenizer, [(k, q, "")], slots.slot_ids(s, tokenizer), True)[0]) for s, k, q, _ in items
    }
    assert len(lengths) == 3  # the batch is padded
    batched = reader.reader_answers(model, tokenizer, items, batch=3)
    alone = [reader.reader_answers(model, tokenizer, items[i : i + 1], batch=1)[0] for i in range(3)]
    assert batched[0] != "" and batched == alone
