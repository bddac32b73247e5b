"""Gemma 4's audio encoder against transformers' Gemma4AudioModel on a tiny random tower (fp32): same state-dict
names, and per clip the same valid positions for two clips of different lengths in one padded batch, features
and masks from transformers' Gemma4AudioFeatureExtractor."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma4AudioConfig, Gemma4AudioFeatureExtractor
from transformers.models.gemma4.modeling_gemma4 import Gemma4AudioModel as HFGemma4AudioModel

from tessera.models.gemma4_audio import Gemma4AudioModel, num_audio_tokens
from testkit.audio import random_audio

MEL_BINS = 16  # transformers sizes input_proj_linear from subsampling_conv_channels[0]: ceil(16 / 4) == 16 // 4

CONFIGS = {
    # the real chunking (12 per chunk, 13 left, none right), loose clamps that never bind
    "default-window": dict(attention_chunk_size=12, attention_context_left=13, attention_context_right=0),
    # small chunks with right context, a low logit cap and a gradient clip that binds
    "right-context": dict(attention_chunk_size=4, attention_context_left=6, attention_context_right=3,
                          attention_logit_cap=3.0, gradient_clipping=0.7),
}  # fmt: skip


def tiny_config(**overrides) -> Gemma4AudioConfig:
    return Gemma4AudioConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                             subsampling_conv_channels=[16, 8], output_proj_dims=48, conv_kernel_size=5,
                             **overrides)  # fmt: skip


def tiny_hf_tower(config: Gemma4AudioConfig) -> HFGemma4AudioModel:
    """transformers' tower with weights wide enough that a wrong port shows, and clip bounds that clamp."""
    torch.manual_seed(0)
    tower = HFGemma4AudioModel(config).eval()
    with torch.no_grad():
        for name, p in tower.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.2)
            elif name.endswith("per_dim_scale"):
                p.normal_(0.0, 1.0)
            else:  # norm scales, output_proj.bias
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
        for name, b in tower.named_buffers():
            bound = 0.5 + torch.rand(()).item()  # about 1: RMS-normalised inputs cross it often
            if name.endswith(("input_min", "output_min")):
                b.fill_(-bound)
            elif name.endswith(("input_max", "output_max")):
                b.fill_(bound)
    return tower


def features(clips: list[tuple[float, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(seconds, seed) per clip -> input_features [B, T, MEL_BINS], input_features_mask [B, T] bool."""
    extractor = Gemma4AudioFeatureExtractor(feature_size=MEL_BINS)
    out = extractor([random_audio(s, seed=seed) for s, seed in clips], return_tensors="pt")
    return out["input_features"], out["input_features_mask"]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_transformers(name: str) -> None:
    config = tiny_config(**CONFIGS[name])
    hf = tiny_hf_tower(config)
    with torch.device("meta"):  # as Tessera's loader builds it: every tensor must come from the checkpoint
        ours = Gemma4AudioModel(config)
    assert set(ours.state_dict()) == set(hf.state_dict())
    ours.load_state_dict(hf.state_dict(), strict=True, assign=True)
    ours.eval()

    # 0.58 s: 57 valid mel frames (15 tokens, past one 12-position chunk); 0.26 s: 25 frames, 7 tokens, padded
    feats, mask = features([(0.58, 1), (0.26, 2)])
    assert feats.shape[-1] == MEL_BINS and mask.dtype == torch.bool
    valid = mask.sum(-1).tolist()
    assert valid[0] > valid[1] and all(n % 4 for n in valid) and not mask[1].all()

    with torch.no_grad():
        ref = hf(feats, mask)
        got = ours(feats, mask)
    assert len(got) == 2
    for i, clip in enumerate(got):
        expected = ref.last_hidden_state[i][ref.attention_mask[i]]
        assert clip.shape == (num_audio_tokens(valid[i]), config.output_proj_dims)
        torch.testing.assert_close(clip, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(mask[:, ::2][:, ::2], ref.attention_mask)  # each stride-2 convolution keeps mask[::2]
    assert got[0].shape[0] > config.attention_chunk_size  # chunked attention with context from an earlier chunk

    # padded frames are masked out, not just zero: noise there changes nothing, here or in transformers
    noisy = feats.masked_fill(~mask[..., None], 0.0) + torch.randn_like(feats) * ~mask[..., None]
    with torch.no_grad():
        ref_noisy = hf(noisy, mask).last_hidden_state[1][ref.attention_mask[1]]
        got_noisy = ours(noisy, mask)[1]
    torch.testing.assert_close(ref_noisy, got[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_noisy, got[1], atol=1e-5, rtol=1e-5)

    # the same weights in bf16 run and stay near the fp32 result
    with torch.no_grad():
        half = ours.to(torch.bfloat16)(feats.bfloat16(), mask)
    for clip, ref_clip in zip(half, got):
        assert clip.dtype == torch.bfloat16
        assert (clip.float() - ref_clip).abs().max() < 0.1 * ref_clip.abs().max()


def test_clip_alone_matches_batched() -> None:
    """Padding does not leak: the short clip alone gives what it gives in the batch."""
    config = tiny_config(**CONFIGS["right-context"])
    ours = Gemma4AudioModel(config)
    ours.load_state_dict(tiny_hf_tower(config).state_dict())
    feats, mask = features([(0.58, 1), (0.26, 2)])
    alone_feats, alone_mask = features([(0.26, 2)])
    with torch.no_grad():
        batched = ours(feats, mask)[1]
        alone = ours(alone_feats, alone_mask)[0]
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-5)


def test_num_audio_tokens() -> None:
    mask = torch.arange(40)[None] < torch.arange(41)[:, None]  # every prefix length 0..40
    assert mask[:, ::2][:, ::2].sum(-1).tolist() == [num_audio_tokens(n) for n in range(41)]
    assert num_audio_tokens(2999) == 750  # 30 s, the feature extractor's cut
