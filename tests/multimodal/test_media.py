"""Loading images from data URLs and local files under a MediaPolicy, and refusing everything else
clearly (fetching http(s) is in test_media_fetch.py, decoding in test_image_decode.py)."""

from __future__ import annotations

import base64
import io
import os

import numpy as np
import pytest
from PIL import Image

from tessera.errors import InputError, InputTooLargeError
from tessera.multimodal import media
from tessera.multimodal.media import MediaPolicy, is_http_url, load_image_url, read_media_bytes
from testkit import random_images


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
    with pytest.raises(InputError, match="image could not be decoded"):
        load_image_url(data_url(payload))


@pytest.mark.parametrize("wrap", [
    lambda b64: "\n".join(b64[i:i + 76] for i in range(0, len(b64), 76)),  # base64 -w 76
    lambda b64: "\r\n".join(b64[i:i + 64] for i in range(0, len(b64), 64)) + "\r\n",  # PEM style
    lambda b64: " \t" + " ".join(b64[i:i + 4] for i in range(0, len(b64), 4)) + "\x0b\x0c\n",
])  # fmt: skip
def test_line_wrapped_base64_is_accepted(image, wrap):
    payload = encoded(image, "PNG")
    b64 = base64.b64encode(payload).decode()
    assert len(b64) > 76 and wrap(b64) != b64
    assert read_media_bytes(f"data:image/png;base64,{wrap(b64)}", MediaPolicy()) == payload


@pytest.mark.parametrize("space", ["\u00a0", "\u2003", "\u3000"])
def test_non_ascii_whitespace_is_not_base64(image, space):
    b64 = base64.b64encode(encoded(image, "PNG")).decode()
    with pytest.raises(InputError, match="not valid base64"):
        read_media_bytes(f"data:image/png;base64,{b64[:8]}{space}{b64[8:]}", MediaPolicy())


@pytest.mark.parametrize("size", [30, 31, 32])  # 0, 2 and 1 characters of padding
def test_the_byte_limit_of_data_urls_is_inclusive(size):
    data = bytes(range(size))
    assert read_media_bytes(data_url(data), MediaPolicy(max_bytes=size)) == data
    with pytest.raises(InputTooLargeError, match=f"over the size limit of {size - 1} bytes"):
        read_media_bytes(data_url(data), MediaPolicy(max_bytes=size - 1))


def test_a_huge_data_url_is_refused_before_decoding(monkeypatch):
    def b64decode(*args, **kwargs):
        raise AssertionError("decoded")

    monkeypatch.setattr(media.base64, "b64decode", b64decode)
    payload = "A" * (4 * 1000)  # 3000 bytes
    with pytest.raises(InputTooLargeError):
        read_media_bytes(f"data:image/png;base64,{payload}", MediaPolicy(max_bytes=2990))


@pytest.mark.parametrize("url", ["http://example.com/cat.png", "https://example.com/cat.png", "HTTP://example.com/"])
def test_http_urls_are_not_fetched_by_default(url):
    with pytest.raises(InputError, match=r"http\(s\) image URLs are not fetched"):
        load_image_url(url, allow_any_local=True)
    with pytest.raises(InputError, match=r"http\(s\) image URLs are not fetched"):
        load_image_url(url, MediaPolicy(fetch_urls=True), fetch_http=False)  # the old keyword still works


@pytest.mark.parametrize("url, expected", [
    ("http://example.com/a.png", True), ("HTTPS://example.com/a.png", True), ("data:image/png;base64,AAAA", False),
    ("/srv/media/a.png", False), ("file:///srv/media/a.png", False), ("ftp://example.com/a.png", False),
    ("httpx://example.com/", False), ("http:/", True), ("", False), ("http://[::ffff:127.0.0.1]:80/a.png", True),
    ("http://[::1", True), (" \thttp://example.com/", True), ("ht\ntp://example.com/", True), ("C:/a.png", False),
])  # fmt: skip
def test_is_http_url(url, expected):
    assert is_http_url(url) is expected


