"""Decoding untrusted image bytes: header checks before decoding, EXIF orientation, RGB conversion."""

from __future__ import annotations

import io
import logging
import struct
import warnings
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile, ImageOps
from transformers import CLIPImageProcessor
from transformers.image_utils import ChannelDimension, infer_channel_dimension_format
from transformers.image_utils import load_image as hf_load_image

from tessera.errors import InputError, InputTooLargeError
from tessera.multimodal.image_decode import check_image, decode_image, to_rgb
from tessera.multimodal.media import MediaPolicy
from testkit import random_images

POLICY = MediaPolicy()


def encoded(image, fmt, **kwargs):
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_header_only(width, height):
    """A PNG whose header declares width x height (8-bit RGB) and whose pixel data is one empty
    zlib stream: PIL reads the size from it without decoding anything."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", zlib.compress(b"")) + png_chunk(
        b"IEND", b"")  # fmt: skip


@pytest.fixture
def no_decoding(monkeypatch):
    """Fails the test (and records it) if any image's pixels are decoded."""
    calls = []

    def load(self, *args, **kwargs):
        calls.append(self.size)
        raise AssertionError("the pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    return calls


def rgb(image):
    return np.asarray(image.convert("RGB"))


# ---- plain images --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "BMP", "WEBP"])
def test_a_lossless_rgb_image_decodes_to_its_pixels(fmt):
    image = random_images([(12, 9)], seed=3)[0]
    decoded = decode_image(encoded(image, fmt, **({"lossless": True} if fmt == "WEBP" else {})), POLICY)
    assert decoded.mode == "RGB" and decoded.format == fmt
    assert np.array_equal(np.asarray(decoded), np.asarray(image))


def make_mode(mode):
    """A 16x12 image in `mode` with varied pixels (and transparency where the mode has it)."""
    base = random_images([(16, 12)], seed=7)[0]
    if mode == "P+transparency":
        image = base.quantize(8)
        image.info["transparency"] = 2
        return image, "PNG"
    if mode == "P":
        return base.quantize(16), "GIF"
    if mode == "RGBA":
        image = base.convert("RGBA")
        image.putalpha(Image.linear_gradient("L").resize(base.size))
        return image, "PNG"
    if mode == "LA":
        return base.convert("LA"), "PNG"
    if mode == "CMYK":
        return base.convert("CMYK"), "JPEG"
    return base.convert(mode), "PNG"


@pytest.mark.parametrize("mode", ["P+transparency", "P", "RGBA", "LA", "L", "1", "CMYK"])
def test_other_modes_convert_like_hf_load_image(mode):
    image, fmt = make_mode(mode)
    data = encoded(image, fmt)
    reference = hf_load_image(Image.open(io.BytesIO(data)))  # HF's exif_transpose + convert("RGB")
    decoded = decode_image(data, POLICY)
    assert decoded.mode == "RGB" and decoded.size == image.size
    assert np.array_equal(np.asarray(decoded), np.asarray(reference))


@pytest.mark.parametrize("orientation, transpose", [(3, Image.Transpose.ROTATE_180), (6, Image.Transpose.ROTATE_270),
                                                    (8, Image.Transpose.ROTATE_90)])  # fmt: skip
def test_the_exif_orientation_is_applied(orientation, transpose):
    image = Image.new("RGB", (32, 16), (255, 0, 0))
    image.paste((0, 0, 255), (16, 0, 32, 16))  # the right half blue
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encoded(image, "JPEG", exif=exif.tobytes(), quality=95)
    stored = Image.open(io.BytesIO(data)).convert("RGB")  # the pixels as stored, before orientation
    decoded = decode_image(data, POLICY)
    assert decoded.size == (stored.size if orientation == 3 else stored.size[::-1])
    assert np.array_equal(np.asarray(decoded), np.asarray(stored.transpose(transpose)))
    assert np.array_equal(np.asarray(decoded), np.asarray(hf_load_image(Image.open(io.BytesIO(data)))))


def test_a_broken_exif_block_does_not_lose_the_image(monkeypatch):
    image = random_images([(8, 8)], seed=2)[0]

    def broken(*args, **kwargs):
        raise SyntaxError("not a TIFF file")

    monkeypatch.setattr(ImageOps, "exif_transpose", broken)
    assert np.array_equal(np.asarray(decode_image(encoded(image, "PNG"), POLICY)), np.asarray(image))


def test_a_16_bit_gradient_spans_0_to_255():
    values = np.linspace(0, 65535, 300).round().astype(np.uint16)
    data = encoded(Image.fromarray(np.tile(values, (4, 1))), "PNG")
    assert Image.open(io.BytesIO(data)).mode.startswith("I;16")  # the case convert("RGB") clips at 255
    decoded = np.asarray(decode_image(data, POLICY))
    expected = np.round(values / 257)  # 8-bit v is stored as v * 257 in 16 bits
    assert (decoded == expected[None, :, None]).all()
    assert decoded.min() == 0 and decoded.max() == 255 and len(np.unique(decoded)) > 250


def test_32_bit_integer_and_float_images_are_scaled_not_clipped():
    ints = np.array([[0, 257, 32896, 65535, 70000, -5]], dtype=np.int32)
    assert Image.fromarray(ints).mode == "I"
    assert np.asarray(to_rgb(Image.fromarray(ints)))[0, :, 0].tolist() == [0, 1, 128, 255, 255, 0]
    floats = np.array([[0.0, 0.5, 1.0, 2.0, -1.0, np.nan]], dtype=np.float32)
    assert Image.fromarray(floats).mode == "F"
    assert np.asarray(to_rgb(Image.fromarray(floats)))[0, :, 0].tolist() == [0, 128, 255, 255, 0, 0]


def test_an_animated_gif_gives_its_first_frame():
    frames = [Image.new("RGB", (8, 8), colour) for colour in [(255, 0, 0), (0, 0, 255)]]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:], duration=100)
    assert Image.open(io.BytesIO(buffer.getvalue())).n_frames == 2
    assert (np.asarray(decode_image(buffer.getvalue(), POLICY)) == [255, 0, 0]).all()


