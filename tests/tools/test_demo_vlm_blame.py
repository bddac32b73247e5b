"""Which stage a demo-VLM miss comes from: wrong slots named from the scene itself, the causes' truth table, the
encoder's slots read through a checkpoint whose classifier can only say one word."""

from __future__ import annotations

import random

import torch

from tools import demo_vlm_data as data
from tools import demo_vlm_slots as slots
from tools.demo_vlm_blame import blame, encoder_slots, true_slot_prompt, wrong_slots


def _scene_with_shapes_and_text():
    rng = random.Random(3)
    while True:
        scene = data.make_scene(rng, "train", text=True)
        if len(scene["objects"]) >= 2 and any("text" not in o for o in scene["objects"]):
            return scene


def test_the_true_slots_have_nothing_wrong_and_one_changed_slot_is_named():
    scene = _scene_with_shapes_and_text()
    classes, words = slots.slot_classes(scene), slots.slot_words(scene)
    assert wrong_slots(classes, scene) == []
    # the records' order: left to right along lines SLANT off the vertical (tests/tools/test_demo_vlm_data_order.py)
    left_to_right = sorted(scene["objects"], key=lambda o: o["cx"] + data.SLANT * o["cy"])
    k = next(i for i, o in enumerate(left_to_right) if "text" not in o)
    colour_slot = k * slots.RECORD + 2
    other = next(c for c in data.COLOURS if c != left_to_right[k]["colour"])
    changed = list(classes)
    changed[colour_slot] = slots.VOCAB.index(f" {other}")
    assert words[colour_slot] == f" {left_to_right[k]['colour']}"
    assert wrong_slots(changed, scene) == [f"obj{k + 1} colour: {words[colour_slot]!r} -> {' ' + other!r}"]
    changed[-1] = slots.VOCAB.index(slots.END)  # past the last record
    assert wrong_slots(changed, scene)[-1] == f"filler: {slots.FILLER!r} -> {slots.END!r}"


def test_a_miss_is_the_readers_when_the_true_slots_miss_too():
    assert blame(right_from_true_slots=False, slots_wrong=False) == "reader"
    assert blame(right_from_true_slots=False, slots_wrong=True) == "both"
    assert blame(right_from_true_slots=True, slots_wrong=True) == "encoder"
    assert blame(right_from_true_slots=True, slots_wrong=False) == "projection"


def test_the_encoders_slots_are_its_classifiers_argmax(tmp_path):
    from tools.demo_vlm_encoder import SlotEncoder, save_encoder
    from tools.train_demo_vlm import VISION

    torch.manual_seed(0)
    encoder = SlotEncoder.from_config(VISION)
    with torch.no_grad():  # whatever the tower sees, the classifier says FILLER
        encoder.classifier.weight.zero_()
        encoder.classifier.bias.fill_(-10.0)
        encoder.classifier.bias[slots.VOCAB.index(slots.FILLER)] = 10.0
    save_encoder(encoder, tmp_path / "encoder.safetensors")
    scene = _scene_with_shapes_and_text()
    (predicted,) = encoder_slots(tmp_path / "encoder.safetensors", [data.render(scene)])
    assert predicted == [slots.VOCAB.index(slots.FILLER)] * slots.NUM_SLOTS
    used = len(scene["objects"]) * slots.RECORD
    wrong = wrong_slots(predicted, scene)
    expected = sum(w != slots.FILLER for w in slots.slot_words(scene)[:used])
    assert len(wrong) == expected and all(not w.startswith("filler") for w in wrong)


def test_the_true_slot_prompt_holds_the_scenes_slots_then_the_question(tokenizer):
    scene = _scene_with_shapes_and_text()
    ids = true_slot_prompt(tokenizer, "What colour is the circle?", scene)
    image = slots.slot_ids(scene, tokenizer)
    at = next(i for i in range(len(ids)) if ids[i : i + len(image)] == image)
    assert tokenizer.decode(ids[at + len(image) :]).endswith(
        "What colour is the circle?<|im_end|>\n<|im_start|>assistant\n"
    )