@pytest.mark.parametrize("url", ["ftp://example.com/a.png", "gopher://x/", "javascript:alert(1)"])
def test_other_schemes_are_refused(url):
    with pytest.raises(InputError, match="Unsupported image URL scheme"):
        read_media_bytes(url, MediaPolicy(allow_any_local=True, fetch_urls=True))


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


def test_a_missing_file_is_refused_by_the_path_given(tmp_path):
    given = str(tmp_path / "missing.png")
    with pytest.raises(InputError, match=f"Image file {given} does not exist"):
        load_image_url(given, allow_any_local=True)


def test_a_server_never_shows_its_paths(tmp_path):
    policy = MediaPolicy(allowed_local_dir=tmp_path)
    (tmp_path / "folder").mkdir()
    for name, message in [("missing.png", "The image file does not exist."),
                          ("folder", "The image file is a folder, not a file.")]:  # fmt: skip
        with pytest.raises(InputError) as error:
            read_media_bytes(str(tmp_path / name), policy)
        assert str(error.value) == message
    with pytest.raises(InputError) as error:
        read_media_bytes("/etc/passwd", policy)
    assert str(error.value) == "The local file is not inside the allowed media folder."


@pytest.mark.parametrize("policy", [MediaPolicy(allow_any_local=True), None])
def test_a_folder_is_not_a_file(tmp_path, policy):
    policy = policy or MediaPolicy(allowed_local_dir=tmp_path)
    with pytest.raises(InputError, match="is a folder, not a file") as error:
        read_media_bytes(str(tmp_path), policy)
    assert "does not exist" not in str(error.value)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_named_pipe_is_refused_without_waiting_for_a_writer(tmp_path):
    os.mkfifo(tmp_path / "pipe.png")
    with pytest.raises(InputError, match="is not a regular file"):
        read_media_bytes(str(tmp_path / "pipe.png"), MediaPolicy(allowed_local_dir=tmp_path))


def test_the_byte_limit_of_files_is_inclusive(tmp_path):
    path = tmp_path / "big.png"
    path.write_bytes(b"x" * 100)
    assert read_media_bytes(str(path), MediaPolicy(allow_any_local=True, max_bytes=100)) == b"x" * 100
    with pytest.raises(InputTooLargeError, match="over the size limit of 99 bytes"):
        read_media_bytes(str(path), MediaPolicy(allow_any_local=True, max_bytes=99))


def test_a_file_that_is_not_an_image_is_refused(tmp_path):
    path = tmp_path / "notes.png"
    path.write_text("hello")
    with pytest.raises(InputError, match="could not be decoded"):
        load_image_url(str(path), allow_any_local=True)


def test_a_file_outside_the_allowed_folder_is_refused(tmp_path, image_file):
    with pytest.raises(InputError, match="not inside the allowed media folder"):
        load_image_url(str(image_file), allowed_local_dir=tmp_path / "elsewhere")


def test_without_an_allowed_folder_no_file_is_read(image_file):
    with pytest.raises(InputError, match="Local image files are not read here"):
        load_image_url(str(image_file))
    with pytest.raises(InputError, match="Local image files are not read here"):
        load_image_url(image_file.as_uri())


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


def test_a_file_url_inside_the_allowed_folder_loads(image_file, image):
    loaded = load_image_url(image_file.as_uri(), MediaPolicy(allowed_local_dir=str(image_file.parent)))
    assert np.array_equal(np.asarray(loaded), np.asarray(image))


def test_the_policy_checks_its_limits_and_normalizes_domains():
    assert MediaPolicy(allowed_domains=["Images.Example.COM."]).allowed_domains == ("images.example.com",)
    assert MediaPolicy(allowed_domains="example.com").allowed_domains == ("example.com",)
    for bad in [{"max_bytes": 0}, {"max_pixels": 0}, {"min_side": 0}, {"timeout": 0}, {"max_redirects": -1},
                {"max_aspect_ratio": 0.5}]:  # fmt: skip
        with pytest.raises(ValueError):
            MediaPolicy(**bad)
    assert hash(MediaPolicy()) == hash(MediaPolicy())  # frozen, usable as a key
