"""Train the demo VLM: a CLIP-style ViT and a projector, from scratch, in front of SmolLM2-135M-Instruct
(LLaVA's recipe), plus a LoRA on the language model, on the synthetic scenes of ``tools/demo_vlm_data.py``.

Everything is seeded and runs offline on the CPU (bfloat16 where the CPU has it; a GPU if one is at hand):

1. Vision pre-training (``--vision-steps``): the ViT alone, with throwaway per-patch heads that classify the
   object under each patch (``tools/demo_vlm_targets.py``: shape, colour, size, word or number, position,
   centre, counts) — cheap, and it gives the tower the features the answers need before the expensive stage.
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
from tools.demo_vlm_lora import (
    LoRALinear,
    add_lora,
    base_answers,
    distillation_loss,
    lora_state,
    text_agreement,
    text_batch,
)
from tools.demo_vlm_targets import PATCH_SIZE, PatchHeads, patch_targets

VISION = dict(image_size=data.IMAGE_SIZE, patch_size=PATCH_SIZE, hidden_size=256, intermediate_size=1024,
              num_hidden_layers=6, num_attention_heads=4)  # fmt: skip


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
    projector.linear_1.bias.zero_()
    projector.linear_1.weight.mul_(1.0 / projector.linear_1(features).std())
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
