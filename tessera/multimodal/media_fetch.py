"""Fetching an image from an http(s) URL a client sent, guarded against server-side request forgery.

- Only http and https, on the first URL and on every redirect (at most `max_redirects`).
- The host must be one of `allowed_domains` (when set), on every redirect too.
- The host is resolved once; every address it resolves to must be public (unless
  `allow_private_networks`), and the connection goes to those vetted addresses, so there is no
  second lookup to rebind. https still verifies the certificate against the hostname (SNI).
  Odd spellings of addresses (127.1, 2130706433, 0x7f000001, ::ffff:127.0.0.1) need no parsing
  here: the resolver turns them into the addresses that are checked.
- One deadline (`timeout`) for all of it: DNS, connecting, TLS, headers, body and redirects. Each
  socket operation waits only for what is left of it, so a server that trickles a byte at a time
  fails at the deadline, not at a per-read timeout.
- At most `max_bytes`: a larger Content-Length is refused at once, and reading stops as soon as
  more than that has arrived.

Every network failure (refused address, DNS, connection, TLS, timeout, HTTP status, bad redirect)
raises the same InputError, so a client cannot map the server's network; the reason is logged.
"""

from __future__ import annotations

import concurrent.futures
import functools
import http.client
import ipaddress
import logging
import math
import socket
import ssl
import time
from typing import Optional, Union
from urllib.parse import quote, urljoin, urlsplit

from ..errors import InputError, InputTooLargeError
from .media_policy import MediaPolicy, normalize_host

logger = logging.getLogger(__name__)

FETCH_FAILED = "The image URL could not be fetched."
DOMAIN_NOT_ALLOWED = "The image URL's host is not one of the allowed media domains."
REDIRECT_STATUSES = (301, 302, 303, 307, 308)
CHUNK_BYTES = 64 * 1024
DNS_WORKERS = 8  # lookups that hang past their deadline hold a worker until the resolver gives up
NAT64 = ipaddress.ip_network("64:ff9b::/96")
IPAddress = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]
Address = tuple[int, int, int, tuple]  # (family, type, proto, sockaddr) from getaddrinfo


class FetchFailed(Exception):
    """Why a fetch failed: for the server log, never for the client."""


