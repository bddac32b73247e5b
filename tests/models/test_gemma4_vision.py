"""Gemma 4's vision tower and multimodal embedder against Hugging Face transformers on tiny random weights
(fp32): the real image processor's padded batch of images of several sizes and aspect ratios, plain, with
clipped linears (bounds that do clip), standardized, and with grouped kv heads; the state-dict names
must be HF's exactly."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma4AudioConfig, Gemma4ImageProcessor, Gemma4TextConfig, Gemma4VisionConfig
from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder as HFEmbedder
from transformers.models.gemma4.modeling_gemma4 import Gemma4VisionModel as HFVisionModel

from tessera.models.gemma4_vision import Gemma4MultimodalEmbedder, Gemma4VisionModel
from tessera.models.loader import load_tensors
from testkit import random_images

K = 3  # pooling_kernel_size
# (width, height): resized to fit 70 * 9 patches of 16 px; the last one fills them exactly (no padding)
SIZES = [(200, 120), (64, 300), (480, 336)]
TEXT_HIDDEN = 48


def tiny_config(**overrides) -> Gemma4VisionConfig:
    kw = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        head_dim=16, pooling_kernel_size=K, patch_size=16, position_embedding_size=64,
    )  # fmt: skip
    config = Gemma4VisionConfig(**{**kw, **overrides})
    config._attn_implementation = "eager"  # the reference: HF's plain softmax attention, not SDPA
    return config


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Wider than HF's init (which leaves norms at 1, the position table at 1, clip bounds at +-inf and the
    standardization at identity), so that every weight matters; clip bounds tight enough to clip."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith(("_min", "_max")):
                bound = 0.2 + torch.rand((), generator=gen) * 0.3
                tensor.fill_(-bound if name.endswith("_min") else bound)
            elif name.endswith("std_scale"):
                tensor.copy_(0.5 + torch.rand(tensor.shape, generator=gen))
            else:  # weights, norm weights, the position table, std_bias
                tensor.normal_(0.0, 0.2, generator=gen)


@pytest.fixture(scope="module")
def images():
    """The processor's batch: pixel_values [3, 630, 768], image_position_ids [3, 630, 2]."""
    processor = Gemma4ImageProcessor(max_soft_tokens=70, patch_size=16, pooling_kernel_size=K)
    out = processor(random_images(SIZES, seed=0), return_tensors="pt")
    return out["pixel_values"], out["image_position_ids"], list(out["num_soft_tokens_per_image"])


