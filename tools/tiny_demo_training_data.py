"""The training data of the demo model, as token sequences: scenes with all their questions, per-patch
labels for the auxiliary vision loss, the tokenizer and chat template, and the packing of all questions about
one image into one sequence (see tools/train_tiny_demo_model.py)."""

from __future__ import annotations

import random

import numpy as np
import torch
from PIL import Image, ImageDraw
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from tools import tiny_demo_data

# LLaVA-1.5 conversation format. A user turn renders as "USER: <image>\n{text} ", an assistant turn as
# "ASSISTANT: {text}</s>", and add_generation_prompt appends "ASSISTANT:". So one image question renders as
# "USER: <image>\n{question} ASSISTANT:" and the training text is that plus " {answer}</s>".
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{{ message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join(' ') }}"
    "{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ '</s>' }}{% else %}{{ ' ' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def prompt_text(question: str) -> str:
    return f"USER: <image>\n{question} ASSISTANT:"


# ----------------------------------------------------------------------------------------------- data


def make_scenes(n: int, seed: int, image_size: int, patch_size: int, num_shapes: int | None = None):
    """n scenes: uint8 images [n, 3, H, W], per-scene lists of (question, answer, kind), and per-patch labels
    [n, patches, 2] (shape and colour of the object covering each patch; 0: background)."""
    rng = random.Random(seed)
    images = np.empty((n, 3, image_size, image_size), dtype=np.uint8)
    grid = image_size // patch_size
    labels = np.empty((n, grid * grid, len(AUX_CLASSES)), dtype=np.int64)
    qas = []
    for i in range(n):
        shapes = tiny_demo_data.make_scene(rng, num_shapes)
        image, scene_qas = make_scene_all_questions(rng, image_size, shapes)
        images[i] = np.asarray(image).transpose(2, 0, 1)
        labels[i] = patch_labels(shapes, image_size, patch_size)
        qas.append(scene_qas)
    return torch.from_numpy(images), qas, torch.from_numpy(labels)


# Per-patch targets of the auxiliary loss: for the object covering the patch, its shape, its colour, its
# position answer and its rank from the left (the caption's order); class 0 is background.
AUX_CLASSES = (
    1 + len(tiny_demo_data.SHAPES), 1 + len(tiny_demo_data.COLOURS), 1 + len(tiny_demo_data.POSITIONS), 1 + 3
)  # fmt: skip


def patch_labels(shapes: list[dict], image_size: int, patch_size: int, min_cover: float = 0.2) -> np.ndarray:
    """[patches, len(AUX_CLASSES)] targets of the object covering most of each patch when it covers at least
    min_cover of it, else zeros. Patches in row-major order, as CLIP's patch embedding emits them."""
    scale = 4
    canvas = Image.new("L", (image_size * scale, image_size * scale), 0)
    draw = ImageDraw.Draw(canvas)
    for k, shape in enumerate(shapes, start=1):
        tiny_demo_data.draw_shape(draw, shape, image_size * scale, k)
    grid, cell = image_size // patch_size, patch_size * scale
    owner = np.asarray(canvas)[: grid * cell, : grid * cell].reshape(grid, cell, grid, cell).transpose(0, 2, 1, 3)
    owner = owner.reshape(grid * grid, cell * cell)
    cover = np.stack([(owner == k).mean(-1) for k in range(1, len(shapes) + 1)], -1)  # [patches, shapes]
    best = cover.argmax(-1)
    rank = {id(s): r for r, s in enumerate(sorted(shapes, key=lambda s: s["cx"]))}
    out = np.zeros((grid * grid, len(AUX_CLASSES)), dtype=np.int64)
    for p in np.nonzero(cover.max(-1) >= min_cover)[0]:
        s = shapes[best[p]]
        out[p] = (
            1 + tiny_demo_data.SHAPES.index(s["shape"]),
            1 + list(tiny_demo_data.COLOURS).index(s["colour"]),
            1 + tiny_demo_data.POSITIONS.index(tiny_demo_data.position_of(s["cx"], s["cy"])),
            1 + rank[id(s)],
        )
    return out


