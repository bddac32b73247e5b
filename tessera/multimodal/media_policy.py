"""What may be loaded from a URL a caller sent, and the limits (the server's are stricter than the
offline API's). Read by media.py, media_fetch.py, image_decode.py and video.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union


def normalize_host(host: str) -> str:
    """A hostname as compared with the allowed domains: lower case, no trailing dot."""
    return host.strip().lower().rstrip(".")


IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "MPO")  # PIL's names; MPO is a multi-picture JPEG
VIDEO_FORMATS = ("MP4", "WEBM", "AVI")  # containers recognised from their header (video.py); MP4 includes
# QuickTime .mov, WEBM includes Matroska .mkv


@dataclass(frozen=True)
class MediaPolicy:
    """What may be loaded, and the limits. The default suits untrusted callers that send data URLs."""

    allowed_local_dir: Optional[Union[Path, str]] = None
    """Local files (paths, file:// URLs) are read only inside this folder (symlinks resolved)."""
    allow_any_local: bool = False
    """Any local file may be read (the offline API and the CLI, whose caller owns the files)."""
    fetch_urls: bool = False
    """http(s) URLs are fetched."""
    allowed_domains: Optional[tuple[str, ...]] = None
    """If set, only these hostnames are fetched (exact match, case-insensitive), on every redirect too."""
    allow_private_networks: bool = False
    """Fetch from loopback, private, link-local, multicast, reserved and unspecified addresses too."""
    max_bytes: int = 20 * 2**20
    """The most bytes of one image: fetched, read from a file, or decoded from base64."""
    timeout: float = 10.0
    """Seconds one fetch may take in all: DNS, connecting, TLS, every read and every redirect."""
    max_redirects: int = 3
    max_pixels: int = 64 * 2**20
    """The most width * height (checked from the header, before decoding)."""
    max_aspect_ratio: float = 200.0
    """The most max(width, height) / min(width, height) (checked before decoding)."""
    min_side: int = 4
    """The fewest pixels on each side. HF image processors guess the channel axis from the array's
    shape, so an image 1 or 3 pixels high is misread (an error, or silently wrong pixels)."""
    image_formats: Optional[tuple[str, ...]] = IMAGE_FORMATS
    """The PIL formats decoded (None: every format PIL reads)."""
    max_video_bytes: int = 100 * 2**20
    """The most bytes of one video: fetched, read from a file, or decoded from base64."""
    max_video_duration: float = 600.0
    """The most seconds one video may last (from its header, and again from its frames' timestamps)."""
    max_video_frames: int = 256
    """The most frames sampled from one video (the T of the [T, H, W, 3] array; `num_frames` asked
    for above it is refused rather than cut)."""
    max_video_decoded_frames: int = 36_000
    """The most frames in one video, all decoded to reach the sampled ones (10 minutes at 60 fps)."""
    max_video_frame_pixels: int = 3840 * 2160
    """The most width * height of a video frame (4K UHD), checked from the header before decoding.
    The aspect ratio and smallest side limits are the images' (max_aspect_ratio, min_side)."""
    video_formats: Optional[tuple[str, ...]] = VIDEO_FORMATS
    """The containers decoded, recognised from their first bytes and named to FFmpeg (None: every
    format FFmpeg probes, playlists that open other files and URLs included: only for trusted bytes)."""

    def __post_init__(self) -> None:
        if self.allowed_domains is not None:
            domains = (self.allowed_domains,) if isinstance(self.allowed_domains, str) else self.allowed_domains
            object.__setattr__(self, "allowed_domains", tuple(normalize_host(d) for d in domains))
        if self.image_formats is not None:
            object.__setattr__(self, "image_formats", tuple(f.upper() for f in self.image_formats))
        if self.video_formats is not None:
            object.__setattr__(self, "video_formats", tuple(f.upper() for f in self.video_formats))
        for name in (
            "max_bytes",
            "max_pixels",
            "min_side",
            "max_video_bytes",
            "max_video_frames",
            "max_video_decoded_frames",
            "max_video_frame_pixels",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"MediaPolicy.{name} must be at least 1.")
        if self.max_video_duration <= 0:
            raise ValueError("MediaPolicy.max_video_duration must be above 0.")
        if self.timeout <= 0 or self.max_redirects < 0 or self.max_aspect_ratio < 1:
            raise ValueError("MediaPolicy needs timeout > 0, max_redirects >= 0 and max_aspect_ratio >= 1.")
