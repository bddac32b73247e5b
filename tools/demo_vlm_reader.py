"""The demo VLM's reader: SmolLM2 with a LoRA that answers questions about a scene from its slot tokens
(``tools/demo_vlm_slots.py``) in place of the image. The image positions hold the slots' token embeddings
(plus a little noise, for the vision encoder's near-but-not-exact ones), so this stage needs no images and
no vision encoder: it is pure text training, and it can be measured on its own (``evaluate_reader``).

``reader_conversation`` builds one training conversation (labels on the answers only), ``collate`` a batch,
``reader_loss`` its answer loss; ``sample_conversation`` draws a scene and a few of its questions, relations and
counts more often than the rest, some ending in a text-only chat turn.
"""

from __future__ import annotations

import random
from collections import defaultdict

import torch
import torch.nn.functional as F

from tessera.models.demo_vlm import IMAGE_TOKEN_ID
from tools import demo_vlm_data as data
from tools import demo_vlm_slots as slots
from tools.demo_vlm_datasets import questions
from tools.demo_vlm_pictures import make_picture


def answer_labels(ids: torch.Tensor, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels (-100 everywhere but the assistant answers and the <|im_end|> closing each) and per-token loss
    weights (an answer's tokens share sqrt(length): a caption counts more than a one-word answer, not 15x)."""
    labels = torch.full_like(ids, -100)
    weights = torch.zeros(len(ids))
    opener = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    i = 0
    while i < len(ids):
        if ids[i : i + len(opener)].tolist() == opener:
            start = i + len(opener)
            stop = start + ids[start:].tolist().index(end)
            labels[start : stop + 1] = ids[start : stop + 1]
            weights[start : stop + 1] = (stop + 1 - start) ** -0.5
            i = stop
        i += 1
    return labels, weights


def chat_ids(
    tokenizer, qas: list[tuple[str, str, str]], image: list[int], generation: bool = False
) -> tuple[list[int], int]:
    """(token ids, where the image starts) of a chat about one image whose tokens are `image` (one id per
    image position): the first question carries the image, every (kind, question, answer) is a turn;
    `generation` drops the last answer and ends with the assistant's opener."""
    messages = []
    for i, (_, question, answer) in enumerate(qas):
        content = [{"type": "image"}, {"type": "text", "text": question}] if i == 0 else question
        messages.append({"role": "user", "content": content})
        if not (generation and i == len(qas) - 1):
            messages.append({"role": "assistant", "content": answer})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
    ids = tokenizer.encode(text, add_special_tokens=False)
    at = ids.index(IMAGE_TOKEN_ID)
    return ids[:at] + image + ids[at + 1 :], at


def reader_conversation(tokenizer, scene: dict, qas: list[tuple[str, str, str]]) -> dict[str, torch.Tensor]:
    image = slots.slot_ids(scene, tokenizer)
    ids, first = chat_ids(tokenizer, qas, image)
    ids = torch.tensor(ids)
    labels, weights = answer_labels(ids, tokenizer)
    image_mask = torch.zeros(len(ids), dtype=torch.bool)
    image_mask[first : first + len(image)] = True
    return {"input_ids": ids, "labels": labels, "weights": weights, "image_mask": image_mask}


def collate(items: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(item["input_ids"]) for item in items)
    batch = {
        "input_ids": torch.full((len(items), width), pad_id),
        "labels": torch.full((len(items), width), -100),
        "attention_mask": torch.zeros((len(items), width), dtype=torch.long),
        "weights": torch.zeros((len(items), width)),
        "image_mask": torch.zeros((len(items), width), dtype=torch.bool),
    }
    for row, item in enumerate(items):
        n = len(item["input_ids"])
        batch["attention_mask"][row, :n] = 1
        for key in ("input_ids", "labels", "weights", "image_mask"):
            batch[key][row, :n] = item[key]
    return batch


def reader_loss(model, batch: dict[str, torch.Tensor], noise: float = 0.0) -> torch.Tensor:
    """Answer cross-entropy (weighted as ``answer_labels`` says); the image positions' embeddings get Gaussian
    noise of `noise` times the embeddings' typical length."""
    batch = {key: value.to(model.device) for key, value in batch.items()}
    embeds = model.model.get_input_embeddings()(batch["input_ids"])
    if noise > 0:
        scale = noise * embeds.detach().float().norm(dim=-1).mean() / embeds.shape[-1] ** 0.5
        jitter = torch.randn_like(embeds, dtype=torch.float32) * scale
        embeds = embeds + (jitter * batch["image_mask"].unsqueeze(-1)).to(embeds.dtype)
    hidden = model.model.language_model(inputs_embeds=embeds, attention_mask=batch["attention_mask"]).last_hidden_state
    targets = batch["labels"][:, 1:]
    keep = targets != -100
    logits = model.lm_head(hidden[:, :-1][keep])
    weights = batch["weights"][:, 1:][keep]
    losses = F.cross_entropy(logits.float(), targets[keep], reduction="none")
    return (losses * weights).sum() / weights.sum()


KIND_WEIGHTS = {"relation": 3.0, "count": 2.0, "compound": 2.0}  # the rest 1
PICTURE_SHARE = 0.08  # conversations about a picture with no shapes


def sample_conversation(
    rng: random.Random,
    turns: int,
    chats: list[tuple[str, str]],
    chat_share: float,
    kind_weights: dict[str, float] = KIND_WEIGHTS,
    picture_share: float = PICTURE_SHARE,
):
    """A training scene (in `picture_share` of them a picture with no shapes) and up to `turns` distinct
    questions about it, each turn's kind drawn by `kind_weights` (default ``KIND_WEIGHTS``) among the kinds with
    questions left (per kind, not per question: a scene allows many more relation and count questions than the
    others), none of them a compound's part asked alone (``repeats_a_part``); in `chat_share` of them a last,
    text-only turn from `chats` (prompt, SmolLM2's answer)."""
    scene = make_picture(rng, "train") if rng.random() < picture_share else data.make_scene(rng, "train")
    by_kind: dict[str, list] = defaultdict(list)
    for qa in questions(scene, rng, "train"):
        by_kind[qa[0]].append(qa)
    qas = []
    while len(qas) < turns and by_kind:
        kinds = sorted(by_kind)
        kind = rng.choices(kinds, weights=[kind_weights.get(k, 1.0) for k in kinds])[0]
        qa = by_kind[kind].pop(rng.randrange(len(by_kind[kind])))
        if not by_kind[kind]:
            del by_kind[kind]
        if not repeats_a_part(qa, qas):
            qas.append(qa)
    if rng.random() < chat_share:
        qas.append(("chat", *rng.choice(chats)))
    return scene, qas


def repeats_a_part(qa: tuple[str, str, str], asked: list[tuple[str, str, str]]) -> bool:
    """Whether `qa` is a compound with a part asked alone in `asked`, or a question that a compound in `asked`
    holds: the compound's answer would then be in the conversation already, to copy instead of read from the
    slots (the eval, and most users, ask a compound first)."""

    def part_of(question: str, compound: str) -> bool:  # a part is a question without its "?"
        return question.endswith("?") and question[:-1].lower() in compound.lower()

    if qa[0] == "compound":
        return any(kind != "compound" and part_of(question, qa[1]) for kind, question, _ in asked)
    return any(kind == "compound" and part_of(qa[1], question) for kind, question, _ in asked)


def normalise(answer: str) -> str:
    """An answer as exact matching compares it: stripped, lower-case, without a final full stop."""
    return answer.strip().lower().rstrip(".")


LONG_ANSWERS = ("describe", "compound", "greeting", "no shapes")


@torch.no_grad()
def reader_answers(model, tokenizer, items, batch: int = 32) -> list[str]:
    """Greedy one-turn answers to (scene, kind, question, answer) items from the scenes' true slots, `batch` at a
    time (left-padded: the same tokens as one at a time)."""
    out_texts = []
    for start in range(0, len(items), batch):
        chunk = items[start : start + batch]
        prompts = [chat_ids(tokenizer, [(kind, question, "")], slots.slot_ids(scene, tokenizer), generation=True)[0]
                   for scene, kind, question, _ in chunk]  # fmt: skip
        width = max(map(len, prompts))
        pad = tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
        limits = [40 if kind in LONG_ANSWERS else 8 for _, kind, _, _ in chunk]  # answer tokens at most
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max(limits),
                             pad_token_id=pad)  # fmt: skip
        out_texts += [tokenizer.decode(row[width : width + n], skip_special_tokens=True) for row, n in zip(out, limits)]
    return out_texts


def score_reader(model, tokenizer, items) -> tuple[dict[str, tuple[int, int]], list[tuple[str, str, str, str]]]:
    """Exact-match answers (greedy, one turn) per kind from the scenes' true slots: the reader's ceiling.
    -> ({kind: (right, asked)}, [(kind, question, expected, answered) of each miss])"""
    scores: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    misses = []
    for (_, kind, question, answer), text in zip(items, reader_answers(model, tokenizer, items)):
        right = normalise(text) == normalise(answer)
        scores[kind][0] += right
        scores[kind][1] += 1
        if not right:
            misses.append((kind, question, answer, text))
    return {kind: (hit, n) for kind, (hit, n) in scores.items()}, misses


def evaluate_reader(model, tokenizer, eval_scenes, limit: int | None = None) -> dict[str, tuple[int, int]]:
    """``score_reader``'s scores on the first `limit` eval items."""
    return score_reader(model, tokenizer, eval_scenes[:limit])[0]