def make_scene_all_questions(rng: random.Random, size: int, shapes: list[dict]):
    """The scene's image and every question it allows: colour/position of each unique shape type, shape of
    each unique colour, the count and the caption."""
    out = [(tiny_demo_data.QUESTIONS["count"], tiny_demo_data.NUMBER_WORDS[len(shapes)], "count")]
    for s in shapes:
        if sum(o["shape"] == s["shape"] for o in shapes) == 1:
            out.append((tiny_demo_data.QUESTIONS["colour"].format(shape=s["shape"]), s["colour"], "colour"))
            q = tiny_demo_data.QUESTIONS["position"].format(shape=s["shape"])
            out.append((q, tiny_demo_data.position_of(s["cx"], s["cy"]), "position"))
        if sum(o["colour"] == s["colour"] for o in shapes) == 1:
            out.append((tiny_demo_data.QUESTIONS["shape"].format(colour=s["colour"]), s["shape"], "shape"))
    out.append((tiny_demo_data.QUESTIONS["describe"], tiny_demo_data.describe(shapes), "describe"))
    return tiny_demo_data.render(rng, shapes, size), out


# ------------------------------------------------------------------------------------------ tokenizer


def build_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on `texts`, shaped like llava-hf/llava-1.5's tokenizer (see testkit)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens([AddedToken("<image>", normalized=False, special=True), AddedToken("<pad>", special=True)])
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
    )


class Encoder:
    """Token ids of the shared image prefix and of each question/answer segment (cached)."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, num_image_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.image = "<image>" * num_image_tokens
        self.prefix = tokenizer(f"USER: {self.image}\n")["input_ids"]
        self.cache: dict[tuple[str, str], tuple[list[int], int]] = {}

    def segment(self, question: str, answer: str) -> tuple[list[int], int]:
        """(segment ids after the prefix, number of prompt tokens in it); the rest are targets."""
        key = (question, answer)
        if key not in self.cache:
            prompt = self.tokenizer(prompt_text(question).replace("<image>", self.image))["input_ids"]
            full = self.tokenizer(prompt_text(question).replace("<image>", self.image) + f" {answer}</s>")["input_ids"]
            p = len(self.prefix)
            assert full[:p] == self.prefix and full[: len(prompt)] == prompt, (question, answer)
            assert full[-1] == self.tokenizer.eos_token_id
            self.cache[key] = (full[p:], len(prompt) - p)
        return self.cache[key]


def pack(encoder: Encoder, scene_qas: list[list[tuple[str, str, str]]]):
    """Batch of packed sequences: ids, position ids, 4-D additive attention mask, labels (-100: no loss),
    and for each segment (batch row, label positions, kind) for per-question scoring."""
    prefix = encoder.prefix
    rows = []
    for qas in scene_qas:
        ids, pos, seg, labels, spans = list(prefix), list(range(len(prefix))), [0] * len(prefix), [], []
        for k, (q, a, kind) in enumerate(qas, start=1):
            segment, n_prompt = encoder.segment(q, a)
            start = len(ids)
            ids += segment
            pos += range(len(prefix), len(prefix) + len(segment))
            seg += [k] * len(segment)
            spans.append((start + n_prompt - 1, start + len(segment) - 1, kind))  # label positions [lo, hi)
        rows.append((ids, pos, seg, spans))
    length = max(len(r[0]) for r in rows)
    B = len(rows)
    input_ids = torch.full((B, length), encoder.tokenizer.pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((B, length), dtype=torch.long)
    segs = torch.full((B, length), -1, dtype=torch.long)
    labels = torch.full((B, length), -100, dtype=torch.long)
    segments = []
    for b, (ids, pos, seg, spans) in enumerate(rows):
        n = len(ids)
        input_ids[b, :n] = torch.tensor(ids)
        position_ids[b, :n] = torch.tensor(pos)
        segs[b, :n] = torch.tensor(seg)
        for lo, hi, kind in spans:
            labels[b, lo:hi] = input_ids[b, lo + 1 : hi + 1]
            segments.append((b, lo, hi, kind))
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    same = (segs[:, :, None] == segs[:, None, :]) | (segs[:, None, :] == 0)  # [B, query, key]
    allowed = (causal & same) | torch.eye(length, dtype=torch.bool)  # padding attends to itself
    mask = torch.zeros(B, 1, length, length).masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)
    return input_ids, position_ids, mask, labels, segments
