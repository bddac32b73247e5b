"""The demo VLM's slot encoder: its loss and accuracy, and its export as a LLaVA projector whose output is
the slot token's embedding."""

from __future__ import annotations

import random

import torch

from tools import demo_vlm_data as data
from tools import demo_vlm_slots as slots
from tools.demo_vlm_encoder import (
    PROJECTOR_ACT,
    SHAPE_FIELDS,
    TEXT_FIELDS,
    SceneBatches,
    SlotEncoder,
    export_projector,
    field_errors,
    scene_batch,
    slot_errors,
    to_pixels,
)

SMALL = dict(image_size=128, patch_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
             num_attention_heads=4)  # fmt: skip


def test_the_exported_projector_outputs_the_embedding_of_the_predicted_slot_token():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig
    from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

    torch.manual_seed(0)
    width, vocab = 96, len(slots.VOCAB)
    classifier = torch.nn.Linear(vocab, vocab)  # logit v = 10 * feature v - 5: a one-hot feature is a sure class
    with torch.no_grad():
        classifier.weight.copy_(10 * torch.eye(vocab))
        classifier.bias.fill_(-5.0)
    embeddings = torch.randn(vocab, width)
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=vocab, num_attention_heads=1),
        text_config=LlamaConfig(hidden_size=width, num_attention_heads=4), projector_hidden_act=PROJECTOR_ACT,
    )  # fmt: skip
    projector = LlavaMultiModalProjector(config)
    projector.load_state_dict(export_projector(classifier, embeddings, sharpen=4.0))
    tokens = torch.randint(0, vocab, (50,))
    sure = torch.nn.functional.one_hot(tokens, vocab).float()
    unsure = torch.rand(20, vocab)
    with torch.no_grad():
        torch.testing.assert_close(projector(sure), embeddings[tokens], rtol=0, atol=1e-6)
        expected = torch.sigmoid(4.0 * classifier(unsure)) @ embeddings  # in general: the sigmoid-weighted sum
        torch.testing.assert_close(projector(unsure), expected, rtol=1e-4, atol=1e-4)


def test_the_encoder_learns_its_slots_from_pixels():
    torch.manual_seed(0)
    encoder = SlotEncoder.from_config(SMALL)
    scenes = [data.make_scene(random.Random(i), "train") for i in range(4)]
    pixels, target, patch_target = scene_batch(scenes)
    assert pixels.shape == (4, 3, 128, 128) and torch.equal(pixels[1], to_pixels(data.render(scenes[1])))
    assert target.tolist() == [slots.slot_classes(s) for s in scenes]
    logits, middle = encoder(pixels)
    assert logits.shape == (4, slots.NUM_SLOTS, len(slots.VOCAB)) and middle.shape == (4, slots.NUM_SLOTS, 32)
    optimizer = torch.optim.AdamW(encoder.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):  # one batch, memorised: the loss falls and the fillers come out right first
        loss, accuracy = encoder.loss(pixels, target, patch_target)
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert losses[-1] < 0.5 * losses[0] and 0.0 <= accuracy <= 1.0
    with torch.no_grad():
        slot_wrong, scene_wrong = slot_errors(encoder(pixels)[0], scenes)
    fillers = sum(w == slots.FILLER for s in scenes for w in slots.slot_words(s)) / (4 * slots.NUM_SLOTS)
    assert slot_wrong <= 1 - fillers + 1e-6 and 0.0 <= scene_wrong <= 1.0


def _misread(scenes: list[dict], field: str) -> torch.Tensor:
    """Sure slot logits of the scenes' true slots, except `field` of every shape record, read as the next
    vocabulary entry."""
    classes = torch.tensor([slots.slot_classes(s) for s in scenes])
    for row, scene in enumerate(scenes):
        words = slots.slot_words(scene)
        for start in range(0, len(scene["objects"]) * slots.RECORD, slots.RECORD):
            if words[start + 1] not in (" word", " number"):
                k = start + SHAPE_FIELDS.index(field)
                classes[row, k] = (classes[row, k] + 1) % len(slots.VOCAB)
    return torch.nn.functional.one_hot(classes, len(slots.VOCAB)).float()


def test_field_errors_name_the_field_that_is_misread():
    rng = random.Random(2)
    scenes = [data.make_scene(rng, "train", text=True) for _ in range(6)]
    errors = field_errors(_misread(scenes, "colour"), scenes)
    assert set(errors) == set(SHAPE_FIELDS) | {f"text {name}" for name in TEXT_FIELDS}
    assert errors["colour"] == 1.0 and sum(errors.values()) == 1.0
    assert slot_errors(_misread(scenes, "colour"), scenes)[1] == 1.0  # every scene has a shape: all are wrong


def test_scene_batches_are_seeded_per_worker_and_hold_the_scenes_targets():
    from torch.utils.data import DataLoader

    def first_batches(seed: int, workers: int, n: int = 2) -> list:
        loader = DataLoader(SceneBatches(seed, batch=3, text_share=1.0), batch_size=None, num_workers=workers)
        batches = []
        for batch in loader:
            batches.append(batch)
            if len(batches) == n:
                return batches

    one, again, other = first_batches(0, 0), first_batches(0, 0), first_batches(1, 0)
    assert all(torch.equal(a, b) for x, y in zip(one, again) for a, b in zip(x, y))
    assert not torch.equal(one[0][0], other[0][0])
    pixels, target, patch_target = one[0]
    assert pixels.shape == (3, 3, 128, 128) and target.shape == (3, slots.NUM_SLOTS)
    assert patch_target.shape[0] == 3 and patch_target.shape[-1] == slots.NUM_SLOTS
    # text_share 1: every scene holds a word or a number, so some slot names its kind
    kinds = [slots.VOCAB.index(" word"), slots.VOCAB.index(" number")]
    assert all(any(c in kinds for c in row) for row in target.tolist())
    # two workers take turns: the second batch is worker 1's first, a different stream from worker 0's
    two = first_batches(0, 2)
    assert torch.equal(two[0][0], one[0][0]) and not torch.equal(two[1][0], one[1][0])
