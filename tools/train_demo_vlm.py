"""Train the demo VLM's vision side: a CLIP-style ViT and a projector, from scratch, in front of the frozen
SmolLM2-135M-Instruct (LLaVA's recipe), on the synthetic scenes of ``tools/demo_vlm_data.py``.

Everything is seeded and runs offline on the CPU (bfloat16 where the CPU has it; a GPU if one is at hand):

1. Vision pre-training (``--vision-steps``): the ViT alone, with throwaway per-patch heads that classify the
   object under each patch (shape, colour, size, and the word or number of a text) — cheap, and it gives the
   tower the features the answers need before the expensive stage (a ViT trained only through a frozen LM
   learns slowly on a CPU budget).
2. Alignment (``--steps``): ViT + projector through the frozen language model, the loss on the answers of a
   conversation about one image (a few question/answer turns, so the image's tokens are computed once for
   several answers); the per-patch loss continues at ``--aux-weight``.

The language model is never trained: a text-only prompt gets SmolLM2's own answers. At the end the vision
side is written to ``--out`` (``vision_config.json`` + ``vision.safetensors``, a few MB), the folder
``tessera.models.demo_vlm.assemble_demo_vlm`` turns into the full model.

Usage: python -m tools.train_demo_vlm [--out tessera/demo_vlm] [--steps N] [--vision-steps N] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from tessera.models.demo_vlm import IMAGE_TOKEN_ID, assemble_demo_vlm
from tessera.testing.demo_vlm import build_random_vision_dir
from tools import demo_vlm_data as data

VISION = dict(image_size=128, patch_size=16, hidden_size=256, intermediate_size=1024, num_hidden_layers=6,
              num_attention_heads=4)  # fmt: skip
GRID = VISION["image_size"] // VISION["patch_size"]
TEXT_CLASSES = ["none", *data.WORDS, *(str(n) for n in range(100))]
OBJECT_WEIGHT = 8.0  # an object patch's weight in the per-patch loss, against a background patch's 1


# ---- per-patch targets (vision pre-training and the auxiliary loss) -------------------------------------


def patch_targets(scene: dict) -> torch.Tensor:
    """[4, GRID * GRID] class ids per patch (row-major): shape (0 none, 1.. shapes, last: text), colour
    (0 none), size (0 none, 1 small, 2 large), text (0 none, else the word / number)."""
    targets = torch.zeros(4, GRID, GRID, dtype=torch.long)
    for row in range(GRID):
        for col in range(GRID):
            px, py = (col + 0.5) / GRID, (row + 0.5) / GRID
            for obj in scene["objects"]:
                if "text" in obj:
                    if abs(px - obj["cx"]) <= obj["half_w"] and abs(py - obj["cy"]) <= obj["half_h"]:
                        targets[0, row, col] = len(data.SHAPES) + 1
                        targets[3, row, col] = TEXT_CLASSES.index(obj["text"])
                elif math.hypot(px - obj["cx"], py - obj["cy"]) <= obj["extent"] * 0.85:
                    targets[0, row, col] = data.SHAPES.index(obj["shape"]) + 1
                    targets[1, row, col] = list(data.COLOURS).index(obj["colour"]) + 1
                    targets[2, row, col] = 1 + (obj["size"] == "large")
    return targets.reshape(4, -1)


class PatchHeads(torch.nn.Module):
    """Linear classifiers over the tower's patch features (dropped after training)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        sizes = (len(data.SHAPES) + 2, len(data.COLOURS) + 1, 3, len(TEXT_CLASSES))
        self.heads = torch.nn.ModuleList(torch.nn.Linear(width, n) for n in sizes)

    def loss(self, features: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """features [B, P, width], targets [B, 4, P] -> the mean cross-entropy over heads and patches, object
        patches weighted up (most patches are background: unweighted, the loss is low while the objects, what
        the answers are about, are still misread)."""
        weight = 1.0 + (OBJECT_WEIGHT - 1.0) * (targets[:, 0] > 0).flatten().float()
        total = 0.0
        for i, head in enumerate(self.heads):
            losses = F.cross_entropy(head(features.float()).flatten(0, 1), targets[:, i].flatten(), reduction="none")
            total = total + (losses * weight).sum() / weight.sum()
        return total / len(self.heads)


# ---- conversations ----------------------------------------------------------------------------------------


def conversation(processor, image, qas: list[tuple[str, str, str]]) -> dict[str, torch.Tensor]:
    """One image and several question/answer turns -> input ids (image tokens expanded), pixel values, labels
    (-100 everywhere but the answers and the <|im_end|> closing each) and per-token loss weights (an answer's
    tokens share a weight of sqrt(length): a long caption counts more than a one-word answer, but not 15x)."""
    messages = []
    for i, (_, question, answer) in enumerate(qas):
        content = [{"type": "image"}, {"type": "text", "text": question}] if i == 0 else question
        messages += [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]
    text = processor.apply_chat_template(messages)
    encoded = processor(images=[image], text=text, return_tensors="pt")
    ids = encoded["input_ids"][0]
    labels = torch.full_like(ids, -100)
    weights = torch.zeros(len(ids))
    tokenizer = processor.tokenizer
    opener = tokenizer.encode("<|im_start|>assistant\n")
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
    return {"input_ids": ids, "pixel_values": encoded["pixel_values"][0], "labels": labels, "weights": weights}


def collate(items: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(item["input_ids"]) for item in items)
    ids = torch.full((len(items), width), pad_id)
    labels = torch.full((len(items), width), -100)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    weights = torch.zeros((len(items), width))
    for row, item in enumerate(items):
        n = len(item["input_ids"])
        ids[row, :n], labels[row, :n], mask[row, :n] = item["input_ids"], item["labels"], 1
        weights[row, :n] = item["weights"]
    return {"input_ids": ids, "labels": labels, "attention_mask": mask, "weights": weights,
            "pixel_values": torch.stack([item["pixel_values"] for item in items])}  # fmt: skip


# ---- training ---------------------------------------------------------------------------------------------


def lm_loss(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy of the answer tokens, weighted as ``conversation`` says, the tower's patch features
    [B, P, width])."""
    pixel_values = batch["pixel_values"].to(model.dtype)
    vision = model.model.vision_tower(pixel_values, output_hidden_states=True)
    features = vision.hidden_states[-1][:, 1:]  # the LLaVA "default" strategy: patches, CLS dropped
    image_embeds = model.model.multi_modal_projector(features)
    ids = batch["input_ids"]
    embeds = model.model.get_input_embeddings()(ids.clamp(min=0))
    mask = ids == IMAGE_TOKEN_ID
    embeds = embeds.masked_scatter(mask.unsqueeze(-1), image_embeds.to(embeds.dtype).reshape(-1, embeds.shape[-1]))
    hidden = model.model.language_model(inputs_embeds=embeds, attention_mask=batch["attention_mask"]).last_hidden_state
    targets = batch["labels"][:, 1:]
    keep = targets != -100
    logits = model.lm_head(hidden[:, :-1][keep])
    weights = batch["weights"][:, 1:][keep]
    losses = F.cross_entropy(logits.float(), targets[keep], reduction="none")
    return (losses * weights).sum() / weights.sum(), features


def schedule(step: int, total: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def sample_conversation(rng: random.Random, turns: int):
    """A training scene, its image and up to `turns` of its questions, each of a different kind in random
    order (a scene allows many more relation and count questions than the others: drawn per kind, every kind
    gets its share)."""
    scene = data.make_scene(rng, "train")
    by_kind: dict[str, list] = defaultdict(list)
    for qa in data.questions(scene, rng, "train"):
        by_kind[qa[0]].append(qa)
    kinds = sorted(by_kind)
    rng.shuffle(kinds)
    return scene, data.render(scene), [rng.choice(by_kind[kind]) for kind in kinds[:turns]]


def pretrain_vision(model, heads, steps: int, batch: int, rng: random.Random, lr: float, log) -> None:
    params = list(model.model.vision_tower.parameters()) + list(heads.parameters())
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    for step in range(steps):
        scenes = [data.make_scene(rng, "train") for _ in range(batch)]
        pixels = torch.stack([to_pixels(data.render(s)) for s in scenes]).to(model.dtype)
        targets = torch.stack([patch_targets(s) for s in scenes])
        features = model.model.vision_tower(pixels, output_hidden_states=True).hidden_states[-1][:, 1:]
        loss = heads.loss(features, targets)
        for group in optimizer.param_groups:
            group["lr"] = schedule(step, steps, lr)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            log(f"vision step {step}/{steps}: patch loss {loss.item():.3f}")


def to_pixels(image) -> torch.Tensor:
    """The CLIP image processor's normalisation for a 128 px image (no resize: scenes are drawn at size)."""
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    array = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255)
    return ((array - torch.tensor(OPENAI_CLIP_MEAN)) / torch.tensor(OPENAI_CLIP_STD)).permute(2, 0, 1)


