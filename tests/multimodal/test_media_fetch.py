"""Fetching images over http(s) from untrusted URLs: addresses vetted, redirects re-checked, one
total deadline, a byte cap, and one message for every network failure."""

from __future__ import annotations

import http.server
import io
import ipaddress
import logging
import shutil
import socket
import ssl
import subprocess
import threading
import time
from urllib.parse import parse_qs, quote, urlsplit

import numpy as np
import pytest

from tessera.errors import InputError, InputTooLargeError
from tessera.multimodal import media_fetch
from tessera.multimodal.media import MediaPolicy, load_image_url, read_media_bytes
from tessera.multimodal.media_fetch import DOMAIN_NOT_ALLOWED, FETCH_FAILED, fetch_url, is_public_address
from testkit import random_images


def png_bytes(image):
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


IMAGE = random_images([(12, 8)], seed=1)[0]
PNG = png_bytes(IMAGE)
LOCAL = MediaPolicy(fetch_urls=True, allow_private_networks=True)  # the test servers are on loopback
LOG = "tessera.multimodal.media_fetch"


class Handler(http.server.BaseHTTPRequestHandler):
    """Routes: /image.png, /status/<code>, /redirect?to=<url>, /chain/<n> (n redirects, then the
    image), /loop, /no-location, /trickle-body, /trickle-headers, /body?n=<bytes>&length=<0|1>,
    /declared?length=<n>, /endless."""

    def log_message(self, *args):
        pass

    def send_body(self, body, length=True, content_type="image/png"):
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        if length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def redirect(self, location, status=302):
        self.send_response(status)
        if location is not None:
            self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def trickle(self, data):
        """`data` a byte at a time, five bytes a second, until the client hangs up (at most 4 s, so
        that a fetch without a total deadline fails the test rather than hanging it)."""
        data = data[:20]
        stop = self.server.stopping
        try:
            for byte in data:
                if stop.wait(0.2):
                    return
                self.wfile.write(bytes([byte]))
        except OSError:
            pass

    def do_GET(self):
        self.server.requests.append({"path": self.path, "host": self.headers.get("Host"),
                                     "agent": self.headers.get("User-Agent")})  # fmt: skip
        parts = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        route, _, arg = parts.path.strip("/").partition("/")
        if route == "image.png":
            self.send_body(PNG)
        elif route == "status":
            self.send_response(int(arg))
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif route == "redirect":
            self.redirect(query["to"], int(query.get("status", 302)))
        elif route == "chain":
            self.redirect(f"/chain/{int(arg) - 1}" if int(arg) > 1 else "/image.png")
        elif route == "loop":
            self.redirect("/loop")
        elif route == "no-location":
            self.redirect(None)
        elif route == "trickle-body":
            self.send_response(200)
            self.send_header("Content-Length", "100000")
            self.end_headers()
            self.wfile.flush()
            self.trickle(b"x" * 100000)
        elif route == "trickle-headers":
            self.trickle(b"HTTP/1.0 200 OK\r\nContent-Length: 3\r\n" + b"X-Slow: y\r\n" * 10000)
        elif route == "body":
            self.send_body(b"x" * int(query["n"]), length=query.get("length") == "1")
        elif route == "declared":
            self.send_response(200)
            self.send_header("Content-Length", query["length"])
            self.end_headers()
        elif route == "endless":
            self.send_response(200)
            self.end_headers()
            try:
                while not self.server.stopping.is_set():
                    self.wfile.write(b"x" * 65536)
            except OSError:
                pass


class Server:
    def __init__(self, tls_context=None):
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads, self.httpd.block_on_close = True, False
        self.httpd.handle_error = lambda *args: None  # clients hang up on purpose here
        self.httpd.requests, self.httpd.stopping = [], threading.Event()
        if tls_context is not None:
            self.httpd.socket = tls_context.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.scheme = "https" if tls_context else "http"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    @property
    def requests(self):
        return self.httpd.requests

    def url(self, path="/image.png", host="127.0.0.1"):
        return f"{self.scheme}://{host}:{self.port}{path}"

    def stop(self):
        self.httpd.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    server = Server()
    yield server
    server.stop()


@pytest.fixture
def connects(monkeypatch):
    """The addresses the fetcher connected to."""
    seen = []
    real = media_fetch.connect

    def spy(addresses, deadline):
        seen.append([a[3][0] for a in addresses])
        return real(addresses, deadline)

    monkeypatch.setattr(media_fetch, "connect", spy)
    return seen