def hf_per_image(hf: HFVisionModel, pixel_values: torch.Tensor, position_ids: torch.Tensor) -> list[torch.Tensor]:
    """The tower's output split per image as `Gemma4Model.get_image_features` splits it (before embed_vision)."""
    with torch.no_grad():
        tokens = hf(pixel_values=pixel_values, pixel_position_ids=position_ids).last_hidden_state
    output_length = pixel_values.shape[-2] // K**2
    k_squared = int((position_ids.shape[1] // output_length) ** 0.5) ** 2
    split_sizes = ((position_ids != -1).all(dim=-1).sum(dim=-1) // k_squared).tolist()
    return list(torch.split(tokens, split_sizes))


CASES = {
    "plain": {},
    "clipped": dict(use_clipped_linears=True),
    "standardized": dict(standardize=True),
    "clipped_standardized_gqa": dict(use_clipped_linears=True, standardize=True, num_key_value_heads=1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tower_matches_hf(case, images):
    pixel_values, position_ids, num_soft_tokens = images
    assert (position_ids[:-1] == -1).all(dim=-1).any(dim=-1).all()  # padding in all but the last image
    torch.manual_seed(0)
    config = tiny_config(**CASES[case])
    hf = HFVisionModel(config).eval()
    randomize(hf, seed=len(case))
    ours = Gemma4VisionModel(config).eval()
    assert set(ours.state_dict()) == set(hf.state_dict())
    ours.load_state_dict(hf.state_dict(), strict=True)

    expected = hf_per_image(hf, pixel_values, position_ids)
    with torch.no_grad():
        got = ours(pixel_values, position_ids)
    assert [t.shape[0] for t in got] == [t.shape[0] for t in expected] == num_soft_tokens
    for g, e in zip(got, expected):
        assert g.shape == (e.shape[0], config.hidden_size) and g.dtype == torch.float32
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)

    if config.use_clipped_linears:  # the bounds do act: without them HF's output differs
        unclipped = HFVisionModel(tiny_config(**{**CASES[case], "use_clipped_linears": False})).eval()
        unclipped.load_state_dict(hf.state_dict(), strict=False)
        free = hf_per_image(unclipped, pixel_values, position_ids)
        assert not torch.allclose(torch.cat(free), torch.cat(expected), atol=1e-3)


def test_embedders_match_hf(images):
    torch.manual_seed(0)
    config = tiny_config()
    text_config = Gemma4TextConfig(hidden_size=TEXT_HIDDEN)
    tokens = torch.randn(7, config.hidden_size) * 3
    audio_config = Gemma4AudioConfig(hidden_size=24, output_proj_dims=40, rms_norm_eps=1e-5)
    for mm_config, x in ((config, tokens), (audio_config, torch.randn(5, 40))):
        hf = HFEmbedder(mm_config, text_config).eval()
        randomize(hf, seed=1)
        ours = Gemma4MultimodalEmbedder.from_configs(mm_config, text_config).eval()
        assert set(ours.state_dict()) == set(hf.state_dict()) == {"embedding_projection.weight"}
        ours.load_state_dict(hf.state_dict(), strict=True)
        with torch.no_grad():
            torch.testing.assert_close(ours(x), hf(x), atol=1e-5, rtol=1e-5)
    direct = Gemma4MultimodalEmbedder(config.hidden_size, TEXT_HIDDEN, config.rms_norm_eps)
    assert direct.embedding_projection.weight.shape == (TEXT_HIDDEN, config.hidden_size)


def test_bfloat16_matches_hf(images, tmp_path):
    """In bfloat16 the tower rounds where HF does (norms, pooling and standardization in float32, cos/sin in
    bf16), so its soft tokens match HF's to bfloat16's tolerance (bit for bit where both use the same kernels).
    HF is loaded with from_pretrained(dtype=bfloat16), which keeps the rope's inv_freq in float32 (`.to(bfloat16)`
    on a built model would round it too)."""
    pixel_values, position_ids, _ = images
    torch.manual_seed(0)
    config = tiny_config(use_clipped_linears=True, standardize=True)
    hf = HFVisionModel(config)
    randomize(hf, seed=3)
    hf.save_pretrained(tmp_path)
    hf = HFVisionModel.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    assert hf.encoder.rotary_emb.inv_freq.dtype == torch.float32
    ours = Gemma4VisionModel(config).to(torch.bfloat16).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    expected = hf_per_image(hf, pixel_values, position_ids)
    with torch.no_grad():
        got = ours(pixel_values, position_ids)
    for g, e in zip(got, expected):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("options", [dict(standardize=True), dict(use_clipped_linears=True)])
def test_builds_on_meta_and_loads_with_tesseras_loader(options, images):
    """As the engine builds towers: on the meta device, every tensor then assigned by name from the checkpoint
    (nothing may be left on meta: the rope table is not a buffer)."""
    pixel_values, position_ids, _ = images
    config = tiny_config(**options)
    hf = HFVisionModel(config).eval()
    randomize(hf, seed=5)
    with torch.device("meta"):
        ours = Gemma4VisionModel(config)
    load_tensors(ours, hf.state_dict().items(), "the HF tower")
    assert not any(t.is_meta for t in [*ours.parameters(), *ours.buffers()])
    with torch.no_grad():
        got = ours(pixel_values, position_ids)
    for g, e in zip(got, hf_per_image(hf, pixel_values, position_ids)):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


def test_rejects_unsupported_config():
    config = tiny_config()
    config.rope_parameters = {"rope_type": "default", "rope_theta": 100.0}  # the config class forces "axial"
    with pytest.raises(ValueError, match="axial"):
        Gemma4VisionModel(config)
    with pytest.raises(ValueError, match="head_dim"):
        Gemma4VisionModel(tiny_config(head_dim=18))
