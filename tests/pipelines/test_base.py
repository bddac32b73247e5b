"""AbstractMultimodalPipeline's helpers and defaults, and the params every pipeline honours."""

from __future__ import annotations

import pytest
import torch

from tessera.pipelines import AbstractMultimodalPipeline, load_pipeline


class Minimal(AbstractMultimodalPipeline):
    name = staticmethod(lambda: "minimal")
    image_start = staticmethod(lambda: None)
    image_end = staticmethod(lambda: None)

    def placeholder_token_id(self):
        return 3

    def num_image_embeds(self):
        return 2

    def embed_images(self, images):
        raise NotImplementedError


@pytest.mark.parametrize(
    "value, expected",
    [(None, torch.float32), (32, torch.float32), ("16", torch.float16), (16, torch.float16), ("bf16", torch.bfloat16),
     ("Half", torch.float16), ("float32", torch.float32)],
)  # fmt: skip
def test_get_dtype_reads_bits_or_names(value, expected):
    assert Minimal()._get_dtype("vision_bits", {"vision_bits": value}) == expected


def test_get_dtype_refuses_other_bit_widths():
    with pytest.raises(ValueError, match="vision_bits must be 16 or 32"):
        Minimal()._get_dtype("vision_bits", {"vision_bits": 8})


def test_get_device_defaults_to_the_gpu_if_any_else_the_cpu():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert Minimal()._get_device("vision_device", {}).type == expected
    assert Minimal()._get_device("vision_device", {"vision_device": "cpu"}) == torch.device("cpu")


def test_placeholder_embeddings_are_the_text_embeddings_of_the_placeholder():
    pipeline = Minimal()
    table = torch.nn.Embedding(8, 4)
    pipeline.attach(type("TextModel", (), {"get_input_embeddings": lambda self, ids: table(ids)})(), tokenizer=None)
    torch.testing.assert_close(pipeline.placeholder_embeddings(), table(torch.tensor([3, 3])))


def test_the_llava_pipeline_honours_bits_and_devices(llava_parts):
    params = {"model_path": str(llava_parts["text"]), "vision_tower": str(llava_parts["vision"]), "vision_bits": 16,
              "projector_bits": "bf16", "vision_device": "cpu", "projector_device": "cpu"}  # fmt: skip
    pipeline = load_pipeline("llava-v1.5-7b", params=params)
    assert next(pipeline.vision_tower.parameters()).dtype == torch.float16
    assert next(pipeline.mm_projector.parameters()).dtype == torch.bfloat16
