"""A tiny GGUF file (llama.cpp's format) written offline with the gguf package: a Llama of SmolLM2's
layout (grouped-query attention, tied embeddings) with a byte-level vocabulary, ChatML special tokens
and a ChatML chat template, so the GGUF paths can be tested without a downloaded model.

The tokenizer settings are arguments, so a test can write the file a converter gets wrong.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import numpy as np

from .tokenizer import CHATML_TEMPLATE

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Ids 0, 1, 2, as in SmolLM2: unk / end of text, BOS and start of a turn, EOS and end of a turn."""
MERGES = ("Ġ t", "h e", "Ġt he", "Ġ a", "i s", "Ġ is", "Ġ P", "a r")
TINY = dict(hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2)
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
"""K-quants the gguf package reads but cannot write: `random_k_quant` writes their blocks."""


def random_k_quant(rng: np.random.Generator, kind, rows: int, cols: int) -> np.ndarray:
    """Raw bytes of a [rows, cols] tensor of random K-quant blocks (256 values each, cols a multiple of
    256): random quant and sub-block-scale bytes, which are all valid, and small finite float16 super-
    block scales, so the weights are of the order of 0.1 like the other tensors'. Q4_K's block is d,
    dmin (float16), 12 bytes of 6-bit scales and mins, 128 bytes of 4-bit quants (Q5_K: 32 bytes of fifth
    bits before them); Q6_K's is 128 + 64
    bytes of quants, 16 int8 scales, d (float16)."""
    import gguf

    _, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, size=(rows, cols // 256, block_bytes), dtype=np.uint8)
    if kind in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K):  # w = d * scale * q - dmin * min
        scales = np.abs(rng.standard_normal((rows, cols // 256, 2)) * 0.2 / (15 * 63)).astype(np.float16)
        blocks[..., :4] = scales.view(np.uint8)
    else:  # Q6_K: w = d * scale * (q - 32), |scale| < 128
        scale = np.abs(rng.standard_normal((rows, cols // 256, 1)) * 0.2 / (32 * 127)).astype(np.float16)
        blocks[..., -2:] = scale.view(np.uint8)
    return blocks.reshape(rows, -1)


def build_tiny_gguf(
    path: Union[str, Path],
    *,
    bos_token_id: Optional[int] = 1,
    eos_token_id: Optional[int] = 2,
    pad_token_id: Optional[int] = 2,
    unk_token_id: Optional[int] = 0,
    eot_token_id: Optional[int] = None,
    add_bos_token: Optional[bool] = False,
    add_eos_token: Optional[bool] = None,
    chat_template: Optional[str] = CHATML_TEMPLATE,
    tie_word_embeddings: bool = True,
    extra_tensors: tuple[str, ...] = (),
    weight_type: str = "Q8_0",
    weight_types: Optional[dict[str, str]] = None,
    hidden_size: int = TINY["hidden"],
    intermediate_size: int = TINY["intermediate"],
    seed: int = 0,
) -> Path:
    """Write the file (a token id or flag of None is left out of the metadata). Weights are random
    (seeded) in llama.cpp's layout: the embedding and the projections of `weight_type` (a
    ``GGMLQuantizationType`` name: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, or Q4_K / Q6_K for
    tensors whose rows are a multiple of 256 long, the others Q8_0, as llama.cpp falls back), the
    norms float32; without `tie_word_embeddings` an ``output.weight`` is written too. `weight_types` gives some
    tensors another type, by the name's part after the layer (``{"attn_v": "Q6_K"}``, as llama.cpp's mixes do).
    `extra_tensors`: names of further float32 tensors (of shape [hidden]) to write."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    merged = ["".join(m.split(" ")) for m in MERGES]
    tokens = list(SPECIAL_TOKENS) + sorted(set(bytes_to_unicode().values())) + merged
    types = [gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS) + [gguf.TokenType.NORMAL] * (len(tokens) - 3)
    hidden, inter, layers = hidden_size, intermediate_size, TINY["layers"]
    heads, kv_heads = TINY["heads"], TINY["kv_heads"]
    head_dim = hidden // heads

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-chatml")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(MERGES))
    settings = [
        (bos_token_id, writer.add_bos_token_id), (eos_token_id, writer.add_eos_token_id),
        (pad_token_id, writer.add_pad_token_id), (unk_token_id, writer.add_unk_token_id),
        (eot_token_id, writer.add_eot_token_id), (add_bos_token, writer.add_add_bos_token),
        (add_eos_token, writer.add_add_eos_token), (chat_template, writer.add_chat_template),
    ]  # fmt: skip
    for value, add in settings:
        if value is not None:
            add(value)

    rng = np.random.default_rng(seed)

    def quantized(name: str, rows: int, cols: int) -> None:
        type_name = (weight_types or {}).get(name.split(".")[-2], weight_type)
        kind = gguf.GGMLQuantizationType[type_name]
        block, _ = gguf.GGML_QUANT_SIZES[kind]
        k_quant = type_name in K_QUANTS
        if k_quant and cols % block == 0:
            writer.add_tensor(name, random_k_quant(rng, kind, rows, cols), raw_dtype=kind)
            return
        if k_quant:
            kind = gguf.GGMLQuantizationType.Q8_0
        weights = (rng.standard_normal((rows, cols)) * 0.2).astype(np.float32)
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, weights)
        else:
            writer.add_tensor(name, gguf.quants.quantize(weights, kind), raw_dtype=kind)

    def norm(name: str) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))

    quantized("token_embd.weight", len(tokens), hidden)
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight")
        quantized(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        quantized(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        quantized(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        quantized(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        norm(f"blk.{i}.ffn_norm.weight")
        quantized(f"blk.{i}.ffn_gate.weight", inter, hidden)
        quantized(f"blk.{i}.ffn_up.weight", inter, hidden)
        quantized(f"blk.{i}.ffn_down.weight", hidden, inter)
    norm("output_norm.weight")
    if not tie_word_embeddings:
        quantized("output.weight", len(tokens), hidden)
    for name in extra_tensors:
        norm(name)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
