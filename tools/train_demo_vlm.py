"""Train the demo VLM: a CLIP-style ViT from scratch in front of SmolLM2-135M-Instruct (LLaVA format), plus a
LoRA on the language model, on the synthetic scenes of ``tools/demo_vlm_data.py``.

The image tokens are made to *be words*: the encoder writes the scene as a fixed list of slot tokens
(``tools/demo_vlm_slots.py``: each object's ranks, size, colour, shape and position, left to right, as
SmolLM2 token embeddings), and the language model learns to answer from those. That splits the training into
two stages that never meet, each cheap where joint training was not (see docs/demo-vlm-training.md):

1. Reader (``--reader-steps``): SmolLM2 + LoRA answers conversations about a scene whose image positions hold
   its true slot tokens (no images, no vision encoder; ``tools/demo_vlm_reader.py``). To keep its text
   answers, every step also distils SmolLM2 into itself on text-only chats (KL to its LoRA-off next-token
   distributions along its own answers to ``tools/demo_vlm_chat_data.py``'s prompts), and some conversations
   end in such a chat.
2. Encoder (``--encoder-steps``): the ViT learns to classify every image position into its slot token
   (``tools/demo_vlm_encoder.py``), with per-patch heads on a middle layer.

Then the classifier is exported as LLaVA's projector (sigmoid, then the slot tokens' embeddings) and the
shipped side is written to ``--out``, float16: ``vision_config.json``, ``vision.safetensors`` (tower +
projector) and ``lora.safetensors`` (scale folded in), the folder ``tessera.models.demo_vlm.assemble_demo_vlm``
turns into the full model. Everything is seeded and runs offline, on a CUDA GPU where one is at hand, else on
the CPU (bfloat16 where the CPU has it; CPU and GPU give different draws of the same recipe). On a GPU the
scenes are drawn in ``--workers`` data-loader processes. Evaluate the result with
``python -m tools.eval_demo_model --vision-dir OUT``.

The shipped side (tessera/demo_vlm/training.json records each stage's settings, device and minutes) was made
by the defaults' two stages at once on one H100 (encoder 10 min, reader 14 min), then second phases on 2 CPU
cores that continue from the first's outputs: a reader phase with SmolLM2's text answers weighed up (9 min),
an encoder phase on scenes with big shapes placed anywhere (22 min; the data drew those only after the GPU
stages ran) and a reader phase on more above/below relations (15 min). A reader stage writes the
shipped side once the work folder holds both stages' outputs; ``--stage export`` writes it from the folder:

    python -m tools.train_demo_vlm --stage encoder & python -m tools.train_demo_vlm --stage reader; wait
    W=/tmp/tessera-demo-vlm-train
    python -m tools.train_demo_vlm --stage reader --init-lora $W/reader_lora.safetensors \\
        --device cpu --reader-steps 60 --batch 8 --text-batch 12 --distill-weight 8 --reader-lr 5e-4
    python -m tools.train_demo_vlm --stage encoder --init-encoder $W/encoder.safetensors --seed 1 \\
        --device cpu --encoder-steps 2000 --encoder-lr 3e-4 --encoder-eval-every 500
    python -m tools.train_demo_vlm --stage reader --init-lora $W/reader_lora.safetensors --seed 3 \\
        --device cpu --reader-steps 100 --batch 8 --text-batch 12 --distill-weight 8 --reader-lr 3e-4 \\
        --kind-weights relation=8,count=2,describe=2 --eval-every 50

Rounds 5 to 12 (issue 44) continued from the shipped side, on 2 CPU cores and on lent GPUs; their commands are in
docs/demo-vlm-training.md ("The commands of rounds 5 to 12"), every phase's settings in training.json.

Usage: python -m tools.train_demo_vlm [--out tessera/demo_vlm] [--stage all|encoder|reader|export] [--seed 0]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader

from tools import demo_vlm_chat_data as chat_data
from tools import demo_vlm_data as data
from tools import demo_vlm_datasets as datasets
from tools import demo_vlm_slots as slots
from tools.demo_vlm_encoder import (
    PROJECTOR_ACT,
    SceneBatches,
    SlotEncoder,
    export_projector,
    field_errors,
    load_encoder,
    save_encoder,
    slot_errors,
    to_pixels,
)
from tools.demo_vlm_lora import (
    add_lora,
    base_answers,
    distillation_loss,
    load_lora_state,
    lora_state,
    text_agreement,
    text_batch,
)
from tools.demo_vlm_pictures import make_picture
from tools.demo_vlm_reader import (
    KIND_WEIGHTS,
    PICTURE_SHARE,
    collate,
    evaluate_reader,
    reader_conversation,
    reader_loss,
    sample_conversation,
)
from tools.demo_vlm_steps import StepBudget, optimizer_step, schedule

VISION = dict(image_size=data.IMAGE_SIZE, patch_size=16, hidden_size=256, intermediate_size=1024,
              num_hidden_layers=8, num_attention_heads=4)  # fmt: skip
LLAVA_SETTINGS = {"projector_hidden_act": PROJECTOR_ACT, "vision_feature_layer": -1,
                  "vision_feature_select_strategy": "default"}  # fmt: skip


def low_precision(device: str) -> torch.dtype:
    """bfloat16 on a GPU and on CPUs with oneDNN's bfloat16 kernels, else float32."""
    return torch.bfloat16 if device != "cpu" or torch.backends.mkldnn.is_available() else torch.float32