# ---- what is not an image ------------------------------------------------------------------------------


def truncated_png():
    data = encoded(random_images([(64, 64)], seed=4)[0], "PNG")
    return data[: len(data) // 2]


@pytest.mark.parametrize("data", [b"definitely not an image", b"\x89PNG\r\n\x1a\n truncated", b"", truncated_png(),
                                  b"GIF89a" + b"\xff" * 40])  # fmt: skip
def test_undecodable_bytes_get_a_clean_message(data):
    with pytest.raises(InputError) as error:
        decode_image(data, POLICY)
    message = str(error.value)
    assert type(error.value) is InputError and "could not be decoded" in message
    assert "BytesIO" not in message and "0x" not in message and "<" not in message


def test_formats_outside_the_policy_are_not_decoded():
    data = encoded(random_images([(8, 8)], seed=5)[0], "TIFF")
    with pytest.raises(InputError, match="not a JPEG, PNG, WebP, GIF or BMP image"):
        decode_image(data, POLICY)
    assert decode_image(data, MediaPolicy(image_formats=None)).size == (8, 8)


def test_the_decoding_failure_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="tessera.multimodal.image_decode"), pytest.raises(InputError):
        decode_image(b"definitely not an image", POLICY)
    assert any("could not be decoded" in r.getMessage() for r in caplog.records)


# ---- sizes, checked before decoding --------------------------------------------------------------------


def test_a_huge_image_is_refused_from_its_header(no_decoding):
    with pytest.raises(InputTooLargeError, match="13000x13000 pixels, over the limit of 67108864 pixels"):
        decode_image(png_header_only(13000, 13000), POLICY)
    assert no_decoding == []


def test_pils_decompression_bomb_warning_never_escapes(recwarn, no_decoding):
    assert 13000 * 13000 > Image.MAX_IMAGE_PIXELS  # PIL warns about this one while opening it
    with pytest.raises(InputTooLargeError):
        decode_image(png_header_only(13000, 13000), POLICY)
    assert not [w for w in recwarn if issubclass(w.category, Image.DecompressionBombWarning)]