def failure(url, policy=LOCAL):
    with pytest.raises(InputError) as error:
        read_media_bytes(url, policy)  # which hands http(s) URLs to fetch_url
    return error.value


def reasons(caplog):
    return " | ".join(r.getMessage() for r in caplog.records if r.name == LOG and r.levelno == logging.WARNING)


# ---- fetching ------------------------------------------------------------------------------------------


def test_an_image_is_fetched(server):
    assert fetch_url(server.url(), LOCAL) == PNG
    assert server.requests == [{"path": "/image.png", "host": f"127.0.0.1:{server.port}", "agent": "tessera"}]
    assert np.array_equal(np.asarray(load_image_url(server.url(), LOCAL)), np.asarray(IMAGE))


REDIRECTS = ["/redirect?to=/image.png", "/chain/3"]
REDIRECTS += [f"/redirect?to=/image.png&status={status}" for status in (301, 303, 307, 308)]


@pytest.mark.parametrize("path", REDIRECTS)
def test_redirects_are_followed(server, path):
    assert fetch_url(server.url(path), LOCAL) == PNG


def test_an_absolute_redirect_is_followed(server):
    assert fetch_url(server.url("/redirect?to=" + quote(server.url(), safe="")), LOCAL) == PNG
    assert [r["path"] for r in server.requests] == [server.requests[0]["path"], "/image.png"]


def test_the_redirect_limit_is_inclusive(server):
    assert fetch_url(server.url("/chain/2"), MediaPolicy(fetch_urls=True, allow_private_networks=True,
                                                          max_redirects=2)) == PNG  # fmt: skip
    assert str(failure(server.url("/chain/3"), MediaPolicy(fetch_urls=True, allow_private_networks=True,
                                                            max_redirects=2))) == FETCH_FAILED  # fmt: skip
    assert len(server.requests) == 3 + 3  # the second fetch stopped at its third redirect


# ---- every network failure looks the same --------------------------------------------------------------


@pytest.fixture
def closed_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens there once it is closed


