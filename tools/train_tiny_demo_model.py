"""Train the bundled demo model: a tiny LLaVA-format vision-language model for the synthetic VQA set.

Everything is built from scratch, offline and deterministically (fixed seed), on the CPU:

1. a synthetic training set of scenes (``tools/tiny_demo_data.py``), each with every question it allows, packed
   into token sequences by ``tools/tiny_demo_training_data.py``;
2. a byte-level BPE tokenizer trained on the set's texts, with ``<unk> <s> </s>`` (ids 0-2) and
   ``<image> <pad>`` special tokens and a LLaVA-1.5 chat template
   (``USER: <image>\\n{question} ASSISTANT: {answer}</s>``);
3. a small ``transformers.LlavaForConditionalGeneration`` (CLIP vision tower -> 2-layer MLP projector ->
   Llama decoder), trained with AdamW (warm-up then cosine decay), loss on the answer tokens and ``</s>``;
4. a standard Hugging Face folder (config, safetensors weights, generation config, tokenizer and processor
   files) written to ``--out``.

Two training aids, neither of which changes the saved model's format:

* Initialisation. HF's LLaVA init (written for fine-tuning) draws every weight from N(0, 0.02); from scratch
  that makes the projected image features and CLIP's position embeddings so small that the decoder learns
  to ignore the image. The projector gets 1/sqrt(fan_in) weights, the position embeddings std 0.5, and the
  rest of the init std 0.06.
* An auxiliary per-patch loss on the vision tower (``--aux-weight``; 0 turns it off). A real LLaVA starts from
  a pretrained CLIP; a CLIP trained from scratch only through the answer loss learns shapes too slowly for a
  CPU budget (answer loss alone, HF init: 58% exact match after 20 minutes). So a throwaway linear head classifies,
  for every image patch, the shape, colour, position answer and left-to-right rank of the object covering it
  (background: class 0). The head is not saved; the language-model loss stays on the answers only.

Training packs all questions about one image into one sequence: the image prefix
``<s>USER: <image>x64\\n`` comes once, followed by one segment per question
(``{question} ASSISTANT: {answer}</s>``). A block attention mask lets each segment see the prefix and
itself only, and its position ids continue from the prefix as if it were alone, so every segment is
computed exactly as the single-turn prompt it stands for, while the vision tower and the image tokens run
once per image instead of once per question. (``--check`` verifies this against HF's own forward.)

Usage: python -m tools.train_tiny_demo_model [--out tessera/tiny_demo_model] [--steps N] ...
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image
from transformers import (
    CLIPImageProcessor,
    CLIPVisionConfig,
    GenerationConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
)
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, PILImageResampling

from tools.tiny_demo_training_data import (
    AUX_CLASSES,
    CHAT_TEMPLATE,
    Encoder,
    build_tokenizer,
    make_scenes,
    pack,
    prompt_text,
)  # fmt: skip

REPO = Path(__file__).resolve().parents[1]


def packed_logits(model, pixel_values, input_ids, position_ids, mask, labels, image_token_id, cfg, return_states=False):
    """Logits at the labelled positions only ([num_labels, vocab]); with return_states, also the selected vision
    tower states [N, patches, vision hidden] (what the projector reads)."""
    states = model.vision_tower(pixel_values, output_hidden_states=True).hidden_states[cfg.vision_feature_layer]
    if cfg.vision_feature_select_strategy == "default":
        states = states[:, 1:]
    features = model.multi_modal_projector(states)
    embeds = model.get_input_embeddings()(input_ids)
    image_mask = (input_ids == image_token_id)[..., None].expand_as(embeds)
    embeds = embeds.masked_scatter(image_mask, features.to(embeds.dtype))
    hidden = model.language_model.model(
        inputs_embeds=embeds, attention_mask=mask, position_ids=position_ids, use_cache=False
    ).last_hidden_state
    logits = model.language_model.lm_head(hidden[labels != -100])
    return (logits, states) if return_states else logits


def normalise(images_uint8: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(OPENAI_CLIP_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(OPENAI_CLIP_STD).view(1, 3, 1, 1)
    return (images_uint8.float() / 255.0 - mean) / std


@torch.no_grad()
def evaluate(model, encoder, images, qas, cfg, batch: int = 64) -> dict[str, tuple[int, int]]:
    """Teacher-forced exact match per kind: a question counts as right when every answer token and </s> is the
    argmax, which is exactly when greedy decoding reproduces the answer."""
    model.eval()
    scores: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for i in range(0, len(qas), batch):
        ids, pos, mask, labels, segments = pack(encoder, qas[i : i + batch])
        logits = packed_logits(
            model, normalise(images[i : i + batch]), ids, pos, mask, labels, cfg.image_token_index, cfg
        )
        hit = torch.zeros_like(labels, dtype=torch.bool)
        hit[labels != -100] = logits.argmax(-1) == labels[labels != -100]
        for b, lo, hi, kind in segments:
            scores[kind][0] += int(hit[b, lo:hi].all())
            scores[kind][1] += 1
    model.train()
    return {k: tuple(v) for k, v in scores.items()}


def format_scores(scores) -> str:
    right = sum(r for r, _ in scores.values())
    total = sum(t for _, t in scores.values())
    kinds = " ".join(f"{k}={r / t:.3f}" for k, (r, t) in sorted(scores.items()))
    return f"all={right / total:.3f} {kinds}"


# -------------------------------------------------------------------------------------------- model


def build_config(args, tokenizer) -> LlavaConfig:
    num_image_tokens = (args.image_size // args.patch_size) ** 2
    return LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=args.vision_hidden,
            intermediate_size=args.vision_hidden * 4,
            num_hidden_layers=args.vision_layers,
            num_attention_heads=args.vision_heads,
            image_size=args.image_size,
            patch_size=args.patch_size,
            projection_dim=args.vision_hidden,
        ),
        text_config=LlamaConfig(
            hidden_size=args.text_hidden,
            intermediate_size=args.text_hidden * 4,
            num_hidden_layers=args.text_layers,
            num_attention_heads=args.text_heads,
            num_key_value_heads=args.text_heads,
            vocab_size=len(tokenizer),
            max_position_embeddings=512,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=False,
        ),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        image_seq_length=num_image_tokens,
        pad_token_id=tokenizer.pad_token_id,
    )


def build_processor(args, tokenizer) -> LlavaProcessor:
    image_processor = CLIPImageProcessor(  # as in llava-hf/llava-1.5-7b-hf, scaled to the model's image size
        do_resize=True,
        size={"shortest_edge": args.image_size},
        resample=PILImageResampling.BICUBIC,
        do_center_crop=True,
        crop_size={"height": args.image_size, "width": args.image_size},
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=OPENAI_CLIP_MEAN,
        image_std=OPENAI_CLIP_STD,
        do_convert_rgb=True,
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=args.patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS token; "default" drops it again
        image_token="<image>",
        chat_template=CHAT_TEMPLATE,
    )


def self_check(model, processor, encoder, images, qas, cfg) -> None:
    """The packed forward equals HF's own forward on each single-turn prompt; the chat template renders the
    documented prompt; the fast image normalisation equals the processor's."""
    model.eval()
    message = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}]
    rendered = processor.apply_chat_template(message, add_generation_prompt=True)
    assert rendered == prompt_text("Describe the image."), repr(rendered)
    full = processor.apply_chat_template(message + [{"role": "assistant", "content": "x"}])
    assert full == "USER: <image>\nDescribe the image. ASSISTANT: x</s>", repr(full)
    with torch.no_grad():
        ids, pos, mask, labels, segments = pack(encoder, qas[:2])
        pix = normalise(images[:2])
        logits = packed_logits(model, pix, ids, pos, mask, labels, cfg.image_token_index, cfg)
        packed = torch.full((*labels.shape, logits.shape[-1]), float("nan"))
        packed[labels != -100] = logits
        worst = 0.0
        for b in range(2):
            pil = Image.fromarray(images[b].permute(1, 2, 0).numpy())
            for (q, a, _), (bb, lo, hi, _) in zip(qas[b], [s for s in segments if s[0] == b]):
                inputs = processor(images=pil, text=prompt_text(q) + f" {a}</s>", return_tensors="pt")
                assert torch.allclose(inputs["pixel_values"], pix[b : b + 1], atol=1e-5)
                ref = model(**inputs).logits[0]
                n = hi - lo
                worst = max(worst, (ref[-n - 1 : -1] - packed[b, lo:hi]).abs().max().item())
        print(f"self-check: packed vs HF forward max |logit diff| = {worst:.2e}", flush=True)
        assert worst < 1e-3
    model.train()