@torch.no_grad()
def evaluate(model, processor, eval_set, limit: int = 70) -> dict[str, tuple[int, int]]:
    """Exact-match answers (greedy, single turn) per kind, on the first `limit` held-out questions."""
    scores: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for image, kind, question, answer in eval_set[:limit]:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
        inputs = processor(images=[image], text=prompt, return_tensors="pt")
        inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
        out = model.generate(**inputs, max_new_tokens=40 if kind == "describe" else 8, do_sample=False)
        text = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        scores[kind][0] += text.strip().lower().rstrip(".") == answer
        scores[kind][1] += 1
    return {kind: (hit, n) for kind, (hit, n) in scores.items()}


def save_vision(model, work_vision: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    state = {f"vision_tower.{k}": v for k, v in model.model.vision_tower.state_dict().items()}
    state |= {f"multi_modal_projector.{k}": v for k, v in model.model.multi_modal_projector.state_dict().items()}
    state = {k: v.detach().float().contiguous() for k, v in state.items() if not k.endswith("position_ids")}
    save_file(state, out / "vision.safetensors", metadata={"format": "pt"})
    (out / "vision_config.json").write_text((work_vision / "vision_config.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("tessera/demo_vlm"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/tessera-demo-vlm-train"))
    parser.add_argument("--vision-steps", type=int, default=1500)
    parser.add_argument("--steps", type=int, default=2500)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6, help="question/answer turns per conversation")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--aux-weight", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=500)
    args = parser.parse_args()

    from transformers import AutoProcessor, LlavaForConditionalGeneration

    start = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{(time.perf_counter() - start) / 60:6.1f} min] {message}", flush=True)

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    work_vision = build_random_vision_dir(args.work / "vision0", seed=args.seed, **VISION)
    folder = assemble_demo_vlm(args.work / "model", work_vision)
    processor = AutoProcessor.from_pretrained(folder)
    dtype = torch.bfloat16 if torch.backends.mkldnn.is_available() else torch.float32
    model = LlavaForConditionalGeneration.from_pretrained(folder, dtype=dtype)
    model.model.language_model.requires_grad_(False)
    model.lm_head.requires_grad_(False)
    model.model.language_model.eval()
    heads = PatchHeads(VISION["hidden_size"])
    eval_set = data.make_eval_set(10, seed=args.seed + 1000)
    log(f"model ready ({dtype}); pre-training the vision tower for {args.vision_steps} steps")

    model.model.vision_tower.float()
    pretrain_vision(model, heads, args.vision_steps, 32, rng, 1e-3, log)
    model.model.vision_tower.to(dtype)
    model.model.multi_modal_projector.to(dtype)

    trainable = list(model.model.vision_tower.parameters()) + list(model.model.multi_modal_projector.parameters())
    optimizer = torch.optim.AdamW([{"params": trainable}, {"params": heads.parameters()}], lr=args.lr,
                                  weight_decay=0.0)  # fmt: skip
    pad_id = processor.tokenizer.pad_token_id
    for step in range(args.steps):
        items, targets = [], []
        for _ in range(args.batch):
            scene, image, qas = sample_conversation(rng, args.turns)
            items.append(conversation(processor, image, qas))
            targets.append(patch_targets(scene))
        batch = collate(items, pad_id)
        loss, features = lm_loss(model, batch)
        total = loss + args.aux_weight * heads.loss(features, torch.stack(targets))
        for group in optimizer.param_groups:
            group["lr"] = schedule(step, args.steps, args.lr)
        total.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 25 == 0:
            log(f"step {step}/{args.steps}: answer loss {loss.item():.3f}")
        if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
            scores = evaluate(model, processor, eval_set)
            log("held-out: " + ", ".join(f"{k} {h}/{n}" for k, (h, n) in sorted(scores.items())))
            save_vision(model, work_vision, args.out)
    log(f"done; vision side written to {args.out}")
    (args.out / "training.json").write_text(json.dumps(vars(args), default=str, indent=2))


if __name__ == "__main__":
    main()