def test_pils_decompression_bomb_error_is_a_413(no_decoding):
    assert 20000 * 20000 > 2 * Image.MAX_IMAGE_PIXELS  # PIL refuses this one itself, whatever our limit
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(InputTooLargeError, match="over the limit of"):
            decode_image(png_header_only(20000, 20000), MediaPolicy(max_pixels=10**10))


@pytest.mark.parametrize("size", [(1, 60000), (60000, 1), (4, 60000)])
def test_an_elongated_image_is_refused_before_decoding(no_decoding, size):
    with pytest.raises(InputError, match=f"{size[0]}x{size[1]} pixels") as error:
        decode_image(png_header_only(*size), POLICY)
    assert type(error.value) is InputError and no_decoding == []


def test_a_real_1x60000_png_is_refused_without_decoding(no_decoding):
    data = encoded(Image.new("L", (1, 60000)), "PNG")
    with pytest.raises(InputError, match="1x60000 pixels"):
        decode_image(data, POLICY)
    assert no_decoding == []


def test_the_pixel_limit_is_inclusive():
    image = random_images([(24, 16)], seed=6)[0]
    data = encoded(image, "PNG")
    assert decode_image(data, MediaPolicy(max_pixels=24 * 16)).size == (24, 16)
    with pytest.raises(InputTooLargeError, match="24x16 pixels"):
        decode_image(data, MediaPolicy(max_pixels=24 * 16 - 1))


def test_the_aspect_ratio_limit_is_inclusive():
    limit = POLICY.max_aspect_ratio
    side = POLICY.min_side
    at_limit = Image.new("RGB", (int(side * limit), side))
    assert decode_image(encoded(at_limit, "PNG"), POLICY).size == at_limit.size
    over = Image.new("RGB", (int(side * limit) + 1, side))
    with pytest.raises(InputError, match="aspect ratio over the limit of 200 to 1"):
        decode_image(encoded(over, "PNG"), POLICY)


# ---- tiny images ---------------------------------------------------------------------------------------

CLIP = dict(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64})


def processed(image, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CLIPImageProcessor(**CLIP)(images=[image], return_tensors="np", **kwargs)["pixel_values"]


def test_why_min_side_is_4():
    """HF's image utilities guess the channel axis of an array: (H, W, 3) with H in (1, 3) reads
    as channels first. Processors that take the guess (the PIL-backend ones of transformers 4.x,
    remote-code processors) fail at height 1 and give wrong pixels silently at height 3."""
    assert POLICY.min_side == 4
    for height in (1, 3):
        assert infer_channel_dimension_format(np.zeros((height, 10, 3))) == ChannelDimension.FIRST
    assert infer_channel_dimension_format(np.zeros((POLICY.min_side, 10, 3))) == ChannelDimension.LAST


@pytest.mark.parametrize("size", [(4, 4), (4, 9), (9, 4), (5, 5), (6, 4), (4, 6), (7, 800)])
def test_every_small_image_allowed_is_processed_right(size):
    image = decode_image(encoded(random_images([size], seed=9)[0], "PNG"), POLICY)
    assert np.allclose(processed(image), processed(image, input_data_format="channels_last"))


@pytest.mark.parametrize("size", [(1, 1), (2, 2), (3, 3), (3, 10), (10, 3), (1, 10), (10, 1)])
def test_smaller_images_get_a_clear_400(size):
    data = encoded(Image.new("RGB", size), "PNG")
    with pytest.raises(InputError) as error:
        decode_image(data, POLICY)
    assert str(error.value) == (f"The image is {size[0]}x{size[1]} pixels; "
                                "images must be at least 4 pixels on each side.")  # fmt: skip
    with pytest.raises(InputError, match="at least 4 pixels on each side"):
        check_image(Image.new("RGB", size))


def test_check_image_applies_the_same_limits():
    check_image(Image.new("RGB", (8, 8)))
    check_image(Image.new("RGB", (8, 8)), MediaPolicy(max_pixels=64))
    with pytest.raises(InputTooLargeError):
        check_image(Image.new("1", (9, 8)), MediaPolicy(max_pixels=64))
    with pytest.raises(InputError, match="aspect ratio"):
        check_image(Image.new("1", (4 * 201, 4)))
    with pytest.raises(InputError, match="Expected a PIL image, not str"):
        check_image("cat.png")  # type: ignore[arg-type]
