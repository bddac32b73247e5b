"""Loading images from data URLs and local files, and refusing everything else clearly."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from tessera.multimodal.media import load_image_url
from tests.multimodal.test_processing import random_images


def encoded(image, fmt):
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def data_url(payload: bytes, mime="image/png"):
    return f"data:{mime};base64,{base64.b64encode(payload).decode()}"


@pytest.fixture
def image():
    return random_images([(12, 8)], seed=1)[0]


@pytest.mark.parametrize("fmt, mime", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp")])
def test_data_urls_decode(image, fmt, mime):
    loaded = load_image_url(data_url(encoded(image, fmt), mime))
    assert loaded.size == image.size and loaded.format == fmt
    expected = Image.open(io.BytesIO(encoded(image, fmt)))  # PIL's own decoding of the same bytes
    assert np.array_equal(np.asarray(loaded), np.asarray(expected))


def test_a_png_data_url_is_lossless(image):
    assert np.array_equal(np.asarray(load_image_url(data_url(encoded(image, "PNG")))), np.asarray(image))


def test_the_mime_type_is_case_insensitive(image):
    assert load_image_url(data_url(encoded(image, "PNG"), "IMAGE/PNG")).size == image.size


@pytest.mark.parametrize("mime", ["text/plain", "application/octet-stream", "image/svg+xml", ""])
def test_an_unsupported_mime_type_is_refused(image, mime):
    with pytest.raises(ValueError, match=r"Unsupported media type .*image/png"):
        load_image_url(data_url(encoded(image, "PNG"), mime))


def test_a_data_url_that_is_not_base64_encoded_is_refused(image):
    with pytest.raises(ValueError, match="must be base64-encoded"):
        load_image_url("data:image/png,rawbytes")


@pytest.mark.parametrize("payload", ["not base64!", "abc", "iVBORw0KGgo=%%"])
def test_invalid_base64_is_refused(payload):
    with pytest.raises(ValueError, match="not valid base64"):
        load_image_url(f"data:image/png;base64,{payload}")


@pytest.mark.parametrize("payload", [b"definitely not an image", b"\x89PNG\r\n\x1a\n truncated", b""])
def test_an_undecodable_payload_is_refused(payload):
    with pytest.raises(ValueError, match="data URL could not be decoded as an image"):
        load_image_url(data_url(payload))


@pytest.mark.parametrize("url", ["http://example.com/cat.png", "https://example.com/cat.png"])
def test_http_urls_are_not_fetched(url):
    with pytest.raises(ValueError, match=r"http\(s\) image URLs are not fetched"):
        load_image_url(url, allow_any_local=True)


@pytest.fixture
def image_file(tmp_path, image):
    path = tmp_path / "media" / "a picture.png"
    path.parent.mkdir()
    image.save(path)
    return path


@pytest.mark.parametrize("form", ["plain", "file-url"])
def test_local_files_load_with_allow_any_local(image_file, image, form):
    url = str(image_file) if form == "plain" else image_file.as_uri()  # as_uri percent-encodes the space
    assert "%20" in url or form == "plain"
    loaded = load_image_url(url, allow_any_local=True)
    assert np.array_equal(np.asarray(loaded), np.asarray(image))


def test_a_file_inside_the_allowed_folder_loads(image_file, image):
    loaded = load_image_url(str(image_file), allowed_local_dir=image_file.parent)
    assert loaded.size == image.size


def test_a_missing_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_image_url(str(tmp_path / "missing.png"), allow_any_local=True)


def test_a_file_that_is_not_an_image_is_refused(tmp_path):
    path = tmp_path / "notes.png"
    path.write_text("hello")
    with pytest.raises(ValueError, match="could not be decoded as an image"):
        load_image_url(str(path), allow_any_local=True)


@pytest.mark.parametrize("allowed", ["elsewhere", None])
def test_a_file_outside_the_allowed_folder_is_refused(tmp_path, image_file, allowed):
    allowed_dir = None if allowed is None else tmp_path / allowed
    with pytest.raises(ValueError, match="not inside the allowed media folder"):
        load_image_url(str(image_file), allowed_local_dir=allowed_dir)


def test_dot_dot_cannot_leave_the_allowed_folder(tmp_path, image_file):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    sneaky = allowed / ".." / image_file.parent.name / image_file.name
    with pytest.raises(ValueError, match="not inside the allowed media folder"):
        load_image_url(str(sneaky), allowed_local_dir=allowed)


def test_a_symlink_cannot_leave_the_allowed_folder(tmp_path, image_file):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "link.png").symlink_to(image_file)
    with pytest.raises(ValueError, match="not inside the allowed media folder"):
        load_image_url(str(allowed / "link.png"), allowed_local_dir=allowed)