def load_language_model(work: Path, seed: int, device: str):
    """SmolLM2 (frozen, ``low_precision``) in a LLaVA model assembled with a throwaway vision side, and its
    tokenizer with the demo's chat template."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from tessera.models.demo_vlm import CHAT_TEMPLATE, assemble_demo_vlm
    from testkit.demo_vlm import build_random_vision_dir

    folder = assemble_demo_vlm(work / "model", build_random_vision_dir(work / "vision0", seed=seed))
    tokenizer = AutoProcessor.from_pretrained(folder).tokenizer
    tokenizer.chat_template = CHAT_TEMPLATE
    model = LlavaForConditionalGeneration.from_pretrained(folder, dtype=low_precision(device)).to(device)
    model.requires_grad_(False)
    return model.eval(), tokenizer


def train_reader(model, tokenizer, args, rng: random.Random, log, checkpoint: Path):
    """Stage 1: the LoRA that answers from slot tokens, kept to SmolLM2's text answers (its ``lora_state`` saved to
    `checkpoint` at every evaluation). -> {name: LoRALinear}"""
    prompts = chat_data.general_prompts(args.seed)
    answers = base_answers(model, tokenizer, prompts, max_new_tokens=64)
    held_out = chat_data.HELD_OUT_QUESTIONS
    held_out_answers = base_answers(model, tokenizer, held_out, max_new_tokens=32)
    chats = [(p, tokenizer.decode(a[:-1])) for p, a in zip(prompts, answers) if a[-1] == tokenizer.eos_token_id]
    log(f"SmolLM2's answers to {len(prompts)} prompts ({len(chats)} complete)")
    wrapped = add_lora(model.model.language_model, args.lora_rank, alpha=2.0 * args.lora_rank)
    if args.init_lora:  # a second phase: continue from an earlier run's LoRA
        load_lora_state(wrapped, load_file(args.init_lora))
    params = [p for layer in wrapped.values() for p in (layer.lora_A, layer.lora_B)]
    optimizer = torch.optim.AdamW(params, lr=args.reader_lr, weight_decay=0.0)
    eval_scenes = datasets.make_eval_scenes(10, seed=args.seed + 1000)
    budget = StepBudget("reader", args.reader_minutes, warm=0, fit=20)
    for step in itertools.count():
        args.reader_steps = budget.steps(step, args.reader_steps, log)
        if step >= args.reader_steps:
            break
        items = [reader_conversation(tokenizer, *sample_conversation(rng, args.turns, chats, args.chat_share,
                                                                     args.kind_weights, args.picture_share))
                 for _ in range(args.batch)]  # fmt: skip
        loss = reader_loss(model, collate(items, tokenizer.pad_token_id), noise=args.slot_noise)
        picks = rng.sample(range(len(prompts)), args.text_batch)
        texts = text_batch(tokenizer, [prompts[i] for i in picks], [answers[i] for i in picks])
        distill = distillation_loss(model, texts)
        lr = schedule(step, args.reader_steps, args.reader_lr, warmup=30)
        optimizer_step(optimizer, params, loss + args.distill_weight * distill, lr)
        if step % 25 == 0:
            log(f"reader step {step}/{args.reader_steps}: answer loss {loss.item():.3f}, text KL {distill.item():.4f}")
        if (step + 1) % args.eval_every == 0 or step == args.reader_steps - 1:
            scores = evaluate_reader(model, tokenizer, eval_scenes)
            same = text_agreement(model, tokenizer, held_out, held_out_answers)
            log("reader held-out (true slots): " + ", ".join(f"{k} {h}/{n}" for k, (h, n) in sorted(scores.items()))
                + f"; text answers kept {same}/{len(held_out)}")  # fmt: skip
            # float16, as shipped: a GPU machine hands back files of at most 16 MB (float32 is 20 MB)
            save_file({k: v.half().contiguous() for k, v in lora_state(wrapped).items()}, checkpoint)
    return wrapped


def train_encoder(args, log, checkpoint: Path) -> SlotEncoder:
    """Stage 2: the ViT that writes a scene's slot tokens into its image positions (saved to `checkpoint` at
    every evaluation)."""
    encoder = SlotEncoder.from_config(VISION)
    if args.init_encoder:  # a second phase: continue from an earlier run's encoder, or the shipped one
        load_encoder(encoder, args.init_encoder)
    encoder = encoder.to(args.device)
    optimizer = torch.optim.AdamW(encoder.parameters(), lr=args.encoder_lr, weight_decay=0.01)
    eval_rng = random.Random(args.seed + 2000)
    eval_scenes = [data.make_scene(eval_rng, "eval") for _ in range(200)]
    eval_scenes += [make_picture(eval_rng, "eval") for _ in range(round(200 * args.encoder_picture_share))]
    aligned = [data.align_pair(data.make_scene(eval_rng, "eval", n=n), eval_rng) for n in (2, 3, 4, 5) * 25]
    eval_pixels = torch.stack([to_pixels(data.render(s)) for s in eval_scenes + aligned]).to(args.device)
    dtype = low_precision(args.device)
    autocast = torch.autocast(torch.device(args.device).type, dtype=dtype, enabled=dtype == torch.bfloat16)
    scenes = SceneBatches(args.seed + 1, args.encoder_batch, args.encoder_text_share, args.encoder_picture_share,
                          args.encoder_align_share)  # fmt: skip
    batches = DataLoader(scenes, batch_size=None, num_workers=args.workers, pin_memory=args.device != "cpu")
    budget = StepBudget("encoder", args.encoder_minutes, warm=10, fit=60)  # timed once the data workers run
    for step, batch in enumerate(batches):
        args.encoder_steps = budget.steps(step, args.encoder_steps, log)
        if step >= args.encoder_steps:
            break
        pixels, target, patch_target = (t.to(args.device, non_blocking=True) for t in batch)
        with autocast:
            loss, accuracy = encoder.loss(pixels, target, patch_target)
        lr = schedule(step, args.encoder_steps, args.encoder_lr, warmup=200)
        optimizer_step(optimizer, list(encoder.parameters()), loss, lr)
        if step % 100 == 0:
            log(f"encoder step {step}/{args.encoder_steps}: loss {loss.item():.3f}, slot accuracy {accuracy:.3f}")
        if (step + 1) % args.encoder_eval_every == 0 or step == args.encoder_steps - 1:
            encoder.eval()
            with autocast, torch.no_grad():
                logits, _ = encoder(eval_pixels)
            slot_wrong, scene_wrong = slot_errors(logits[: len(eval_scenes)], eval_scenes)
            fields = field_errors(logits[: len(eval_scenes)], eval_scenes)
            aligned_wrong = slot_errors(logits[len(eval_scenes) :], aligned)
            encoder.train()
            log(f"encoder held-out layouts: {slot_wrong:.2%} of slots wrong, {scene_wrong:.1%} of scenes; by field: "
                + ", ".join(f"{name} {share:.1%}" for name, share in fields.items())
                + "; two objects aligned: {:.2%} of slots wrong, {:.1%} of scenes".format(*aligned_wrong))  # fmt: skip
            save_encoder(encoder, checkpoint)
    return encoder.eval()


def save_shipped(encoder: SlotEncoder, embeddings: torch.Tensor, lora: dict, out: Path, sharpen: float) -> None:
    """The shipped side, float16: vision_config.json, vision.safetensors (tower + projector), lora.safetensors."""
    out.mkdir(parents=True, exist_ok=True)
    state = {f"vision_tower.{k}": v for k, v in encoder.tower.state_dict().items() if not k.endswith("position_ids")}
    projector = export_projector(encoder.classifier, embeddings, sharpen)
    state |= {f"multi_modal_projector.{k}": v for k, v in projector.items()}
    save_file({k: v.detach().half().contiguous() for k, v in state.items()}, out / "vision.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    save_file({k: v.half().contiguous() for k, v in lora.items()}, out / "lora.safetensors", metadata={"format": "pt"})
    settings = {"vision_config": encoder.tower.config.to_diff_dict() | {"model_type": "clip_vision_model"}}
    (out / "vision_config.json").write_text(json.dumps(settings | LLAVA_SETTINGS, indent=2))


# The records training.json collects, in order.
STAGES = ("encoder", "encoder-continued", "reader", "reader-continued")


def kind_weights(text: str) -> dict[str, float]:
    """'relation=3,count=2' -> {"relation": 3.0, "count": 2.0}: the reader's question kind weights."""
    weights = {}
    for part in filter(None, text.split(",")):
        kind, _, weight = part.partition("=")
        if kind.strip() not in datasets.KINDS:
            known = ", ".join(datasets.KINDS)
            raise argparse.ArgumentTypeError(f"unknown question kind {kind.strip()!r}; kinds: {known}")
        weights[kind.strip()] = float(weight)
    return weights


