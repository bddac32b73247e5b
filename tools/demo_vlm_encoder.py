"""The demo VLM's vision encoder: a CLIP-style ViT trained from scratch to write a scene's slot tokens
(``tools/demo_vlm_slots.py``) into its image tokens, and its export as a plain LLaVA projector.

Training sees the tower and a linear slot classifier: image position k (patch k, CLS dropped: LLaVA's
"default" strategy) is classified into ``VOCAB`` one-vs-all (binary cross-entropy per class), so that
``sigmoid(logits)`` is near one-hot. Per-patch heads (``tools/demo_vlm_targets.py``) on a middle layer teach
the tower what lies under each patch first (deep supervision); the upper layers then gather each object's
attributes into its slots.

``export_projector`` turns the classifier into LLaVA's ``linear_1 -> sigmoid -> linear_2``: linear_1 holds the
classifier (sharpened) in its first ``len(VOCAB)`` rows, linear_2 the vocabulary's token embeddings in as many
columns, so the projector's output is the embedding of the slot's token, which is what the reader
(``tools/demo_vlm_reader.py``) was trained on.
"""

from __future__ import annotations

import functools
import json
import random
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tools import demo_vlm_data as data
from tools import demo_vlm_slots as slots
from tools.demo_vlm_pictures import make_picture
from tools.demo_vlm_targets import PatchHeads, patch_targets

PROJECTOR_ACT = "sigmoid"
AUX_LAYER = 3  # the per-patch heads read this layer's output: the layers above gather slots from it
UNUSED_BIAS = -30.0  # linear_1's rows past the vocabulary: sigmoid(-30) ~ 1e-13, nothing reaches linear_2
NEW_WORD_BIAS = -8.0  # a slot word new to a continued encoder starts as "never": sigmoid(-8) ~ 3e-4


@functools.cache
def _clip_normalisation() -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD  # a slow lookup: once per process

    return torch.tensor(OPENAI_CLIP_MEAN), torch.tensor(OPENAI_CLIP_STD)


def to_pixels(image) -> torch.Tensor:
    """The CLIP image processor's normalisation for a 128 px image (no resize: scenes are drawn at size)."""
    mean, std = _clip_normalisation()
    array = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255)
    return ((array - mean) / std).permute(2, 0, 1)


