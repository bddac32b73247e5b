"""Loading images and videos from what users send: data URLs, local files and http(s) URLs, under
a policy.

`read_media_bytes` (`read_video_data` for videos) is the IO part (it blocks on the network for
http(s) URLs, up to `MediaPolicy.timeout` in all), `decode_image` / `decode_video` the CPU part;
`load_image_url` and `load_video_url` are both. Besides video files, videos may come as vLLM's
`data:video/jpeg;base64,<frame>,<frame>,...` URLs: base64 JPEG frames joined by commas. The
fetch itself (addresses vetted, redirects re-checked, one total deadline) is in media_fetch.py, the
header checks and decoding in image_decode.py and video.py.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import os
import stat
import string
from pathlib import Path
from typing import Any, Optional, Union
from urllib.parse import unquote, urlsplit

from PIL import Image

from ..errors import InputError, InputTooLargeError
from .audio import decode_audio_native
from .image_decode import check_image, decode_image
from .media_fetch import fetch_url
from .media_policy import MediaPolicy
from .video import JpegFrames, VideoFrames, check_frame_count, decode_video

__all__ = [
    "AUDIO_MIME_TYPES",
    "IMAGE_MIME_TYPES",
    "JPEG_FRAMES_MIME_TYPE",
    "JpegFrames",
    "LOCAL_FILES",
    "VIDEO_MIME_TYPES",
    "MediaPolicy",
    "VideoFrames",
    "check_image",
    "check_media_io_kwargs",
    "decode_image",
    "decode_video",
    "is_http_url",
    "load_audio_url",
    "load_image_url",
    "load_video_url",
    "merge_media_io_kwargs",
    "read_media_bytes",
    "read_video_data",
]

IMAGE_MIME_TYPES = ("image/jpeg", "image/png", "image/webp", "image/gif", "image/bmp")
VIDEO_MIME_TYPES = ("video/mp4", "video/webm", "video/quicktime", "video/x-matroska", "video/x-msvideo")
AUDIO_MIME_TYPES = ("audio/wav", "audio/x-wav", "audio/wave", "audio/mpeg", "audio/mp3", "audio/flac", "audio/ogg",
                    "audio/opus", "audio/webm", "audio/mp4", "audio/m4a", "audio/x-m4a", "audio/aac")  # fmt: skip
MIME_TYPES = {"image": IMAGE_MIME_TYPES, "video": VIDEO_MIME_TYPES, "audio": AUDIO_MIME_TYPES}
JPEG_FRAMES_MIME_TYPE = "video/jpeg"  # vLLM's video as base64 JPEG frames joined by commas (data URLs only)
MAX_URL_CHARS = 8192  # for http(s) URLs and paths; data URLs are limited by max_bytes
ASCII_WHITESPACE = b" \t\n\r\x0b\x0c"
CONTROL_OR_SPACE = "".join(map(chr, range(33)))
SCHEME_CHARS = frozenset(string.ascii_letters + string.digits + "+-.")


# For callers who own the machine (the offline API, the CLI): any local file in any format PIL
# reads; no network. The size checks stay: they spare the HF processor images it cannot handle.
# Videos keep the header-recognised containers: FFmpeg probing any format would follow playlists
# (HLS, concat) inside a data URL to other files and URLs.
LOCAL_FILES = MediaPolicy(allow_any_local=True, image_formats=None)


def url_scheme(url: str) -> str:
    """The scheme of `url` in lower case, "" if none, read as urlsplit reads it (leading control
    characters and spaces skipped, tabs and newlines ignored) but without judging the rest."""
    head = url[:64].lstrip(CONTROL_OR_SPACE).replace("\t", "").replace("\r", "").replace("\n", "")
    scheme, colon, _ = head.partition(":")
    if not colon or scheme[:1] not in string.ascii_letters or not set(scheme) <= SCHEME_CHARS:
        return ""
    return scheme.lower()


def is_http_url(url: str) -> bool:
    """Whether `url` is fetched over the network (read_media_bytes then blocks up to the timeout)."""
    return url_scheme(url) in ("http", "https")


def too_large(max_bytes: int, kind: str = "image") -> InputTooLargeError:
    return InputTooLargeError(f"The {kind} is over the size limit of {max_bytes} bytes.")


def read_media_bytes(url: str, policy: MediaPolicy, kind: str = "image") -> bytes:
    """The bytes of the image (or, with kind="video", the video) at `url`: a `data:image/...;base64,`
    (`data:video/...`) URL, a `file://` URL or local path (under the policy's local-file rules), or
    an http(s) URL (if the policy fetches them).

    Every failure is an InputError (InputTooLargeError over max_bytes, max_video_bytes for videos)
    with a message fit for the client; fetch failures all share one message (the reason goes to
    media_fetch's log)."""
    if kind not in MIME_TYPES:
        raise ValueError(f"kind must be one of {sorted(MIME_TYPES)}, not {kind!r}")
    if kind in ("video", "audio"):  # the rest reads max_bytes; recordings are limited like videos
        policy = dataclasses.replace(policy, max_bytes=policy.max_video_bytes)
    if url[:5].lower() == "data:":
        return read_data_url(url, policy.max_bytes, kind)
    if is_http_url(url):
        if not policy.fetch_urls:
            raise InputError(f"http(s) {kind} URLs are not fetched here; send a data URL instead.")
        if len(url) > MAX_URL_CHARS:
            raise InputError(f"The {kind} URL is over {MAX_URL_CHARS} characters long.")
        return fetch_url(url, policy, kind)
    scheme = url_scheme(url)
    if scheme not in ("", "file") and len(scheme) > 1:  # (a one-letter scheme is a Windows drive)
        raise InputError(f"Unsupported {kind} URL scheme {scheme[:20]!r}; send a data URL, http(s) or a file.")
    return read_local_file(url, scheme == "file", policy, kind)


def read_data_url(url: str, max_bytes: int, kind: str = "image") -> bytes:
    """The bytes of a base64 data URL; line-wrapped base64 is fine, anything else not base64 is not."""
    header, _, payload = url.partition(",")
    params = [p.strip().lower() for p in header[5:].split(";")]
    mime_types = MIME_TYPES[kind]
    if params[0] not in mime_types:
        shown = repr(params[0][:40]) if params[0] else "none"
        accepted = (*mime_types, f"{JPEG_FRAMES_MIME_TYPE} (JPEG frames)") if kind == "video" else mime_types
        raise InputError(f"Unsupported media type {shown}; send one of {', '.join(accepted)}.")
    if "base64" not in params[1:]:
        raise InputError(f"{kind.capitalize()} data URLs must be base64-encoded (data:{mime_types[0]};base64,...).")
    # The size the payload decodes to, from its length (4 characters carry 3 bytes), before any copy.
    chars = len(payload) - sum(payload.count(c) for c in ASCII_WHITESPACE.decode())
    if chars // 4 * 3 - 2 > max_bytes:
        raise too_large(max_bytes, kind)
    try:
        compact = b"".join(payload.encode("ascii").split())  # bytes.split() splits on ASCII whitespace only
        data = base64.b64decode(compact, validate=True)
    except (UnicodeEncodeError, binascii.Error, ValueError) as e:
        raise InputError(f"The {kind} data URL is not valid base64.") from e
    if len(data) > max_bytes:
        raise too_large(max_bytes, kind)
    return data


def is_jpeg_frames_url(url: str) -> bool:
    """Whether `url` is a `data:video/jpeg...` URL (vLLM's video as JPEG frames)."""
    if url[:5].lower() != "data:":
        return False
    return url[5:].partition(",")[0].split(";")[0].strip().lower() == JPEG_FRAMES_MIME_TYPE


def read_video_data(url: str, policy: MediaPolicy) -> Union[bytes, JpegFrames]:
    """What decode_video takes for the video at `url`: the file's bytes (read_media_bytes with
    kind="video"), or for a `data:video/jpeg;base64,<frame>,<frame>,...` URL (vLLM's
    VideoMediaIO.load_base64 splits it on "," and decodes each part as a base64 JPEG) its frames'
    bytes, at most max_video_bytes in all and max_video_decoded_frames frames."""
    if not is_jpeg_frames_url(url):
        return read_media_bytes(url, policy, "video")
    header, _, payload = url.partition(",")
    max_bytes = policy.max_video_bytes
    if "base64" not in [p.strip().lower() for p in header[5:].split(";")[1:]]:
        raise InputError(f"Video data URLs must be base64-encoded (data:{JPEG_FRAMES_MIME_TYPE};base64,...).")
    count = payload.count(",") + 1
    check_frame_count(count, policy)  # before decoding any
    chars = len(payload) - sum(payload.count(c) for c in ASCII_WHITESPACE.decode()) - (count - 1)
    if chars // 4 * 3 - 2 * count > max_bytes:  # (up to 2 bytes of padding a frame)
        raise too_large(max_bytes, "video")
    frames = []
    for index, part in enumerate(payload.split(",")):
        try:
            compact = b"".join(part.encode("ascii").split())
            frame = base64.b64decode(compact, validate=True)
        except (UnicodeEncodeError, binascii.Error, ValueError) as e:
            raise InputError(f"Frame {index} of the video data URL is not valid base64.") from e
        if not frame:
            raise InputError(f"Frame {index} of the video data URL is empty.")
        frames.append(frame)
    if sum(map(len, frames)) > max_bytes:
        raise too_large(max_bytes, "video")
    return JpegFrames(frames)


def read_local_file(url: str, is_file_url: bool, policy: MediaPolicy, kind: str = "image") -> bytes:
    """The bytes of a local file: a regular file, inside the allowed folder unless any is allowed.

    Messages never show the resolved path; with allow_any_local (the caller owns the files) they
    repeat the path as given."""
    if not policy.allow_any_local and policy.allowed_local_dir is None:
        raise InputError(f"Local {kind} files are not read here; send a data URL instead.")
    try:
        given = unquote(urlsplit(url).path) if is_file_url else url
    except ValueError as e:
        raise InputError(f"The {kind} file URL is not valid.") from e
    named = f"{kind.capitalize()} file {given[:300]}" if policy.allow_any_local else f"The {kind} file"
    if len(given) > MAX_URL_CHARS:
        raise InputError(f"The {kind} file path is too long.")
    try:
        path = Path(given).expanduser().resolve()
    except (OSError, ValueError, RuntimeError) as e:
        raise InputError(f"{named} is not a valid path.") from e
    if not policy.allow_any_local and not path.is_relative_to(Path(policy.allowed_local_dir).resolve()):
        raise InputError("The local file is not inside the allowed media folder.")
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)  # O_NONBLOCK: a FIFO must not hang us; O_NOFOLLOW: resolved above
    except FileNotFoundError as e:
        raise InputError(f"{named} does not exist.") from e
    except IsADirectoryError as e:
        raise InputError(f"{named} is a folder, not a file.") from e
    except (OSError, ValueError) as e:
        raise InputError(f"{named} could not be read.") from e
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise InputError(f"{named} is a folder, not a file.")
        if not stat.S_ISREG(info.st_mode):
            raise InputError(f"{named} is not a regular file.")
        if info.st_size > policy.max_bytes:
            raise too_large(policy.max_bytes, kind)
        with os.fdopen(fd, "rb", closefd=False) as file:
            data = file.read(policy.max_bytes + 1)
    except OSError as e:
        raise InputError(f"{named} could not be read.") from e
    finally:
        os.close(fd)
    if len(data) > policy.max_bytes:  # it grew since fstat
        raise too_large(policy.max_bytes, kind)
    return data


LEGACY_NAMES = {"fetch_http": "fetch_urls"}


def load_image_url(url: str, policy: Optional[MediaPolicy] = None, **overrides: Any) -> Image.Image:
    """The RGB image at `url` (see read_media_bytes), checked and decoded under `policy`.

    Keyword overrides replace policy fields: `load_image_url(url, allow_any_local=True)`
    (`fetch_http=` is the old name of `fetch_urls=`)."""
    policy = policy or MediaPolicy()
    if overrides:
        policy = dataclasses.replace(policy, **{LEGACY_NAMES.get(k, k): v for k, v in overrides.items()})
    return decode_image(read_media_bytes(url, policy), policy)


def load_video_url(
    url: str,
    policy: Optional[MediaPolicy] = None,
    *,
    num_frames: Optional[int] = None,
    fps: Optional[float] = None,
    with_audio: bool = False,
    **overrides: Any,
) -> VideoFrames:
    """The frames sampled from the video at `url` (see read_video_data; `data:video/mp4;base64,...`,
    vLLM's `data:video/jpeg;base64,<frame>,<frame>,...`, a file or an http(s) URL under the same
    policy rules as images), checked and decoded under `policy` (see video.decode_video for
    `num_frames` and `fps`). Keyword overrides replace policy fields, as in load_image_url."""
    policy = policy or MediaPolicy()
    if overrides:
        policy = dataclasses.replace(policy, **{LEGACY_NAMES.get(k, k): v for k, v in overrides.items()})
    return decode_video(read_video_data(url, policy), policy, num_frames=num_frames, fps=fps, with_audio=with_audio)


def load_audio_url(url: str, policy: Optional[MediaPolicy] = None, **overrides: Any) -> tuple[Any, int]:
    """(mono float32 waveform, its sampling rate) of the recording at `url` (a `data:audio/...;base64,` URL, a
    file or an http(s) URL under the same policy rules as images; its bytes limited like a video's); the
    model's processing resamples it (multimodal/audio.py)."""
    policy = policy or MediaPolicy()
    if overrides:
        policy = dataclasses.replace(policy, **{LEGACY_NAMES.get(k, k): v for k, v in overrides.items()})
    return decode_audio_native(read_media_bytes(url, policy, kind="audio"))


# video "with_audio": its sound track too (set for requests with Qwen2.5-Omni's use_audio_in_video)
MEDIA_IO_OPTIONS = {"image": frozenset(), "video": frozenset({"num_frames", "fps", "with_audio"})}


def check_media_io_kwargs(kwargs: Any) -> dict[str, dict[str, Any]]:
    """vLLM's `media_io_kwargs` checked: {"video": {"num_frames": N, "fps": F}} (the options of
    load_video_url; "image" takes none yet). Unknown modalities or options are an InputError;
    the values are checked when a video is decoded (video.check_sampling)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        example = "{'video': {'num_frames': 16}}"
        raise InputError(f"media_io_kwargs must be an object like {example}, not {kwargs!r:.60}.")
    checked = {}
    for modality, options in kwargs.items():
        if modality not in MEDIA_IO_OPTIONS:
            raise InputError(f"media_io_kwargs: unknown modality {modality!r:.40}; use 'image' or 'video'.")
        if options is None:
            continue
        if not isinstance(options, dict):
            raise InputError(f"media_io_kwargs[{modality!r}] must be an object, not {options!r:.60}.")
        unknown = sorted(str(k)[:40] for k in options if k not in MEDIA_IO_OPTIONS[modality])
        if unknown:
            allowed = ", ".join(sorted(MEDIA_IO_OPTIONS[modality])) or "none"
            raise InputError(f"media_io_kwargs[{modality!r}]: unsupported option(s) {unknown}; supported: {allowed}.")
        checked[modality] = dict(options)
    return checked


def merge_media_io_kwargs(*layers: Any) -> dict[str, dict[str, Any]]:
    """Media IO kwargs checked and merged per modality, later layers over earlier ones (e.g. a
    request's over the server's)."""
    merged: dict[str, dict[str, Any]] = {}
    for layer in layers:
        for modality, options in check_media_io_kwargs(layer).items():
            merged[modality] = {**merged.get(modality, {}), **options}
    return merged
