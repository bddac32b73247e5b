"""Unit tests for tessera.multimodal.parse: validating the user's multi_modal_data."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from tessera.errors import InputError
from tessera.multimodal.parse import (
    EmbeddingItems,
    ImageEmbeddingItems,
    ImageProcessorItems,
    ImageSize,
    MultiModalDataParser,
    ProcessorBatchItems,
)

W, H = 5, 6  # distinct, so that a width/height swap shows


def parse(**mm_data):
    return MultiModalDataParser().parse_mm_data(mm_data)


def pil_image(width=W, height=H, mode="RGB"):
    return Image.new(mode, (width, height), color=0)


# ---- images ------------------------------------------------------------------------------------

IMAGE_FORMS = {
    "pil": (lambda: pil_image(), 1),
    "pil_list": (lambda: [pil_image(), pil_image()], 2),
    "numpy_hwc": (lambda: np.zeros((H, W, 3), dtype=np.uint8), 1),
    "numpy_hwc_gray": (lambda: np.zeros((H, W, 1), dtype=np.uint8), 1),
    "numpy_batch": (lambda: np.zeros((4, H, W, 3), dtype=np.uint8), 4),
    "tensor_chw": (lambda: torch.zeros(3, H, W), 1),
    "tensor_chw_rgba": (lambda: torch.zeros(4, H, W), 1),
    "tensor_batch": (lambda: torch.zeros(2, 3, H, W), 2),
}


@pytest.mark.parametrize("form", IMAGE_FORMS)
def test_image_forms_are_accepted_with_count_and_size(form):
    make, count = IMAGE_FORMS[form]
    items = parse(image=make())
    images = items.get_items("image", ImageProcessorItems)
    assert items.get_count("image") == count
    assert [images.get_image_size(i) for i in range(count)] == [ImageSize(width=W, height=H)] * count


def test_image_size_of_pil_is_width_height():
    images = parse(image=[pil_image(9, 4), pil_image(4, 9)]).get_items("image", ImageProcessorItems)
    assert images.get_image_size(0) == ImageSize(width=9, height=4)
    assert images.get_image_size(1) == ImageSize(width=4, height=9)


def test_processor_data_lists_the_images():
    a, b = pil_image(), pil_image()
    images = parse(image=[a, b])["image"]
    data = images.get_processor_data()
    assert list(data) == ["images"]
    assert len(data["images"]) == 2 and data["images"][0] is a and data["images"][1] is b
    assert images.get_passthrough_data() == {}


def test_tensor_batch_is_split_into_items():
    batch = torch.randn(2, 3, H, W)
    images = parse(image=batch)["image"]
    assert all(torch.equal(images[i], batch[i]) for i in range(2))


def test_other_modalities_are_passed_as_plural_key():
    items = parse(point_cloud="cloud")
    assert isinstance(items["point_cloud"], ProcessorBatchItems)
    assert items["point_cloud"].get_processor_data() == {"point_clouds": ["cloud"]}


def test_audio_that_is_no_waveform_is_refused():
    with pytest.raises(InputError, match="audio must be a waveform"):
        parse(audio="clip")


@pytest.mark.parametrize("empty", [[], np.zeros((0, H, W, 3), dtype=np.uint8)])
def test_empty_images_mean_no_modality(empty):
    items = parse(image=empty)
    assert "image" not in items
    assert items.get_count("image", strict=False) == 0


def test_none_is_skipped():
    assert "image" not in parse(image=None)


def test_get_count_of_absent_modality_strict_raises_keyerror():
    with pytest.raises(KeyError, match="image"):
        parse().get_count("image")


# ---- embeddings --------------------------------------------------------------------------------


def test_embeds_as_3d_tensor():
    embeds = torch.randn(2, 7, 4)
    items = parse(image_embeds=embeds)
    image = items.get_items("image", ImageEmbeddingItems)
    assert image.get_count() == 2
    assert [image.get_feature_size(i) for i in range(2)] == [7, 7]
    passthrough = image.get_passthrough_data()
    assert list(passthrough) == ["image_embeds"]
    assert all(torch.equal(p, e) for p, e in zip(passthrough["image_embeds"], embeds))
    assert image.get_processor_data() == {}


def test_embeds_as_list_of_2d_tensors():
    embeds = [torch.randn(3, 4), torch.randn(5, 4)]
    image = parse(image_embeds=embeds).get_items("image", EmbeddingItems)
    assert [image.get_feature_size(i) for i in range(2)] == [3, 5]
    assert all(p is e for p, e in zip(image.get_passthrough_data()["image_embeds"], embeds))


def test_empty_embeds_list_means_no_modality():
    assert "image" not in parse(image_embeds=[])


# ---- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mm_data, message",
    [
        ({"image": "cat.png"}, r"Image 0 has unsupported type str"),
        ({"image": [pil_image(), 42]}, r"Image 1 has unsupported type int"),
        ({"image": np.zeros((H, W), dtype=np.uint8)}, r"numpy array of shape \(6, 5\).*HWC uint8"),
        ({"image": np.zeros((H, W, 3), dtype=np.float32)}, r"dtype float32.*HWC uint8"),
        ({"image": np.zeros((H, W, 2), dtype=np.uint8)}, r"numpy array of shape \(6, 5, 2\)"),
        ({"image": torch.zeros(8, 8, 3)}, r"tensor of shape \(8, 8, 3\); expected a CHW"),
        ({"image": torch.zeros(H, W)}, r"tensor of shape \(6, 5\); expected a CHW"),
        ({"image": pil_image(), "image_embeds": torch.zeros(1, 2, 4)}, r"Both raw image.*image_embeds"),
        ({"image_embeds": torch.zeros(1, 2, 4), "image": pil_image()}, r"Both raw image.*image_embeds"),
        ({"image_embeds": torch.zeros(8)}, r"image_embeds must be a \(num_items, feature_size, hidden_size\)"),
        ({"image_embeds": [torch.zeros(2, 4), torch.zeros(1, 2, 4)]}, r"image_embeds must be"),
        ({"image_embeds": np.zeros((1, 2, 4))}, r"image_embeds must be"),
    ],
    ids=[
        "str_path",
        "int_in_list",
        "numpy_2d",
        "numpy_float",
        "numpy_2_channels",
        "tensor_hwc",
        "tensor_2d",
        "image_then_embeds",
        "embeds_then_image",
        "embeds_1d",
        "embeds_list_with_3d",
        "embeds_numpy",
    ],
)
def test_invalid_data_raises_valueerror_naming_the_problem(mm_data, message):
    with pytest.raises(ValueError, match=message):
        MultiModalDataParser().parse_mm_data(mm_data)


def test_truncated_png_raises_valueerror(tmp_path):
    rng = np.random.default_rng(0)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(buffer, format="PNG")
    png = buffer.getvalue()
    path = tmp_path / "truncated.png"
    path.write_bytes(png[: len(png) // 2])
    with Image.open(path) as image, pytest.raises(ValueError, match="Image 0 could not be decoded"):
        parse(image=image)


def test_get_items_with_wrong_type_raises_typeerror():
    items = parse(image=pil_image())
    with pytest.raises(TypeError, match="ImageProcessorItems"):
        items.get_items("image", ImageEmbeddingItems)


@pytest.mark.parametrize(
    "image",
    [Image.new("RGB", (1, 1)), Image.new("RGB", (40, 3)), np.zeros((2, 30, 3), dtype=np.uint8),
     torch.zeros(3, 3, 20)],
)  # fmt: skip
def test_images_too_small_for_the_processors_are_refused(image):
    """A processor misreads the channel axis of an image with under 4 rows (tests/multimodal/test_image_decode.py)."""
    with pytest.raises(InputError, match=r"Image 0 is \d+x\d+ pixels; images must be at least 4 pixels on each side"):
        MultiModalDataParser().parse_mm_data({"image": image})
    assert MultiModalDataParser().parse_mm_data({"image": Image.new("RGB", (4, 4))}).get_count("image") == 1
