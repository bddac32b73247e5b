"""Which stage of the demo VLM a wrong answer comes from: the vision encoder (the slots it wrote differ from the
scene's true slots) or the reader (the LoRA'd SmolLM2 answers wrongly even from the true slots). The two stages
train apart (tools/train_demo_vlm.py), so the next round should train the one that fails.

* ``wrong_slots(predicted, scene) -> ["obj2 colour: ' red' -> ' pink'", ...]``: the slots an encoder's argmax got
  wrong, named by object and record field.
* ``encoder_slots(encoder_path, images) -> [[class, ...], ...]``: an encoder's argmax slot classes.
* ``true_slot_prompt(tokenizer, question, scene) -> token ids``: the one-turn chat with the scene's true slot
  tokens where the image's are (what the reader trained on).
* ``blame(right_from_true_slots, slots_wrong) -> "reader" | "encoder" | "both" | "projection"``, and
  ``blame_misses`` all of it for the misses of ``tools/eval_demo_model.py --blame``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tools import demo_vlm_slots as slots
from tools.demo_vlm_encoder import SlotEncoder, load_encoder, record_fields, to_pixels
from tools.demo_vlm_reader import chat_ids, normalise

CAUSES = ("reader", "encoder", "both", "projection")


def wrong_slots(predicted: list[int], scene: dict) -> list[str]:
    """The slots whose predicted class (index into ``slots.VOCAB``) is not the scene's, as
    "obj<k> <field>: <true word> -> <predicted word>" (k: the record's place from the left; "filler" past the
    last record)."""
    target, words = slots.slot_classes(scene), slots.slot_words(scene)
    out = []
    for i, (got, want) in enumerate(zip(predicted, target)):
        if got == want:
            continue
        record, field = divmod(i, slots.RECORD)
        if record < len(scene["objects"]):
            where = f"obj{record + 1} {record_fields(words, record * slots.RECORD)[field]}"
        else:
            where = "filler"
        out.append(f"{where}: {slots.VOCAB[want]!r} -> {slots.VOCAB[got]!r}")
    return out


@torch.no_grad()
def encoder_slots(encoder_path: Path, images: list, batch: int = 64) -> list[list[int]]:
    """The slot classes an encoder writes for each image (a rendered scene; argmax of its classifier, which the
    projector's sigmoid sharpens); `encoder_path`: a shipped vision side or a training checkpoint
    (``load_encoder``)."""
    from tools.train_demo_vlm import VISION

    encoder = SlotEncoder.from_config(VISION)
    load_encoder(encoder, encoder_path)
    encoder.eval()
    out = []
    for start in range(0, len(images), batch):
        pixels = torch.stack([to_pixels(image) for image in images[start : start + batch]])
        out += encoder(pixels)[0].argmax(-1).tolist()
    return out


def true_slot_prompt(tokenizer, question: str, scene: dict) -> list[int]:
    """The one-turn chat asking `question`, the scene's true slot tokens in the image's place, ready to answer."""
    return chat_ids(tokenizer, [("", question, "")], slots.slot_ids(scene, tokenizer), generation=True)[0]


def blame(right_from_true_slots: bool, slots_wrong: bool) -> str:
    """The cause of a wrong answer: the reader when it errs from the true slots too ("both" when the encoder's
    slots were wrong as well), the encoder when the true slots give the right answer and the encoder's did not
    match them, "projection" when the encoder's argmax matched but its soft embeddings still misled the reader."""
    if not right_from_true_slots:
        return "both" if slots_wrong else "reader"
    return "encoder" if slots_wrong else "projection"


def blame_misses(llm, tokenizer, vision_dir: Path, misses: list[tuple[dict, object, str, str]], max_tokens: int):
    """For each miss (scene, its image, question, expected answer): (cause, the answer from the true slots, the
    encoder's wrong slots), the true-slot answers generated greedily by `llm` (the assembled demo model)."""
    from tessera import SamplingParams

    if not misses:
        return []
    predicted = encoder_slots(vision_dir, [image for _, image, _, _ in misses])
    prompts = [{"prompt_token_ids": true_slot_prompt(tokenizer, q, scene)} for scene, _, q, _ in misses]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    out = []
    for (scene, _, _, expected), classes, output in zip(misses, predicted, outputs):
        answer = output.outputs[0].text
        wrong = wrong_slots(classes, scene)
        out.append((blame(normalise(answer) == normalise(expected), bool(wrong)), answer, wrong))
    return out
