"""A GGUF file's quantized blocks as integers and scales (tessera.layers.gguf_blocks), against the gguf package's
own de-quantization (llama.cpp's reference in Python) of the same bytes."""

from __future__ import annotations

import pytest
import torch

from tessera.layers.gguf_blocks import DECODED_TYPES, QuantizedBlocks, concat_rows, decode_blocks
from testkit.gguf import K_QUANTS, random_k_quant

gguf = pytest.importorskip("gguf", reason="the gguf package writes the blocks (pip install gguf)")
np = pytest.importorskip("numpy")

ROWS, COLS = 6, 512


def file_bytes(type_name: str, seed: int = 0):
    """[ROWS, bytes] of random weights in `type_name`, as llama.cpp's quantizer (or, for K-quants, which the gguf
    package cannot write, random valid blocks) lays them out."""
    rng = np.random.default_rng(seed)
    kind = gguf.GGMLQuantizationType[type_name]
    if type_name in K_QUANTS:
        return random_k_quant(rng, kind, ROWS, COLS)
    return gguf.quants.quantize((rng.standard_normal((ROWS, COLS)) * 0.2).astype(np.float32), kind)


@pytest.mark.parametrize("type_name", DECODED_TYPES)
def test_blocks_are_the_weights_llama_cpp_dequantizes(type_name):
    raw = file_bytes(type_name)
    blocks = decode_blocks(type_name, raw, COLS)
    reference = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]))
    assert torch.equal(blocks.dequantized(), reference.double())
    assert blocks.q.dtype == torch.int8 and blocks.q.shape == (ROWS, COLS)
    assert blocks.scale.shape == (ROWS, COLS // blocks.group)
    # the 4-bit types fit the int4 kernel (q 0..15 with a zero), the others its int8 one
    assert blocks.four_bit == (type_name in ("Q4_0", "Q4_1", "Q4_K"))
    legacy = not type_name.endswith("_K")
    assert blocks.scale.dtype == (torch.float16 if legacy else torch.float32)  # the file's values, exactly


def test_types_not_decoded_are_left_to_dequantizing():
    assert decode_blocks("Q2_K", np.zeros((1, 84), dtype=np.uint8), 256) is None
    assert decode_blocks("F16", np.zeros((1, 512), dtype=np.uint8), 256) is None


def test_rows_of_two_types_become_one_matrix_with_the_finer_groups():
    q4k, q6k = (decode_blocks(t, file_bytes(t, seed), COLS) for seed, t in enumerate(("Q4_K", "Q6_K")))
    joined = concat_rows([q4k, q6k])
    assert joined.group == 16 and joined.scale.dtype == torch.float32 and joined.zero is not None
    assert not joined.four_bit
    assert torch.equal(joined.dequantized(), torch.cat((q4k.dequantized(), q6k.dequantized())))
    q4_1 = decode_blocks("Q4_1", file_bytes("Q4_1"), COLS)
    both = concat_rows([q4_1, q4k])  # float16 and float32 scales: float32 holds both exactly
    assert both.four_bit and both.scale.dtype == torch.float32
    assert torch.equal(both.dequantized(), torch.cat((q4_1.dequantized(), q4k.dequantized())))
    odd = QuantizedBlocks(q4k.q, q4k.scale.repeat_interleave(32, 1)[:, : COLS // 12], None, 12)
    assert concat_rows([odd, q6k]) is None  # groups of 12 and 16 do not divide each other


def test_rows_reorders_every_part():
    blocks = decode_blocks("Q4_1", file_bytes("Q4_1"), COLS)
    order = torch.tensor([5, 3, 1, 0, 2, 4])
    assert torch.equal(blocks.rows(order).dequantized(), blocks.dequantized()[order])