class SlotEncoder(torch.nn.Module):
    """The tower, its slot classifier and the middle layer's per-patch heads (those are thrown away)."""

    def __init__(self, tower, aux_layer: int) -> None:
        super().__init__()
        width = tower.config.hidden_size
        self.tower, self.aux_layer = tower, aux_layer
        self.classifier = torch.nn.Linear(width, len(slots.VOCAB))
        self.heads = PatchHeads(width)

    @classmethod
    def from_config(cls, vision: dict) -> "SlotEncoder":
        """A fresh CLIP tower of the given sizes, the per-patch heads on its ``AUX_LAYER``."""
        from transformers import CLIPVisionConfig, CLIPVisionModel

        return cls(CLIPVisionModel(CLIPVisionConfig(**vision)), aux_layer=AUX_LAYER)

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pixels [B, 3, H, W] -> (slot logits [B, P, V], middle-layer patch features [B, P, width])."""
        hidden = self.tower(pixels, output_hidden_states=True).hidden_states
        return self.classifier(hidden[-1][:, 1:]), hidden[self.aux_layer][:, 1:]

    def loss(self, pixels: torch.Tensor, target: torch.Tensor, patch_target: torch.Tensor):
        """(slot loss + per-patch loss, slot accuracy) on a batch of rendered scenes: `target` [B, P] their slot
        classes, `patch_target` their ``patch_targets`` (both from ``scene_batch``, on the pixels' device)."""
        logits, middle = self(pixels)
        onehot = F.one_hot(target, len(slots.VOCAB)).float()
        slot_loss = F.binary_cross_entropy_with_logits(logits.float(), onehot, reduction="none").sum(-1).mean()
        patch_loss = self.heads.loss(middle, patch_target)
        accuracy = (logits.argmax(-1) == target).float().mean()
        return slot_loss + patch_loss, accuracy


def scene_batch(scenes: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scenes -> (pixels [B, 3, H, W], slot classes [B, P], per-patch targets [B, len(TARGETS), P]): the
    encoder's training inputs, CPU tensors (made in data-loader workers on a GPU run)."""
    pixels = torch.stack([to_pixels(data.render(s)) for s in scenes])
    target = torch.tensor([slots.slot_classes(s) for s in scenes])
    return pixels, target, torch.stack([patch_targets(s) for s in scenes])


class SceneBatches(torch.utils.data.IterableDataset):
    """Endless training batches of ``scene_batch``, each worker drawing from its own seeded generator (the
    stream depends on the seed and the number of workers only; a data loader interleaves the workers in
    turn): `picture_share` of them pictures with no shapes (all slots fillers), `text_share` of the scenes with
    a text, `align_share` of them with two objects in one column or row (``data.align_pair``)."""

    def __init__(
        self, seed: int, batch: int, text_share: float, picture_share: float = 0.0, align_share: float = 0.0
    ) -> None:
        self.seed, self.batch, self.text_share = seed, batch, text_share
        self.picture_share, self.align_share = picture_share, align_share

    def _scene(self, rng: random.Random) -> dict:
        if rng.random() < self.picture_share:
            return make_picture(rng, "train")
        scene = data.make_scene(rng, "train", text=True if rng.random() < self.text_share else None)
        if self.align_share and rng.random() < self.align_share:  # no draw at 0: earlier runs' streams kept
            scene = data.align_pair(scene, rng)
        return scene

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        rng = random.Random(self.seed * 1000 + (info.id if info else 0))
        while True:
            yield scene_batch([self._scene(rng) for _ in range(self.batch)])


def save_encoder(encoder: SlotEncoder, path: Path) -> None:
    """A checkpoint that ``load_encoder`` continues from, with the slot vocabulary it was trained on."""
    state = {k: v.cpu() for k, v in encoder.state_dict().items()}
    save_file(state, path, metadata={"slot_vocab": json.dumps(slots.VOCAB)})


@torch.no_grad()
def load_encoder(encoder: SlotEncoder, path: Path) -> None:
    """Continue from an earlier encoder: a checkpoint of ``save_encoder``, or a shipped vision side (a folder with
    vision.safetensors and a training.json naming its ``slot_vocab`` and ``sharpen``; its per-patch heads were
    not shipped). The classifier's rows follow their slot words, so a vocabulary that gained words (a colour, a
    position) keeps what was learnt: a new word starts at ``NEW_WORD_BIAS``. Heads whose size changed start
    fresh."""
    path = Path(path)
    if path.is_dir():
        record = json.loads((path / "training.json").read_text())
        vocab, sharpen = record["slot_vocab"], record["sharpen"]
        shipped = load_file(path / "vision.safetensors")
        tower = {k.removeprefix("vision_tower."): v for k, v in shipped.items() if k.startswith("vision_tower.")}
        state = {f"tower.{k}": v.float() for k, v in tower.items()}
        state["classifier.weight"] = shipped["multi_modal_projector.linear_1.weight"][: len(vocab)].float() / sharpen
        state["classifier.bias"] = shipped["multi_modal_projector.linear_1.bias"][: len(vocab)].float() / sharpen
    else:
        with safe_open(path, "pt") as f:
            vocab = json.loads((f.metadata() or {}).get("slot_vocab", json.dumps(slots.VOCAB)))
        state = load_file(path)
    weight, bias = state.pop("classifier.weight"), state.pop("classifier.bias")
    own = encoder.state_dict()
    kept = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    encoder.load_state_dict(kept, strict=False)
    encoder.classifier.weight.zero_()
    encoder.classifier.bias.fill_(NEW_WORD_BIAS)
    for row, word in enumerate(slots.VOCAB):
        if word in vocab:
            encoder.classifier.weight[row] = weight[vocab.index(word)]
            encoder.classifier.bias[row] = bias[vocab.index(word)]


def slot_errors(logits: torch.Tensor, scenes: list[dict]) -> tuple[float, float]:
    """(share of slots wrong, share of scenes with any slot wrong) by argmax of the encoder's slot logits."""
    target = torch.tensor([slots.slot_classes(s) for s in scenes])
    wrong = logits.argmax(-1).cpu() != target
    return wrong.float().mean().item(), wrong.any(-1).float().mean().item()


SHAPE_FIELDS = ("column", "size", "colour", "shape", "position", "row", "end")
TEXT_FIELDS = ("column", "kind", "word or digit", "digit", "position", "row", "end")


def record_fields(words: list[str], start: int) -> tuple[str, ...]:
    """The field names of the record at slot `start` of a scene's ``slot_words``: a text's or a shape's."""
    return TEXT_FIELDS if words[start + 1] in (" word", " number") else SHAPE_FIELDS


def field_errors(logits: torch.Tensor, scenes: list[dict]) -> dict[str, float]:
    """Share of wrong slots per record field (``SHAPE_FIELDS``; a text's record by ``TEXT_FIELDS``, prefixed
    "text ") by argmax of the encoder's slot logits: where the encoder still errs."""
    wrong, total = defaultdict(int), defaultdict(int)
    for row, scene in enumerate(scenes):
        target = slots.slot_classes(scene)
        words = slots.slot_words(scene)
        predicted = logits[row].argmax(-1).tolist()  # tolist() leaves the GPU
        for start in range(0, len(scene["objects"]) * slots.RECORD, slots.RECORD):
            fields = record_fields(words, start)
            for k, name in enumerate(fields):
                key = f"text {name}" if fields is TEXT_FIELDS else name
                wrong[key] += predicted[start + k] != target[start + k]
                total[key] += 1
    return {key: wrong[key] / total[key] for key in total}


@torch.no_grad()
def export_projector(classifier: torch.nn.Linear, embeddings: torch.Tensor, sharpen: float) -> dict:
    """LLaVA projector weights (``linear_1`` / ``linear_2``, act ``PROJECTOR_ACT``) whose output at a patch is
    sum_v sigmoid(sharpen * logit_v) * embedding_v: the slot token's embedding once the classifier is sure.
    `embeddings` [V, text width]: the token embeddings of ``VOCAB`` in order."""
    vocab, width = embeddings.shape
    linear_1_w = torch.zeros(width, classifier.in_features)
    linear_1_b = torch.full((width,), UNUSED_BIAS)
    linear_1_w[:vocab] = sharpen * classifier.weight.float()
    linear_1_b[:vocab] = sharpen * classifier.bias.float()
    linear_2_w = torch.zeros(width, width)
    linear_2_w[:, :vocab] = embeddings.float().T
    return {"linear_1.weight": linear_1_w, "linear_1.bias": linear_1_b,
            "linear_2.weight": linear_2_w, "linear_2.bias": torch.zeros(width)}  # fmt: skip
