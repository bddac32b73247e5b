"""The demo VLM's image tokens, as words: a scene (``tools/demo_vlm_data.py``) written as a fixed-length list
of SmolLM2 tokens, one per image position, that the vision encoder learns to emit (as those tokens' embeddings)
and the language model's LoRA learns to answer from.

The objects are listed from left to right (``data.left_to_right``: one above the other, the upper first), one
record of ``RECORD`` slots each::

    shape:  "1" " large" " red" " circle" " left" "2" ";"   column rank, size, colour, shape, position, row rank, end
    text:   "2" " word" " cat" "." " top" "1" ";"           or " number" "4" "2" (a one-digit number: "7" ".")

The column rank is the object's place from the left (the record's own number), the row rank its place from the top
(1 = highest; side by side, the left first), so "left of" / "right of" and "above" / "below" are each a comparison
of two digits. The unused slots after the last record hold ``FILLER``. ``slot_words(scene)`` gives the
``NUM_SLOTS`` token strings, ``VOCAB`` every token a slot can hold; ``slot_ids`` maps them to SmolLM2's token ids
and ``slot_classes`` to indices into ``VOCAB``.
"""

from __future__ import annotations

import functools

from tools import demo_vlm_data as data

NUM_SLOTS = 64  # one per image token: an 8 x 8 grid of 16 px patches on a 128 px image
RECORD = 7  # slots per object
END, FILLER = ";", "."  # a record's last slot; the slots after the last record (and a one-digit number's 2nd)
VOCAB = sorted(
    {f" {w}" for w in (*data.SIZES, *data.COLOURS, *data.SHAPES, *data.POSITIONS, *data.WORDS, "word", "number")}
    | {str(d) for d in range(10)}
    | {END, FILLER}
)
MAX_OBJECTS = 5  # tools/demo_vlm_data.py draws one to five
assert MAX_OBJECTS * RECORD <= NUM_SLOTS


def _row_ranks(objects: list[dict]) -> dict[int, int]:
    return {i: rank + 1 for rank, i in enumerate(data.top_to_bottom(objects))}


def slot_words(scene: dict) -> list[str]:
    """The scene's ``NUM_SLOTS`` slot tokens (strings from ``VOCAB``)."""
    objects = scene["objects"]
    ranks = _row_ranks(objects)
    words: list[str] = []
    for column, i in enumerate(data.left_to_right(objects), start=1):
        o = objects[i]
        if "text" in o:
            digits_or_word = list(o["text"]) if o["text_kind"] == "number" else [f" {o['text']}"]
            what = [f" {o['text_kind']}", *digits_or_word, FILLER][:3]
        else:
            what = [f" {o['size']}", f" {o['colour']}", f" {o['shape']}"]
        words += [str(column), *what, f" {data.position_of(o['cx'], o['cy'])}", str(ranks[i]), END]
    return words + [FILLER] * (NUM_SLOTS - len(words))


def slot_classes(scene: dict) -> list[int]:
    """The scene's slots as indices into ``VOCAB`` (the vision encoder's classification targets)."""
    index = {word: i for i, word in enumerate(VOCAB)}
    return [index[word] for word in slot_words(scene)]


@functools.lru_cache(maxsize=4)
def vocab_ids(tokenizer) -> tuple[int, ...]:
    """SmolLM2's token id of every ``VOCAB`` entry (each is exactly one token); once per tokenizer."""
    ids = []
    for word in VOCAB:
        tokens = tokenizer.encode(word, add_special_tokens=False)
        if len(tokens) != 1:
            raise ValueError(f"slot word {word!r} is {len(tokens)} tokens, not one")
        ids.append(tokens[0])
    return tuple(ids)


def slot_ids(scene: dict, tokenizer) -> list[int]:
    """The scene's slots as SmolLM2 token ids."""
    ids = vocab_ids(tokenizer)
    return [ids[c] for c in slot_classes(scene)]