def record_stage(args, stage: str, start: float) -> None:
    """The stage's settings, device and minutes, for the shipped training.json (stages may run apart)."""
    cuda = args.device.startswith("cuda")
    device = torch.cuda.get_device_name(args.device) if cuda else f"CPU, {torch.get_num_threads()} threads"
    record = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    record |= {"device": device, "minutes": round((time.perf_counter() - start) / 60, 1)}
    path = args.work / f"{stage}.json"
    if stage.endswith("-continued"):  # phases may follow each other: each one's record is kept, in order
        earlier = json.loads(path.read_text()) if path.is_file() else []
        record = [*(earlier if isinstance(earlier, list) else [earlier]), record]
    path.write_text(json.dumps(record, indent=2))
    if not stage.endswith("-continued"):  # a fresh output is not the one an earlier second phase started from
        (args.work / f"{stage}-continued.json").unlink(missing_ok=True)


def stage_records(work: Path) -> dict:
    """The records of the stages that made the work folder's current outputs, in training order."""
    files = [work / f"{stage}.json" for stage in STAGES]
    return {path.stem: json.loads(path.read_text()) for path in files if path.is_file()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("tessera/demo_vlm"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/tessera-demo-vlm-train"))
    parser.add_argument("--stage", choices=("all", "reader", "encoder", "export"), default="all",
                        help="run one stage only (independent: they may run at once; the shipped side is written "
                             "once the work folder holds both; export: write it from the work folder)")  # fmt: skip
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workers", type=int, default=None,
                        help="encoder: scene-drawing processes (default: 0 on a CPU, up to 10 on a GPU)")  # fmt: skip
    parser.add_argument("--reader-steps", type=int, default=1200)
    parser.add_argument("--reader-minutes", type=float, default=None,
                        help="reader: a time budget; the step count (at most --reader-steps) is fitted to it "
                             "after 20 steps, the learning-rate schedule with it")  # fmt: skip
    parser.add_argument("--encoder-steps", type=int, default=12000)
    parser.add_argument("--encoder-minutes", type=float, default=None,
                        help="encoder: a time budget, as --reader-minutes (fitted after 60 steps)")  # fmt: skip
    parser.add_argument("--batch", type=int, default=16, help="reader: conversations per step")
    parser.add_argument("--turns", type=int, default=6, help="reader: question/answer turns per conversation")
    parser.add_argument(
        "--kind-weights",
        type=kind_weights,
        default=dict(KIND_WEIGHTS),
        help="reader: how often each question kind is drawn, e.g. relation=3,count=2 (the rest 1)",
    )
    parser.add_argument("--chat-share", type=float, default=0.3, help="reader: conversations ending in a chat")
    parser.add_argument(
        "--picture-share",
        type=float,
        default=PICTURE_SHARE,
        help="reader: conversations about a picture with no shapes",
    )
    parser.add_argument("--text-batch", type=int, default=4, help="reader: text-only chats per step (distillation)")
    parser.add_argument("--distill-weight", type=float, default=2.0)
    parser.add_argument("--slot-noise", type=float, default=0.1, help="reader: noise on the slot embeddings")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--init-lora", type=Path, help="reader: start from this saved LoRA (a second phase)")
    parser.add_argument(
        "--init-encoder",
        type=Path,
        help="encoder: start from this saved encoder or shipped vision side (a second phase)",
    )
    parser.add_argument("--reader-lr", type=float, default=1.5e-3)
    parser.add_argument("--encoder-batch", type=int, default=64)
    parser.add_argument("--encoder-lr", type=float, default=1e-3)
    parser.add_argument("--encoder-text-share", type=float, default=0.5,
                        help="encoder: scenes drawn with a text (the rest as the data's own mix: ~35%% have one); "
                             "reading is the slowest thing the tower learns")  # fmt: skip
    parser.add_argument(
        "--encoder-picture-share",
        type=float,
        default=0.15,
        help="encoder: pictures with no shapes (photographs, noise, drawings), all slots fillers",
    )
    parser.add_argument("--encoder-align-share", type=float, default=0.2,
                        help="encoder: scenes with two objects in one column or row, as people draw them")  # fmt: skip
    parser.add_argument("--sharpen", type=float, default=4.0, help="export: the classifier's logit scale")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=400, help="reader: steps between evaluations")
    parser.add_argument("--encoder-eval-every", type=int, default=2000)
    args = parser.parse_args()
    if args.workers is None:
        args.workers = 0 if args.device == "cpu" else min(10, max(1, (os.cpu_count() or 2) - 4))

    start = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{(time.perf_counter() - start) / 60:6.1f} min] {message}", flush=True)

    args.work.mkdir(parents=True, exist_ok=True)
    lora_file, encoder_file = args.work / "reader_lora.safetensors", args.work / "encoder.safetensors"
    if args.stage in ("all", "encoder"):
        torch.manual_seed(args.seed + 1)
        train_encoder(args, log, checkpoint=encoder_file)
        record_stage(args, "encoder-continued" if args.init_encoder else "encoder", start)
        if args.stage == "encoder":
            return log(f"encoder done: {encoder_file}")
    reader_start = time.perf_counter()  # a stage's minutes are its own, also under --stage all
    model, tokenizer = load_language_model(args.work, args.seed, args.device)
    if args.stage in ("all", "reader"):
        torch.manual_seed(args.seed)
        train_reader(model, tokenizer, args, random.Random(args.seed), log, checkpoint=lora_file)
        record_stage(args, "reader-continued" if args.init_lora else "reader", reader_start)
    if not (lora_file.is_file() and encoder_file.is_file()):
        log(f"stage {args.stage} done; the other stage's output is not in {args.work} yet")
        return
    encoder = SlotEncoder.from_config(VISION)
    load_encoder(encoder, encoder_file)
    embeddings = model.model.get_input_embeddings().weight[list(slots.vocab_ids(tokenizer))].float().cpu()
    save_shipped(encoder.eval(), embeddings, load_file(lora_file), args.out, args.sharpen)
    records = stage_records(args.work) | {"slot_vocab": list(slots.VOCAB), "sharpen": args.sharpen}
    (args.out / "training.json").write_text(json.dumps(records, indent=2))
    log(f"done; vision side and LoRA written to {args.out}")


if __name__ == "__main__":
    main()
