"""Unit tests for tessera.multimodal.hasher: content hashes for the processor cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.image_utils import SizeDict

from tessera.multimodal.hasher import MultiModalHasher


def h(**kwargs):
    return MultiModalHasher.hash_kwargs(**kwargs)


def rgb_array(seed=0, shape=(4, 6, 3)):
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def test_hash_is_deterministic():
    kwargs = dict(model_id="m", item=Image.fromarray(rgb_array()), kwargs={"size": 224})
    assert h(**kwargs) == h(**kwargs)


def test_hash_does_not_depend_on_kwarg_order():
    assert h(a=1, b="x", c=[1.0]) == h(c=[1.0], b="x", a=1)


def test_hash_does_not_depend_on_nested_dict_order():
    assert h(kwargs={"size": 1, "crop": {"h": 2, "w": 3}}) == h(kwargs={"crop": {"w": 3, "h": 2}, "size": 1})


def test_equal_pixels_in_separate_images_hash_equal():
    a = Image.fromarray(rgb_array())
    b = Image.fromarray(rgb_array())
    assert a is not b
    assert h(item=a) == h(item=b)


def test_non_contiguous_tensor_hashes_like_its_contiguous_copy():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).T
    assert not t.is_contiguous()
    assert h(x=t) == h(x=t.contiguous())


def test_bfloat16_tensor_hashes():
    values = [0.5, -1.25, 3.0]
    assert h(x=torch.tensor(values, dtype=torch.bfloat16)) == h(x=torch.tensor(values, dtype=torch.bfloat16))


def _one_pixel_changed():
    array = rgb_array()
    array[1, 2, 0] ^= 1
    return Image.fromarray(array)


def _same_bytes_as(mode):
    return Image.frombytes(mode, (6, 4), rgb_array().tobytes())


_BYTES = np.arange(12, dtype=np.uint8)

# (a, b): two values that must hash differently; each is a zero-argument factory.
DIFFERENT = {
    "one_pixel": (lambda: Image.fromarray(rgb_array()), _one_pixel_changed),
    "rgb_vs_rgba": (lambda: Image.fromarray(rgb_array()), lambda: Image.fromarray(rgb_array()).convert("RGBA")),
    "image_size_same_bytes": (
        lambda: Image.frombytes("L", (4, 3), _BYTES.tobytes()),
        lambda: Image.frombytes("L", (3, 4), _BYTES.tobytes()),
    ),
    "ndarray_shape": (lambda: _BYTES.reshape(3, 4), lambda: _BYTES.reshape(4, 3)),
    "ndarray_dtype_view": (lambda: _BYTES, lambda: _BYTES.view(np.int8)),
    "ndarray_vs_tensor": (lambda: _BYTES, lambda: torch.from_numpy(_BYTES.copy())),
    "tensor_shape": (lambda: torch.zeros(2, 3), lambda: torch.zeros(3, 2)),
    "bfloat16_vs_float16": (
        lambda: torch.tensor([0.5, -1.25, 3.0], dtype=torch.bfloat16),
        lambda: torch.tensor([0.5, -1.25, 3.0], dtype=torch.float16),
    ),
    "processor_kwarg": (lambda: {"size": 224}, lambda: {"size": 336}),
    "str_vs_int": (lambda: "1", lambda: 1),
    "int_vs_float": (lambda: 1, lambda: 1.0),
    "bool_vs_int": (lambda: True, lambda: 1),
    "none_vs_str": (lambda: None, lambda: "None"),
    "str_vs_bytes": (lambda: "a", lambda: b"a"),
    "list_vs_tuple": (lambda: [1, 2], lambda: (1, 2)),
    "nested_list": (lambda: [[1, 2], [3]], lambda: [[1], [2, 3]]),
    "nested_dict": (lambda: {"a": {"b": [1]}}, lambda: {"a": {"b": [2]}}),
    "dict_key_type": (lambda: {1: "x"}, lambda: {"1": "x"}),
    "size_dict": (lambda: SizeDict(height=16, width=16), lambda: SizeDict(height=16, width=8)),
    "size_dict_vs_dict": (lambda: SizeDict(height=16, width=16), lambda: {"height": 16, "width": 16}),
}


@pytest.mark.parametrize("case", DIFFERENT)
def test_different_values_hash_differently(case):
    make_a, make_b = DIFFERENT[case]
    assert h(item=make_a()) != h(item=make_b())


@pytest.mark.parametrize(
    "make_a, make_b",
    [
        (lambda: _same_bytes_as("RGB"), lambda: _same_bytes_as("YCbCr")),
        (
            lambda: Image.fromarray(_BYTES.reshape(3, 4), "L"),
            lambda: Image.fromarray(_BYTES.reshape(3, 4), "L").convert("P"),
        ),
    ],
    ids=["rgb_vs_ycbcr", "l_vs_p"],
)
def test_mode_enters_the_hash_when_pixel_arrays_are_equal(make_a, make_b):
    a, b = make_a(), make_b()
    assert a.mode != b.mode and np.array_equal(np.asarray(a), np.asarray(b))
    assert h(item=a) != h(item=b)


def test_same_value_under_different_keys_hashes_differently():
    assert h(a=1) != h(b=1)


def test_moving_a_value_between_keys_changes_the_hash():
    assert h(a=1, b=2) != h(a=2, b=1)


@pytest.mark.parametrize("value", [object(), {1, 2}, [1, object()], {"k": object()}])
def test_unsupported_object_raises_typeerror(value):
    with pytest.raises(TypeError, match="Cannot hash"):
        h(item=value)


def test_equal_size_dicts_hash_equal():
    """transformers 5 processors take sizes as SizeDict dataclasses (e.g. Fuyu's patch_size)."""
    assert h(item=SizeDict(height=16, width=16)) == h(item=SizeDict(height=16, width=16))


def test_palette_images_with_different_palettes_hash_differently():
    red, blue = Image.new("P", (2, 2), 0), Image.new("P", (2, 2), 0)
    red.putpalette([255, 0, 0] * 256)
    blue.putpalette([0, 0, 255] * 256)
    assert not np.array_equal(np.asarray(red.convert("RGB")), np.asarray(blue.convert("RGB")))
    assert h(item=red) != h(item=blue)


# ---- suspected bugs ----------------------------------------------------------------------------


def test_object_ndarray_hashes_by_value_or_is_rejected():
    a = np.array([float("1.5")], dtype=object)
    b = np.array([float("1.5")], dtype=object)
    assert a[0] is not b[0]
    try:
        ha, hb = h(item=a), h(item=b)
    except TypeError:
        return
    assert ha == hb