def is_public_address(ip: IPAddress) -> bool:
    """Whether `ip` is a global unicast address: not loopback, private, link-local, multicast,
    reserved or unspecified, also for the IPv4 address inside an IPv6 one (::ffff:a.b.c.d,
    64:ff9b::a.b.c.d, 6to4, Teredo)."""
    if ip.version == 6:
        if ip.ipv4_mapped is not None:
            return is_public_address(ip.ipv4_mapped)
        if ip in NAT64:
            return is_public_address(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        embedded = [a for a in (ip.sixtofour, *(ip.teredo or ())) if a is not None]
        if not all(is_public_address(a) for a in embedded):
            return False
    special = (ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast or ip.is_reserved
               or ip.is_unspecified or getattr(ip, "is_site_local", False))  # fmt: skip
    return ip.is_global and not special


def fetch_url(url: str, policy: MediaPolicy, kind: str = "image") -> bytes:
    """The body at an http(s) `url` under `policy` (see the module docstring), at most
    policy.max_bytes. Raises InputError: FETCH_FAILED for every network failure, DOMAIN_NOT_ALLOWED,
    or InputTooLargeError (with "video" for "image" in the messages when kind="video")."""
    deadline = time.monotonic() + policy.timeout
    try:
        for _ in range(policy.max_redirects + 1):
            result = fetch_once(url, policy, deadline, kind)
            if isinstance(result, bytes):
                return result
            url = result
        raise FetchFailed(f"more than {policy.max_redirects} redirects")
    except InputError as e:
        logger.warning("%s fetch from %s refused: %s", kind.capitalize(), for_log(url), e)
        raise
    except (FetchFailed, OSError, http.client.HTTPException, ValueError) as e:
        logger.warning("%s fetch from %s failed: %s: %s", kind.capitalize(), for_log(url), type(e).__name__, e)
        raise InputError(FETCH_FAILED.replace("image", kind)) from None


def fetch_once(url: str, policy: MediaPolicy, deadline: float, kind: str = "image") -> Union[bytes, str]:
    """The body at `url`, or the URL it redirects to."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise FetchFailed(f"scheme {scheme!r} is not http(s)")
    if not parts.hostname:
        raise FetchFailed("no host")
    host = parts.hostname if parts.hostname.isascii() else parts.hostname.encode("idna").decode("ascii")
    port = parts.port or (443 if scheme == "https" else 80)
    if policy.allowed_domains is not None and normalize_host(host) not in policy.allowed_domains:
        raise InputError(DOMAIN_NOT_ALLOWED.replace("image", kind))
    addresses = vetted_addresses(host, port, policy.allow_private_networks, deadline)
    connection = (PinnedHTTPSConnection if scheme == "https" else PinnedHTTPConnection)(host, port, addresses, deadline)
    target = quote(parts.path or "/", safe="/%!$&'()*+,;=:@~") + (f"?{quote(parts.query, safe='/%!$&()*+,;=:@~?')}"
                                                                  if parts.query else "")  # fmt: skip
    headers = {"User-Agent": "tessera", "Accept": f"{kind}/*", "Accept-Encoding": "identity", "Connection": "close"}
    try:
        connection.request("GET", target, headers=headers)
        response = connection.getresponse()
        if response.status in REDIRECT_STATUSES:
            location = response.getheader("Location")
            if not location:
                raise FetchFailed(f"HTTP {response.status} without a Location")
            return urljoin(url, location.strip())
        if not 200 <= response.status < 300:
            raise FetchFailed(f"HTTP {response.status}")
        if response.length is not None and response.length > policy.max_bytes:
            raise InputTooLargeError(f"The {kind} is over the size limit of {policy.max_bytes} bytes.")
        return read_body(response, policy.max_bytes, kind)
    finally:
        connection.close()


def read_body(response: http.client.HTTPResponse, max_bytes: int, kind: str = "image") -> bytes:
    chunks, total = [], 0
    while True:
        chunk = response.read(min(CHUNK_BYTES, max_bytes + 1 - total))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        total += len(chunk)
        if total > max_bytes:
            raise InputTooLargeError(f"The {kind} is over the size limit of {max_bytes} bytes.")


def remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the fetch deadline passed")
    return left


@functools.lru_cache(maxsize=1)
def dns_pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(DNS_WORKERS, thread_name_prefix="tessera-dns")


def vetted_addresses(host: str, port: int, allow_private: bool, deadline: float) -> list[Address]:
    """The addresses `host` resolves to (one lookup, within the deadline), all of them public
    unless `allow_private`."""
    lookup = dns_pool().submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    try:
        infos = lookup.result(timeout=remaining(deadline))
    except concurrent.futures.TimeoutError:
        lookup.cancel()
        raise FetchFailed(f"looking up {host} took past the deadline") from None
    addresses = []
    for family, type_, proto, _, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        ip = ipaddress.ip_address(sockaddr[0])
        if not allow_private and not is_public_address(ip):
            raise FetchFailed(f"{host} resolves to {ip}, which is not a public address")
        if (family, type_, proto, sockaddr) not in addresses:
            addresses.append((family, type_, proto, sockaddr))
    if not addresses:
        raise FetchFailed(f"{host} resolves to no IP address")
    return addresses


class DeadlineMixin:
    """A socket whose every send and receive waits only until `deadline` (time.monotonic())."""

    deadline = math.inf

    def _arm(self) -> None:
        if self.deadline != math.inf:
            self.settimeout(remaining(self.deadline))  # type: ignore[attr-defined]

    def recv(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._arm()
        return super().recv(*args, **kwargs)  # type: ignore[misc]

    def recv_into(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._arm()
        return super().recv_into(*args, **kwargs)  # type: ignore[misc]

    def send(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._arm()
        return super().send(*args, **kwargs)  # type: ignore[misc]

    def sendall(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._arm()
        return super().sendall(*args, **kwargs)  # type: ignore[misc]


class DeadlineSocket(DeadlineMixin, socket.socket):
    pass


class DeadlineSSLSocket(DeadlineMixin, ssl.SSLSocket):
    pass


def connect(addresses: list[Address], deadline: float) -> DeadlineSocket:
    """A socket connected to the first of the vetted `addresses` that answers."""
    error: Optional[OSError] = None
    for family, type_, proto, sockaddr in addresses:
        sock = DeadlineSocket(family, type_, proto)
        sock.deadline = deadline
        try:
            sock.settimeout(remaining(deadline))
            sock.connect(sockaddr)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError as e:
            sock.close()
            error = e
    assert error is not None
    raise error


def make_tls_context(cafile: Optional[str] = None) -> ssl.SSLContext:
    """Certificates verified against the system's CAs (or `cafile`'s), hostnames checked."""
    context = ssl.create_default_context(cafile=cafile)
    context.sslsocket_class = DeadlineSSLSocket
    return context


@functools.lru_cache(maxsize=1)
def tls_context() -> ssl.SSLContext:
    return make_tls_context()


class PinnedHTTPConnection(http.client.HTTPConnection):
    """An HTTP connection to vetted addresses, never resolving the host itself."""

    def __init__(self, host: str, port: int, addresses: list[Address], deadline: float) -> None:
        super().__init__(host, port)
        self.addresses, self.deadline = addresses, deadline

    def connect(self) -> None:
        self.sock = connect(self.addresses, self.deadline)


class PinnedHTTPSConnection(PinnedHTTPConnection):
    """The same over TLS, the certificate checked against the URL's hostname."""

    default_port = 443

    def connect(self) -> None:
        sock = connect(self.addresses, self.deadline)
        try:
            sock.settimeout(remaining(self.deadline))  # the handshake's limit
            tls = tls_context().wrap_socket(sock, server_hostname=self.host)
        except BaseException:
            sock.close()
            raise
        tls.deadline = self.deadline
        self.sock = tls


def for_log(url: str) -> str:
    """`url` without credentials or query, shortened, for the log."""
    try:
        parts = urlsplit(url)
        return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"[:200]
    except ValueError:
        return repr(url[:100])
