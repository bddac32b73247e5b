"""What may be loaded from a URL a caller sent, and the limits (the server's are stricter than the
offline API's). Read by media.py, media_fetch.py and image_decode.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union


def normalize_host(host: str) -> str:
    """A hostname as compared with the allowed domains: lower case, no trailing dot."""
    return host.strip().lower().rstrip(".")


IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "MPO")  # PIL's names; MPO is a multi-picture JPEG


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

    def __post_init__(self) -> None:
        if self.allowed_domains is not None:
            domains = (self.allowed_domains,) if isinstance(self.allowed_domains, str) else self.allowed_domains
            object.__setattr__(self, "allowed_domains", tuple(normalize_host(d) for d in domains))
        if self.image_formats is not None:
            object.__setattr__(self, "image_formats", tuple(f.upper() for f in self.image_formats))
        for name in ("max_bytes", "max_pixels", "min_side"):
            if getattr(self, name) < 1:
                raise ValueError(f"MediaPolicy.{name} must be at least 1.")
        if self.timeout <= 0 or self.max_redirects < 0 or self.max_aspect_ratio < 1:
            raise ValueError("MediaPolicy needs timeout > 0, max_redirects >= 0 and max_aspect_ratio >= 1.")
