"""ModelConfig: the device option ("auto" picks CUDA when there is one; parts follow the model)."""

from __future__ import annotations

import pytest
import torch

from tessera.config import ModelConfig


@pytest.mark.parametrize("cuda", [False, True])
@pytest.mark.parametrize("device", ["auto", None])
def test_auto_device_is_cuda_when_available_else_cpu(tiny_llava_dir, monkeypatch, cuda, device):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    config = ModelConfig(str(tiny_llava_dir), device=device)
    expected = "cuda" if cuda else "cpu"
    assert (config.device, config.vision_device, config.projector_device) == (expected,) * 3


def test_explicit_devices_are_kept_and_parts_may_differ(tiny_llava_dir):
    config = ModelConfig(str(tiny_llava_dir), device="cpu", vision_device="cuda:1", projector_device="auto")
    assert (config.device, config.vision_device, config.projector_device) == ("cpu", "cuda:1", "cpu")