# -------------------------------------------------------------------------------------------- main


def init_weights(model: LlavaForConditionalGeneration, args) -> None:
    """HF's LLaVA init draws every weight from N(0, initializer_range) (it is written for fine-tuning, not for
    training from scratch). That leaves the projected image features, and CLIP's position embeddings, so small
    next to everything else that the decoder learns to ignore the image for a long time. Scale them up."""
    with torch.no_grad():
        for linear in (model.multi_modal_projector.linear_1, model.multi_modal_projector.linear_2):
            linear.weight.normal_(0.0, linear.in_features**-0.5)
        model.vision_tower.vision_model.embeddings.position_embedding.weight.normal_(0.0, args.pos_init_std)


def main() -> None:
    p = argparse.ArgumentParser(description="Train the bundled tiny LLaVA demo model (CPU, from scratch).")
    p.add_argument("--out", type=Path, default=REPO / "tessera" / "tiny_demo_model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-scenes", type=int, default=40000)
    p.add_argument("--val-scenes", type=int, default=400)
    p.add_argument("--steps", type=int, default=1800)
    p.add_argument("--batch", type=int, default=32, help="scenes (images) per step; each carries all its questions")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.05)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--patch-size", type=int, default=8)
    p.add_argument("--vision-hidden", type=int, default=128)
    p.add_argument("--vision-layers", type=int, default=3)
    p.add_argument("--vision-heads", type=int, default=4)
    p.add_argument("--text-hidden", type=int, default=128)
    p.add_argument("--text-layers", type=int, default=3)
    p.add_argument("--text-heads", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=400)
    p.add_argument("--init-range", type=float, default=0.06, help="std of HF's LLaVA weight init")
    p.add_argument("--pos-init-std", type=float, default=0.5, help="std of CLIP's position embeddings at init")
    p.add_argument(
        "--aux-weight",
        type=float,
        default=1.0,
        help="weight of the auxiliary per-patch loss on the vision tower (0: answer loss only)",
    )
    p.add_argument(
        "--aux-steps", type=int, default=None, help="apply the auxiliary loss for this many steps (default all)"
    )
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--time-budget", type=float, default=19 * 60, help="seconds; training stops early past it")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--check", action="store_true", help="verify packed training forward against HF's forward")
    args = p.parse_args()

    t0 = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    def elapsed() -> str:
        return f"[{time.time() - t0:7.1f}s]"

    images, qas, patch_targets = make_scenes(args.train_scenes, args.seed + 1, args.image_size, args.patch_size)
    val_images, val_qas, _ = make_scenes(args.val_scenes, args.seed + 2, args.image_size, args.patch_size)
    n_questions = sum(map(len, qas))
    print(f"{elapsed()} {args.train_scenes} training scenes ({n_questions} questions)", flush=True)

    texts = ["USER: <image>\nDescribe the image. ASSISTANT:"]
    texts += sorted({f"{q} ASSISTANT: {a}" for scene in qas for q, a, _ in scene})
    tokenizer = build_tokenizer(texts, args.vocab_size)
    processor = build_processor(args, tokenizer)
    config = build_config(args, tokenizer)
    config.text_config.initializer_range = args.init_range
    encoder = Encoder(tokenizer, config.image_seq_length)
    print(f"{elapsed()} tokenizer: {len(tokenizer)} tokens; image prefix {len(encoder.prefix)} tokens", flush=True)

    model = LlavaForConditionalGeneration(config)
    init_weights(model, args)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{elapsed()} model: {n_params / 1e6:.2f}M parameters ({n_params * 4 / 2**20:.1f} MiB fp32)", flush=True)
    if args.check:
        self_check(model, processor, encoder, images, qas, config)
    model.train()
    # Training aid, not saved: per-patch classifiers (shape, colour, position, rank from the left of the object
    # under the patch) on the vision features the projector reads.
    aux_head = torch.nn.Linear(args.vision_hidden, sum(AUX_CLASSES))

    params = list(model.named_parameters()) + [(f"aux.{n}", p) for n, p in aux_head.named_parameters()]
    decay = [p for n, p in params if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in params if not (p.ndim >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.98),
    )

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    aux_steps = args.steps if args.aux_steps is None else args.aux_steps
    order = torch.randperm(args.train_scenes, generator=torch.Generator().manual_seed(args.seed))
    cursor, running, running_aux, t_train = 0, [], [], time.time()
    for step in range(args.steps):
        if cursor + args.batch > len(order):
            order, cursor = (
                torch.randperm(args.train_scenes, generator=torch.Generator().manual_seed(args.seed + step)),
                0,
            )
        idx = order[cursor : cursor + args.batch].tolist()
        cursor += args.batch
        ids, pos, mask, labels, _ = pack(encoder, [qas[i] for i in idx])
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        logits, states = packed_logits(
            model, normalise(images[idx]), ids, pos, mask, labels, config.image_token_index, config, return_states=True
        )
        loss = F.cross_entropy(logits, labels[labels != -100])
        total = loss
        if args.aux_weight and step < aux_steps:
            aux_logits = aux_head(states).flatten(0, 1).split(AUX_CLASSES, dim=-1)
            targets = patch_targets[idx].flatten(0, 1)
            aux_loss = sum(F.cross_entropy(logits_k, targets[:, k]) for k, logits_k in enumerate(aux_logits))
            total = loss + args.aux_weight * aux_loss
            running_aux.append(aux_loss.item())
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        running.append(loss.item())
        if (step + 1) % args.log_every == 0 or step == 0:
            rate = (step + 1) / (time.time() - t_train)
            aux_text = f" aux {sum(running_aux) / len(running_aux):.4f}" if running_aux else ""
            print(
                f"{elapsed()} step {step + 1}/{args.steps} answer loss {sum(running) / len(running):.4f}{aux_text} "
                f"lr {lr_at(step):.2e} ({rate:.2f} steps/s, seq {ids.shape[1]})",
                flush=True,
            )
            running, running_aux = [], []
        if (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            scores = evaluate(model, encoder, val_images, val_qas, config)
            print(f"{elapsed()} val (teacher-forced exact match): {format_scores(scores)}", flush=True)
        if time.time() - t0 > args.time_budget:
            print(f"{elapsed()} time budget reached: stopping after {step + 1} steps", flush=True)
            break
    scores = evaluate(model, encoder, val_images, val_qas, config)
    print(f"{elapsed()} final val (teacher-forced exact match): {format_scores(scores)}", flush=True)

    out: Path = args.out
    if out.exists():
        shutil.rmtree(out)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    hparams = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    hparams["steps_done"] = step + 1
    (out / "training_args.json").write_text(json.dumps(hparams, indent=2) + "\n")
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{elapsed()} saved to {out} ({size / 2**20:.2f} MiB)", flush=True)


if __name__ == "__main__":
    main()
