"""A multi-turn chat about one image on a hybrid model (Qwen3.5): time to first token of each later turn,
warm (the engine kept the previous turns: their KV blocks and snapshots of the recurrent state) against
cold (the same prompt to an engine without prefix caching, its encoder and processor caches emptied).

Each turn's prompt is the previous prompt's tokens, the answer's tokens, then the chat template's end of
turn and the next question: what a chat gives when the tokenizer reads the model's own answer back as the
tokens it generated (real tokenizers do, for ordinary text; the test tokenizer does not for the random
tokens a random model writes, so the prompts are built from tokens here).

Model: random weights of Qwen3.5's shape at 12 of its layers (9 Gated DeltaNet, 3 gated attention: the
published 3:1 pattern), hidden 1024, attention 8 heads over 2 KV heads of 256 dims (a quarter rotated),
DeltaNet 16 key and 16 value heads of 128, vocab 248320 (tied); Qwen3.5's vision tower at 4 of its 27
blocks (width 1152, 16-pixel patches, 2x2 merge); a 448 x 448 image is 196 tokens. fp32.

    .venv/bin/python -m benchmarks.bench_hybrid_chat [--repeats 3] [--turns 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from tessera import LLM, SamplingParams

FOLDER = Path("/tmp/tessera-bench-qwen3_5-12layers")
TEXT = dict(
    hidden_size=1024, intermediate_size=3584, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=2,
    head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, vocab_size=248320, max_position_embeddings=32768,
    rms_norm_eps=1e-6, layer_types=["linear_attention"] * 3 + ["full_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True},
)  # fmt: skip
TEXT["layer_types"] = TEXT["layer_types"] * (TEXT["num_hidden_layers"] // 4)
VISION = dict(
    depth=4, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16, spatial_merge_size=2,
    temporal_patch_size=2, hidden_act="gelu_pytorch_tanh", num_position_embeddings=2304,
)  # fmt: skip
QUESTIONS = ["Describe this picture in detail, please.", "What colours stand out?", "Is there any text in it?",
             "What would you title it?", "Anything unusual?"]  # fmt: skip


def build(folder: Path = FOLDER) -> Path:
    if (folder / "model.safetensors").is_file():
        return folder
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    from testkit import build_tokenizer
    from testkit.tokenizer import QWEN_VL_CHAT_TEMPLATE, QWEN_VL_SPECIAL_TOKENS

    start = time.perf_counter()
    tokenizer = build_tokenizer("qwen")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_VL_SPECIAL_TOKENS}
    text = dict(
        TEXT, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"]
    )
    config = Qwen3_5Config(
        text_config=text, vision_config=dict(VISION, out_hidden_size=TEXT["hidden_size"]), tie_word_embeddings=True,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        Qwen3_5ForConditionalGeneration(config).save_pretrained(folder, safe_serialization=True)
    processing = dict(patch_size=16, temporal_patch_size=2, merge_size=2)
    Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(**processing), tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(**processing), chat_template=QWEN_VL_CHAT_TEMPLATE,
    ).save_pretrained(folder)  # fmt: skip
    print(f"built {folder} in {time.perf_counter() - start:.0f} s", flush=True)
    return folder


def forget(llm: LLM) -> None:
    """Make an idle engine cold: no encoder output or processor output kept (it keeps no prefix blocks)."""
    llm.engine.core.encoder_cache.reset()
    cache = getattr(llm.engine.processor, "cache", None)
    if cache is not None:
        cache.clear()


def ttft(llm: LLM, prompt: dict, max_tokens: int) -> tuple[float, list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate(prompt, params, use_tqdm=False)
    return out.outputs[0].metrics.time_to_first_token, list(out.outputs[0].token_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="chats, each about another image")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--answer-tokens", type=int, default=24)
    args = parser.parse_args()
    folder = str(build())
    torch.manual_seed(0)
    warm_llm = LLM(folder, kv_cache_memory="2GiB", max_num_seqs=4)
    cold_llm = LLM(folder, kv_cache_memory="2GiB", max_num_seqs=4, enable_prefix_caching=False)
    tokenizer = warm_llm.get_tokenizer()
    rng = np.random.default_rng(0)
    warm: dict[int, list[float]] = {}
    cold: dict[int, list[float]] = {}
    for _ in range(args.repeats):
        image = Image.fromarray(rng.integers(0, 256, (448, 448, 3), dtype=np.uint8))
        first = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                              {"type": "text", "text": QUESTIONS[0]}]}]  # fmt: skip
        ids = tokenizer.encode(warm_llm.render_chat(first)["prompt"], add_special_tokens=False)  # one image pad
        for turn in range(args.turns):
            prompt = {
                "prompt_token_ids": list(ids),
                "multi_modal_data": {"image": image},
            }  # the pad expanded by the engine
            seconds, answer = ttft(warm_llm, prompt, args.answer_tokens)
            warm.setdefault(turn, []).append(seconds)
            forget(cold_llm)
            cold.setdefault(turn, []).append(ttft(cold_llm, prompt, 1)[0])
            question = QUESTIONS[(turn + 1) % len(QUESTIONS)]
            ids += answer + tokenizer.encode(
                f"<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
            )
    print(f"Qwen3.5-shaped hybrid (12 layers, 9 DeltaNet + 3 attention), a 448x448 image; TTFT, medians of "
          f"{args.repeats} chats:")  # fmt: skip
    for turn in range(args.turns):
        w, c = statistics.median(warm[turn]), statistics.median(cold[turn])
        print(f"  turn {turn + 1}: warm {w * 1e3:8.1f} ms   cold {c * 1e3:8.1f} ms   x{c / w:5.1f}"
              + ("   (goal >= 5x)" if turn else "   (first turn: nothing to reuse)"))  # fmt: skip
    blocks = warm_llm.engine.core.block_manager
    print(
        f"prefix-cache hit rate {blocks.prefix_hit_rate:.2f} ({blocks.prefix_hits} of {blocks.prefix_queries} tokens)"
    )


if __name__ == "__main__":
    main()
