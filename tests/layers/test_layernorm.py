"""RMSNorm against Hugging Face's LlamaRMSNorm (float32 math, scaled in the input dtype)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from tessera.layers.layernorm import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_matches_hf(dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 96, generator=gen) * 3).to(dtype)
    weight = (1 + torch.randn(96, generator=gen) / 4).to(dtype)
    ours, theirs = RMSNorm(96, eps=1e-5).to(dtype), LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
        got, want = ours(x), theirs(x)
    assert got.dtype == want.dtype == dtype
    # float32: one fused kernel, its sum in another order (~1 ulp); lower precision: HF's rounding steps
    torch.testing.assert_close(got, want, atol=0, rtol=1e-6 if dtype == torch.float32 else 0)