@pytest.fixture
def not_http():
    """A TCP server that answers with something other than HTTP."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")

    threading.Thread(target=serve, daemon=True).start()
    yield listener.getsockname()[1]
    listener.close()


@pytest.mark.parametrize("path, reason", [
    ("/status/404", "HTTP 404"), ("/status/500", "HTTP 500"), ("/status/204", None), ("/loop", "redirects"),
    ("/chain/4", "more than 3 redirects"), ("/redirect?to=file:///etc/passwd", "'file'"),
    ("/redirect?to=ftp://127.0.0.1/a.png", "'ftp'"), ("/redirect?to=gopher://127.0.0.1:70/", "'gopher'"),
    ("/no-location", "without a Location"),
])  # fmt: skip
def test_http_failures_share_one_message(server, caplog, path, reason):
    if path == "/status/204":  # an empty body fetches fine and fails to decode
        assert fetch_url(server.url(path), LOCAL) == b""
        return
    error = failure(server.url(path))
    assert type(error) is InputError and str(error) == FETCH_FAILED
    assert reason in reasons(caplog)  # the real reason is in the server's log


def test_a_closed_port_and_an_open_one_look_the_same(server, closed_port, not_http, caplog):
    messages = {str(failure(url)) for url in [server.url("/status/404"), f"http://127.0.0.1:{closed_port}/a.png",
                                               f"http://127.0.0.1:{not_http}/a.png",
                                               f"https://127.0.0.1:{server.port}/image.png",  # TLS to plain HTTP
                                               "http://no-such-host.invalid/a.png"]}  # fmt: skip
    assert messages == {FETCH_FAILED}
    logged = reasons(caplog)
    assert "HTTP 404" in logged and "ConnectionRefusedError" in logged and "BadStatusLine" in logged
    assert "SSLError" in logged and "gaierror" in logged


def test_private_addresses_are_refused_by_default(server, connects, caplog):
    spellings = ["127.0.0.1", "localhost", "[::1]", "127.1", "2130706433", "[::ffff:127.0.0.1]", "0x7f000001",
                 "0x7f.1", "0177.0.0.1", "LocalHost"]  # fmt: skip
    for host in spellings:
        error = failure(server.url(host=host), MediaPolicy(fetch_urls=True))
        assert str(error) == FETCH_FAILED, host
    for url in ["http://169.254.169.254/latest/meta-data/", "http://10.0.0.1/", "http://192.168.1.1:8080/",
                "http://[fe80::1]/", "http://0.0.0.0/", "http://100.64.0.1/", "http://224.0.0.1/"]:  # fmt: skip
        assert str(failure(url, MediaPolicy(fetch_urls=True))) == FETCH_FAILED, url
    assert server.requests == [] and connects == []
    assert reasons(caplog).count("which is not a public address") == len(spellings) + 7


@pytest.mark.parametrize("address", [
    "127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "0.0.0.0", "100.64.0.1",
    "224.0.0.1", "239.255.255.250", "240.0.0.1", "255.255.255.255", "192.0.2.1", "198.18.0.1",
    "::1", "::", "fe80::1", "fc00::1", "fd12:3456::1", "ff02::1", "fec0::1", "::ffff:127.0.0.1", "::ffff:10.0.0.1",
    "64:ff9b::a00:1", "64:ff9b::7f00:1", "2002:7f00:1::1", "2002:a00:1::1", "2001:db8::1",
])  # fmt: skip
def test_special_addresses_are_not_public(address):
    assert not is_public_address(ipaddress.ip_address(address))


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "93.184.215.14", "2606:4700:4700::1111",
                                     "2001:4860:4860::8888", "::ffff:8.8.8.8", "64:ff9b::808:808"])  # fmt: skip
def test_global_addresses_are_public(address):
    assert is_public_address(ipaddress.ip_address(address))


def fake_dns(monkeypatch, answers):
    """getaddrinfo answering `answers[host]` (a list of lists of IPs, one per lookup) for those hosts."""
    real, lookups = socket.getaddrinfo, []

    def getaddrinfo(host, port, *args, **kwargs):
        if host not in answers:
            return real(host, port, *args, **kwargs)
        lookups.append(host)
        ips = answers[host][min(len(lookups), len(answers[host])) - 1]
        return [(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "",
                 (ip, port)) for ip in ips]  # fmt: skip

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return lookups


def test_a_public_name_resolving_to_a_private_address_is_refused(server, monkeypatch, connects, caplog):
    fake_dns(monkeypatch, {"images.example.com": [["127.0.0.1"]], "mixed.example.com": [["8.8.8.8", "127.0.0.1"]]})
    for host in ["images.example.com", "mixed.example.com"]:
        assert str(failure(server.url(host=host), MediaPolicy(fetch_urls=True))) == FETCH_FAILED
    assert server.requests == [] and connects == []
    assert "mixed.example.com resolves to 127.0.0.1" in reasons(caplog)


@pytest.fixture
def only_127_0_0_1_is_public(monkeypatch):
    monkeypatch.setattr(media_fetch, "is_public_address", lambda ip: str(ip) == "127.0.0.1")


def test_the_connection_goes_to_the_vetted_address(server, monkeypatch, connects, only_127_0_0_1_is_public):
    """One lookup per hop: a second answer (DNS rebinding) is never asked for."""
    lookups = fake_dns(monkeypatch, {"rebind.example.com": [["127.0.0.1"], ["10.0.0.1"]]})
    assert fetch_url(server.url(host="rebind.example.com"), MediaPolicy(fetch_urls=True)) == PNG
    assert lookups == ["rebind.example.com"] and connects == [["127.0.0.1"]]
    assert server.requests[0]["host"] == f"rebind.example.com:{server.port}"


def test_every_redirect_is_vetted_again(server, connects, only_127_0_0_1_is_public, caplog):
    policy = MediaPolicy(fetch_urls=True)
    assert fetch_url(server.url(), policy) == PNG  # 127.0.0.1 counts as public here
    to_private = server.url("/redirect?to=" + quote(f"http://127.0.0.2:{server.port}/image.png", safe=""))
    assert str(failure(to_private, policy)) == FETCH_FAILED
    assert len(server.requests) == 2 and connects == [["127.0.0.1"], ["127.0.0.1"]]
    assert "resolves to 127.0.0.2, which is not a public address" in reasons(caplog)


# ---- allowed domains -----------------------------------------------------------------------------------


def test_only_allowed_domains_are_fetched(server, connects):
    policy = MediaPolicy(fetch_urls=True, allow_private_networks=True, allowed_domains=("LocalHost",))
    assert fetch_url(server.url(host="localhost"), policy) == PNG
    assert fetch_url(server.url(host="LOCALHOST"), policy) == PNG
    for url in [server.url(host="127.0.0.1"), "http://images.localhost/a.png", "http://localhost.evil.com/a.png"]:
        error = failure(url, policy)
        assert str(error) == DOMAIN_NOT_ALLOWED and type(error) is InputError
    assert len(server.requests) == 2 and len(connects) == 2


def test_a_redirect_out_of_the_allowed_domains_is_refused(server):
    policy = MediaPolicy(fetch_urls=True, allow_private_networks=True, allowed_domains=("localhost",))
    url = server.url("/redirect?to=" + quote(server.url(host="127.0.0.1"), safe=""), host="localhost")
    assert str(failure(url, policy)) == DOMAIN_NOT_ALLOWED
    assert len(server.requests) == 1


def test_subdomains_are_not_allowed_domains():
    policy = MediaPolicy(fetch_urls=True, allowed_domains=("example.com",))
    assert str(failure("http://images.example.com/a.png", policy)) == DOMAIN_NOT_ALLOWED  # before any lookup


# ---- one deadline --------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/trickle-body", "/trickle-headers"])
def test_a_trickling_server_fails_at_the_total_deadline(server, path):
    """A byte every 0.2 s never trips a per-read timeout of 1 s; only a total deadline stops it."""
    policy = MediaPolicy(fetch_urls=True, allow_private_networks=True, timeout=1.0)
    start = time.monotonic()
    assert str(failure(server.url(path), policy)) == FETCH_FAILED
    assert 0.9 < time.monotonic() - start < 2.5


def test_a_slow_lookup_counts_against_the_deadline(server, monkeypatch):
    release = threading.Event()
    real = socket.getaddrinfo

    def slow(host, *args, **kwargs):
        if host == "slow.example.com":
            release.wait(5)
        return real("127.0.0.1", *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", slow)
    start = time.monotonic()
    try:
        policy = MediaPolicy(fetch_urls=True, allow_private_networks=True, timeout=0.5)
        assert str(failure(server.url(host="slow.example.com"), policy)) == FETCH_FAILED
        assert time.monotonic() - start < 2.0
    finally:
        release.set()


# ---- byte cap ------------------------------------------------------------------------------------------

CAPPED = MediaPolicy(fetch_urls=True, allow_private_networks=True, max_bytes=1000, timeout=5.0)


@pytest.mark.parametrize("length", ["1", "0"])
def test_a_body_at_the_cap_is_fetched(server, length):
    assert fetch_url(server.url(f"/body?n=1000&length={length}"), CAPPED) == b"x" * 1000


@pytest.mark.parametrize("path", ["/body?n=1001&length=1", "/body?n=1001&length=0", "/declared?length=1000000000",
                                  "/endless"])  # fmt: skip
def test_a_body_over_the_cap_is_413(server, path):
    with pytest.raises(InputTooLargeError, match="over the size limit of 1000 bytes"):
        fetch_url(server.url(path), CAPPED)


# ---- https ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate for the name localhost (and no IP address)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    folder = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", folder / "key.pem", "-out", folder / "cert.pem", "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost"], check=True, capture_output=True)  # fmt: skip
    return folder / "cert.pem", folder / "key.pem"


@pytest.fixture
def https_server(certificate):
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*certificate)
    server = Server(context)
    yield server
    server.stop()


@pytest.fixture
def trust_test_certificate(monkeypatch, certificate):
    monkeypatch.setattr(media_fetch, "tls_context", lambda: media_fetch.make_tls_context(cafile=str(certificate[0])))


def test_https_is_fetched_from_the_vetted_address_with_the_certificate_checked(https_server, trust_test_certificate,
                                                                               connects):  # fmt: skip
    assert fetch_url(https_server.url(host="localhost"), LOCAL) == PNG
    assert "127.0.0.1" in connects[0] and https_server.requests[0]["host"] == f"localhost:{https_server.port}"


def test_https_checks_the_certificate_against_the_url_host(https_server, trust_test_certificate, caplog):
    assert str(failure(https_server.url(host="127.0.0.1"))) == FETCH_FAILED  # the certificate names localhost
    assert "certificate is not valid for '127.0.0.1'" in reasons(caplog)
    assert https_server.requests == []


def test_https_refuses_an_untrusted_certificate(https_server, caplog):
    assert str(failure(https_server.url(host="localhost"))) == FETCH_FAILED
    assert "CERTIFICATE_VERIFY_FAILED" in reasons(caplog)


# ---- through read_media_bytes --------------------------------------------------------------------------


def test_read_media_bytes_fetches_only_when_the_policy_says_so(server):
    assert read_media_bytes(server.url(), LOCAL) == PNG
    with pytest.raises(InputError, match=r"http\(s\) image URLs are not fetched"):
        read_media_bytes(server.url(), MediaPolicy(allow_any_local=True))
    assert len(server.requests) == 1
