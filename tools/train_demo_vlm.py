"""Train the demo VLM: a CLIP-style ViT and a projector, from scratch, in front of SmolLM2-135M-Instruct
(LLaVA's recipe), plus a LoRA on the language model, on the synthetic scenes of ``tools/demo_vlm_data.py``.

Everything is seeded and runs offline on the CPU (bfloat16 where the CPU has it; a GPU if one is at hand):

1. Vision pre-training (``--vision-steps``): the ViT alone, with throwaway per-patch heads (``TARGETS``) that
   classify the object under each patch (shape, colour, size, word or number, position, centre, counts) —
   cheap, and it gives the tower the features the answers need before the expensive stage.
2. Alignment (``--steps``): ViT + projector + the LM's LoRA, the loss on the answers of a conversation about
   one image (a few question/answer turns, so the image's tokens are computed once for several answers); the
   per-patch loss continues at ``--aux-weight``. A frozen SmolLM2 reads the image tokens too weakly on this
   budget (a first run reached ~30% held-out), hence the LoRA; to keep its text answers, every step also
   distils SmolLM2 into itself on text-only chats (KL to its LoRA-off next-token distributions along its own
   answers to ``tools/demo_vlm_chat_data.py``'s prompts), and some image conversations end in such a chat.

At the end the shipped side is written to ``--out``, float16: ``vision_config.json``, ``vision.safetensors``
(tower + projector) and ``lora.safetensors`` (scale folded in), the folder
``tessera.models.demo_vlm.assemble_demo_vlm`` turns into the full model, the LoRA merged into SmolLM2's weights.

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
from tools import demo_vlm_chat_data as chat_data
from tools import demo_vlm_data as data

VISION = dict(image_size=128, patch_size=16, hidden_size=256, intermediate_size=1024, num_hidden_layers=6,
              num_attention_heads=4)  # fmt: skip
GRID = VISION["image_size"] // VISION["patch_size"]
TEXT_CLASSES = ["none", *data.WORDS, *(str(n) for n in range(100))]
OBJECT_WEIGHT = 8.0  # an object patch's weight in the per-patch loss, against a background patch's 1


# ---- per-patch targets (vision pre-training and the auxiliary loss) -------------------------------------

SUB = 4  # a patch is sampled at SUB x SUB points to measure how much of it an object covers
TARGETS = {  # per-patch target -> number of classes (0 is "no object" where that applies)
    "shape": len(data.SHAPES) + 2,  # 1.. shapes, last: a text
    "colour": len(data.COLOURS) + 1,
    "size": 3,
    "text": len(TEXT_CLASSES),
    "position": len(data.POSITIONS) + 1,  # the object's left/right/top/bottom
    "anchor": 2,  # 1: the patch holds the object's centre (one token per object, for counting)
    "x": GRID + 1,  # the object's centre, in patch columns / rows (for relations)
    "y": GRID + 1,
    "shapes": 6,  # how many shapes the scene has (every patch)
    "same_colour": 6,  # how many shapes share the object's colour / shape / size
    "same_shape": 6,
    "same_size": 6,
}


def _covers(obj: dict, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    if "text" in obj:
        return (np.abs(x - obj["cx"]) <= obj["half_w"]) & (np.abs(y - obj["cy"]) <= obj["half_h"])
    return np.hypot(x - obj["cx"], y - obj["cy"]) <= obj["extent"] * 0.85


def patch_targets(scene: dict) -> torch.Tensor:
    """[len(TARGETS), GRID * GRID] class ids per patch (row-major) of the object that covers the patch most
    (at least 2 of its SUB x SUB sample points; the patch holding an object's centre is always that object's),
    0 where no object does; "shapes" is set everywhere. Small objects and thin text cover few patches: every
    object gets at least its centre patch."""
    offsets = (np.arange(SUB) + 0.5) / SUB
    grid = (np.arange(GRID)[:, None] + offsets[None, :]).reshape(-1) / GRID  # GRID * SUB sample coordinates
    y, x = np.meshgrid(grid, grid, indexing="ij")
    objects = scene["objects"]
    shapes = [o for o in objects if "text" not in o]
    owner = np.full((GRID, GRID), -1)
    best = np.full((GRID, GRID), 1)  # at least 2 sample points
    for i, obj in enumerate(objects):
        cover = _covers(obj, x, y).reshape(GRID, SUB, GRID, SUB).sum(axis=(1, 3))
        owner[cover > best] = i
        best = np.maximum(best, cover)
    for i, obj in enumerate(objects):  # every object owns the patch of its centre
        owner[min(int(obj["cy"] * GRID), GRID - 1), min(int(obj["cx"] * GRID), GRID - 1)] = i
    targets = torch.zeros(len(TARGETS), GRID, GRID, dtype=torch.long)
    rows = {name: i for i, name in enumerate(TARGETS)}
    targets[rows["shapes"]] = len(shapes)
    for i, obj in enumerate(objects):
        where = torch.from_numpy(owner == i)
        col, row = min(int(obj["cx"] * GRID), GRID - 1), min(int(obj["cy"] * GRID), GRID - 1)
        if "text" in obj:
            classes = {"shape": len(data.SHAPES) + 1, "text": TEXT_CLASSES.index(obj["text"])}
        else:
            classes = {"shape": data.SHAPES.index(obj["shape"]) + 1, "size": 1 + (obj["size"] == "large"),
                       "colour": list(data.COLOURS).index(obj["colour"]) + 1,
                       "same_colour": sum(s["colour"] == obj["colour"] for s in shapes),
                       "same_shape": sum(s["shape"] == obj["shape"] for s in shapes),
                       "same_size": sum(s["size"] == obj["size"] for s in shapes)}  # fmt: skip
        position = data.POSITIONS.index(data.position_of(obj["cx"], obj["cy"])) + 1
        classes |= {"position": position, "x": col + 1, "y": row + 1}
        for name, value in classes.items():
            targets[rows[name]][where] = value
        targets[rows["anchor"], row, col] = 1
    return targets.reshape(len(TARGETS), -1)


class PatchHeads(torch.nn.Module):
    """Linear classifiers over the tower's patch features, one per TARGETS entry (dropped after training)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.heads = torch.nn.ModuleList(torch.nn.Linear(width, n) for n in TARGETS.values())

    def loss(self, features: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """features [B, P, width], targets [B, len(TARGETS), P] -> the mean cross-entropy over heads and patches,
        object patches weighted up (most patches are background: unweighted, the loss is low while the
        objects, what the answers are about, are still misread)."""
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


# ---- the language model's LoRA ---------------------------------------------------------------------------


class LoRALinear(torch.nn.Module):
    """A frozen linear layer plus a trainable low-rank update, W x + scale * B A x (float32 factors; B starts
    at zero, so training starts from SmolLM2 exactly). `enabled = False` gives the base layer (the teacher of
    the text-only distillation)."""

    enabled = True

    def __init__(self, base: torch.nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base, self.scale = base, alpha / rank
        self.lora_A = torch.nn.Parameter(torch.randn(rank, base.in_features) / base.in_features**0.5)
        self.lora_B = torch.nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if LoRALinear.enabled:
            out = out + (x @ self.lora_A.to(x.dtype).T) @ (self.scale * self.lora_B).to(x.dtype).T
        return out


def add_lora(language_model, rank: int, alpha: float) -> dict[str, LoRALinear]:
    """Wrap every linear layer of the decoder (attention and MLP) in a LoRALinear -> {module name: wrapper}."""
    wrapped = {}
    for name, module in list(language_model.named_modules()):
        for child, layer in list(module.named_children()):
            if isinstance(layer, torch.nn.Linear):
                wrapper = LoRALinear(layer, rank, alpha)
                setattr(module, child, wrapper)
                wrapped[f"{name}.{child}" if name else child] = wrapper
    return wrapped


def lora_state(wrapped: dict[str, LoRALinear]) -> dict[str, torch.Tensor]:
    """The shipped form: `{name}.lora_A` and `{name}.lora_B` (scale folded into B), so W' = W + B @ A."""
    state = {}
    for name, layer in wrapped.items():
        state[f"language_model.{name}.lora_A"] = layer.lora_A.detach()
        state[f"language_model.{name}.lora_B"] = (layer.scale * layer.lora_B).detach()
    return state


# ---- text-only self-distillation --------------------------------------------------------------------------


@torch.no_grad()
def base_answers(model, tokenizer, prompts: list[str], max_new_tokens: int, batch: int = 32) -> list[list[int]]:
    """SmolLM2's own greedy answer (token ids, through <|im_end|> when it finished) to each prompt."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tokenizer.padding_side = "left"
    answers = []
    for i in range(0, len(prompts), batch):
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True) for p in prompts[i : i + batch]]  # fmt: skip
        inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=end)
        for row in out[:, inputs["input_ids"].shape[1] :].tolist():
            answers.append(row[: row.index(end) + 1] if end in row else row)
    tokenizer.padding_side = "right"
    return answers


def text_batch(tokenizer, prompts: list[str], answers: list[list[int]]) -> dict[str, torch.Tensor]:
    """Text-only chats (prompt + SmolLM2's answer), right-padded, with a mask of the answer positions."""
    rows = []
    for prompt, answer in zip(prompts, answers):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        rows.append((ids + answer, len(ids)))
    width = max(len(ids) for ids, _ in rows)
    batch = {"input_ids": torch.full((len(rows), width), tokenizer.pad_token_id),
             "attention_mask": torch.zeros(len(rows), width, dtype=torch.long),
             "answer": torch.zeros(len(rows), width, dtype=torch.bool)}  # fmt: skip
    for i, (ids, start) in enumerate(rows):
        batch["input_ids"][i, : len(ids)] = torch.tensor(ids)
        batch["attention_mask"][i, : len(ids)] = 1
        batch["answer"][i, start - 1 : len(ids) - 1] = True  # positions whose next token is the answer's
    return batch


def distillation_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """KL(SmolLM2 || SmolLM2 + LoRA) of the next-token distributions along SmolLM2's own answers."""
    lm = model.model.language_model

    def logits() -> torch.Tensor:
        hidden = lm(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        return model.lm_head(hidden[batch["answer"]]).float()

    with torch.no_grad():
        LoRALinear.enabled = False
        try:
            teacher = F.log_softmax(logits(), dim=-1)
        finally:
            LoRALinear.enabled = True
    student = F.log_softmax(logits(), dim=-1)
    return F.kl_div(student, teacher, log_target=True, reduction="batchmean")


# ---- training ---------------------------------------------------------------------------------------------


def lm_loss(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy of the answer tokens, weighted as ``conversation`` says, the tower's patch features
    [B, P, width])."""
    vision = model.model.vision_tower(batch["pixel_values"].float(), output_hidden_states=True)
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


def sample_conversation(rng: random.Random, turns: int, chats: list[tuple[str, str]], chat_share: float):
    """A training scene, its image and up to `turns` of its questions, each of a different kind in random
    order (a scene allows many more relation and count questions than the others: drawn per kind, every kind
    gets its share); in `chat_share` of them a last, text-only turn from `chats` (prompt, SmolLM2's answer),
    so that after talking about an image the model still talks about anything else."""
    scene = data.make_scene(rng, "train")
    by_kind: dict[str, list] = defaultdict(list)
    for qa in data.questions(scene, rng, "train"):
        by_kind[qa[0]].append(qa)
    kinds = sorted(by_kind)
    rng.shuffle(kinds)
    qas = [rng.choice(by_kind[kind]) for kind in kinds[:turns]]
    if rng.random() < chat_share:
        qas.append(("chat", *rng.choice(chats)))
    return scene, data.render(scene), qas


@torch.no_grad()
def calibrate_projector(model, pixels: torch.Tensor) -> tuple[float, float]:
    """Rescale the fresh projector so that its hidden pre-activations have unit spread and its outputs the
    norm of SmolLM2's token embeddings (a data-dependent init). Left random, the image tokens came out ~36x
    longer than any word's embedding: a pre-norm LM then barely updates them layer to layer, and the LM
    learned to read them slowly. Returns (output norm before, after)."""
    projector = model.model.multi_modal_projector
    features = model.model.vision_tower(pixels, output_hidden_states=True).hidden_states[-1][:, 1:]
    projector.linear_1.weight.mul_(1.0 / projector.linear_1(features).std())
    projector.linear_1.bias.zero_()
    before = projector(features).norm(dim=-1).mean()
    target = model.model.get_input_embeddings().weight.float().norm(dim=-1).mean()
    projector.linear_2.weight.mul_(target / before)
    projector.linear_2.bias.mul_(target / before)
    return before.item(), projector(features).norm(dim=-1).mean().item()


def pretrain_vision(model, heads, steps: int, batch: int, rng: random.Random, lr: float, log) -> None:
    params = list(model.model.vision_tower.parameters()) + list(heads.parameters())
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    for step in range(steps):
        scenes = [data.make_scene(rng, "train") for _ in range(batch)]
        pixels = torch.stack([to_pixels(data.render(s)) for s in scenes])
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


@torch.no_grad()
def text_agreement(model, tokenizer, prompts: list[str], expected: list[list[int]]) -> int:
    """How many of the prompts get SmolLM2's own greedy answer (`expected`, as many tokens) from the model."""
    got = base_answers(model, tokenizer, prompts, max(len(e) for e in expected))
    return sum(g[: len(e)] == e for g, e in zip(got, expected))


def save_shipped(model, wrapped: dict[str, LoRALinear], work_vision: Path, out: Path) -> None:
    """The shipped side, float16: vision.safetensors (tower + projector), lora.safetensors (the LM's update)."""
    out.mkdir(parents=True, exist_ok=True)
    state = {f"vision_tower.{k}": v for k, v in model.model.vision_tower.state_dict().items()}
    state |= {f"multi_modal_projector.{k}": v for k, v in model.model.multi_modal_projector.state_dict().items()}
    state = {k: v.detach().half().contiguous() for k, v in state.items() if not k.endswith("position_ids")}
    save_file(state, out / "vision.safetensors", metadata={"format": "pt"})
    lora = {k: v.half().contiguous() for k, v in lora_state(wrapped).items()}
    save_file(lora, out / "lora.safetensors", metadata={"format": "pt"})
    (out / "vision_config.json").write_text((work_vision / "vision_config.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("tessera/demo_vlm"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/tessera-demo-vlm-train"))
    parser.add_argument("--vision-steps", type=int, default=800)
    parser.add_argument("--steps", type=int, default=360)
    parser.add_argument("--batch", type=int, default=8, help="image conversations per step")
    parser.add_argument("--text-batch", type=int, default=4, help="text-only chats per step (distillation)")
    parser.add_argument("--turns", type=int, default=6, help="question/answer turns per conversation")
    parser.add_argument("--chat-share", type=float, default=0.3, help="image conversations ending in a chat turn")
    parser.add_argument("--lr", type=float, default=1e-3, help="projector, LoRA and patch heads")
    parser.add_argument("--tower-lr", type=float, default=3e-4, help="the vision tower, once pre-trained")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--aux-weight", type=float, default=0.3)
    parser.add_argument("--distill-weight", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=180)
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
    tokenizer = processor.tokenizer
    dtype = torch.bfloat16 if torch.backends.mkldnn.is_available() else torch.float32
    model = LlavaForConditionalGeneration.from_pretrained(folder, dtype=dtype)
    model.requires_grad_(False)
    model.eval()  # no dropout anywhere; the LM stays frozen (its LoRA trains)
    model.model.vision_tower.float().requires_grad_(True)
    model.model.multi_modal_projector.float().requires_grad_(True)

    prompts = chat_data.general_prompts(args.seed)
    answers = base_answers(model, tokenizer, prompts, max_new_tokens=64)
    held_out = chat_data.HELD_OUT_QUESTIONS
    held_out_answers = base_answers(model, tokenizer, held_out, max_new_tokens=32)
    chats = [(p, tokenizer.decode(a[:-1])) for p, a in zip(prompts, answers) if a[-1] == tokenizer.eos_token_id]
    log(f"model ready ({dtype}); SmolLM2's answers to {len(prompts)} prompts ({len(chats)} complete)")

    heads = PatchHeads(VISION["hidden_size"])
    log(f"pre-training the vision tower for {args.vision_steps} steps")
    pretrain_vision(model, heads, args.vision_steps, 32, rng, 1e-3, log)

    pixels = torch.stack([to_pixels(data.render(data.make_scene(rng, "train"))) for _ in range(32)])
    before, after = calibrate_projector(model, pixels)
    log(f"projector calibrated: image token norm {before:.1f} -> {after:.2f}")
    wrapped = add_lora(model.model.language_model, args.lora_rank, alpha=2.0 * args.lora_rank)
    lora = [p for layer in wrapped.values() for p in (layer.lora_A, layer.lora_B)]
    tower = list(model.model.vision_tower.parameters())
    projector = list(model.model.multi_modal_projector.parameters())
    groups = [(tower, args.tower_lr), (projector, args.lr), (lora, args.lr), (list(heads.parameters()), args.lr)]
    optimizer = torch.optim.AdamW([{"params": p, "lr": lr} for p, lr in groups], weight_decay=0.0)
    eval_set = data.make_eval_set(10, seed=args.seed + 1000)
    pad_id = tokenizer.pad_token_id
    for step in range(args.steps):
        items, targets = [], []
        for _ in range(args.batch):
            scene, image, qas = sample_conversation(rng, args.turns, chats, args.chat_share)
            items.append(conversation(processor, image, qas))
            targets.append(patch_targets(scene))
        loss, features = lm_loss(model, collate(items, pad_id))
        total = loss + args.aux_weight * heads.loss(features, torch.stack(targets))
        picks = rng.sample(range(len(prompts)), args.text_batch)
        texts = text_batch(tokenizer, [prompts[i] for i in picks], [answers[i] for i in picks])
        distill = distillation_loss(model, texts)
        total = total + args.distill_weight * distill
        for group, (_, lr) in zip(optimizer.param_groups, groups):
            group["lr"] = schedule(step, args.steps, lr)
        total.backward()
        torch.nn.utils.clip_grad_norm_(tower + projector + lora, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 25 == 0:
            log(f"step {step}/{args.steps}: answer loss {loss.item():.3f}, text KL {distill.item():.4f}")
        if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
            scores = evaluate(model, processor, eval_set)
            same = text_agreement(model, tokenizer, held_out, held_out_answers)
            log("held-out: " + ", ".join(f"{k} {h}/{n}" for k, (h, n) in sorted(scores.items()))
                + f"; text answers kept {same}/{len(held_out)}")  # fmt: skip
            save_shipped(model, wrapped, work_vision, args.out)
    log(f"done; vision side and LoRA written to {args.out}")
    (args.out / "training.json").write_text(json.dumps(vars(args), default=str, indent=2))


if __name__ == "__main__":
    main()
