"""Hostile input against a real server on 127.0.0.1: each gets an OpenAI-style JSON error with the
right status, and nothing else is lost: a well-formed request sent alongside gets the same answer
as alone, /health stays 200, every KV block is freed, memory stays where it was."""

from __future__ import annotations

import base64
import concurrent.futures
import http.server
import io
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from PIL import Image

from examples import make_example_images
from testkit import png_bytes
from testkit.server import (
    API_KEY,
    FETCH_DEADLINE,
    data_url,
    metric,
    rss_bytes,
    serve_demo,
    wait_until_idle,
)
from tools import tiny_demo_data

REPO = Path(__file__).resolve().parents[3]

IMAGE = REPO / "examples" / "three_shapes.png"
CAPTION = tiny_demo_data.describe(make_example_images.SCENES["three_shapes.png"])
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def ask(url: str, question: str = "Describe the image.") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": question}]}]  # fmt: skip


def post(base: str, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(base + path, headers=HEADERS, json=body, timeout=timeout)


def chat(base: str, messages, **extra) -> httpx.Response:
    return post(base, "/v1/chat/completions", {"model": "demo", "messages": messages, "max_tokens": 24,
                                                "temperature": 0, **extra})  # fmt: skip


def well_formed_answer(base: str) -> str:
    response = chat(base, ask(data_url(IMAGE)))
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"].strip()


def assert_json_error(response: httpx.Response, status: int, *fragments: str) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["code"] == status and error["type"] and error["message"]
    for fragment in fragments:
        assert fragment in error["message"], error["message"]
    for leak in ("Traceback", "BytesIO", " object at 0x", str(REPO)):
        assert leak not in error["message"]
    return error["message"]


def png_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def reference(server):
    return well_formed_answer(server[0])


def alongside(base: str, hostile, reference: str) -> httpx.Response:
    """Send `hostile()` while a well-formed request runs; both finish, the well-formed one with its answer."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        start = time.monotonic()
        good = pool.submit(well_formed_answer, base)
        response = hostile()
        assert good.result(timeout=60) == reference
        # generous for a noisy 2-core machine; these inputs used to stall everyone for 5-60 s
        assert time.monotonic() - start < 10
    assert httpx.get(base + "/health").status_code == 200
    wait_until_idle(base)
    return response


# ---- 1. token ids ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt, fragment", [([1, 99999], "99999"), ([1, -5], "-5"), ([1, 2.5], "valid integer")])
def test_token_ids_outside_the_vocabulary_are_400_and_the_engine_lives(server, reference, prompt, fragment):
    response = alongside(server[0], lambda: post(server[0], "/v1/completions", {"prompt": prompt}), reference)
    assert_json_error(response, 400, fragment)
    assert well_formed_answer(server[0]) == reference


# ---- 3/4. images and text too large to process: refused before decoding ---------------------------------------


@pytest.mark.parametrize(
    "size, status, fragment",
    [((1, 60000), 400, "aspect ratio"), ((60000, 1), 400, "aspect ratio"), ((13000, 13000), 413, "pixels")],
)
def test_images_too_large_or_too_thin_are_refused_without_growing_memory(server, reference, size, status, fragment):
    url = png_url(png_bytes(*size))
    before = rss_bytes()
    response = alongside(server[0], lambda: chat(server[0], ask(url)), reference)
    assert_json_error(response, status, fragment)
    assert rss_bytes() - before < 100 * 2**20  # decoding either would take hundreds of MB


@pytest.mark.parametrize("where", ["chat", "tokenize", "inline"])
def test_a_decompression_bomb_is_413_everywhere(server, reference, where):
    url = png_url(png_bytes(20000, 20000))  # 400 Mpixels in ~400 kB
    requests = {
        "chat": lambda: chat(server[0], ask(url)),
        "tokenize": lambda: post(server[0], "/tokenize", {"messages": ask(url)}),
        "inline": lambda: post(server[0], "/v1/completions", {"prompt": f'<img src="{url}"> Describe.'}),
    }
    assert_json_error(alongside(server[0], requests[where], reference), 413)


def test_a_text_longer_than_the_context_is_refused_before_tokenizing(server, reference):
    text = "circle " * 120_000  # 840 kB, under the 1 MiB body cap
    response = alongside(server[0], lambda: chat(server[0], [{"role": "user", "content": text}]), reference)
    assert_json_error(response, 413, "characters")


# ---- 4. malformed messages ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content, fragment",
    [({"text": "hi"}, "content must be a string or a list"), (42, "content must be a string or a list"),
     ([42], "content[0] must be"), ([{"type": "file"}], "unsupported content part type"),
     ([{"type": "video_url"}], "video_url content part needs"),
     ([{"type": "audio_url"}], "audio_url content part needs"),
     ([{"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}], "does not support audio")],
)  # fmt: skip
def test_malformed_content_is_400(server, content, fragment):
    assert_json_error(chat(server[0], [{"role": "user", "content": content}]), 400, fragment)


def test_a_list_of_plain_strings_is_text(server):
    as_strings = chat(server[0], [{"role": "user", "content": ["How many shapes", " are there?"]}])
    as_parts = chat(server[0], [{"role": "user", "content": [{"type": "text", "text": "How many shapes are there?"}]}])
    assert as_strings.status_code == 200 and as_strings.json()["choices"] == as_parts.json()["choices"]


# ---- 5. clients that leave -----------------------------------------------------------------------------------------


def test_a_non_streaming_request_is_aborted_when_its_client_leaves(server):
    body = {"model": "demo", "messages": ask(data_url(IMAGE)), "max_tokens": 500, "ignore_eos": True}
    aborted = metric(server[0], 'tessera_requests_total{status="abort"}', default=0.0)  # none yet if run alone
    with pytest.raises(httpx.ReadTimeout):
        post(server[0], "/v1/chat/completions", body, timeout=0.2)  # hang up while it generates (500 tokens: >0.3 s)
    wait_until_idle(server[0])  # would take 500 steps if it kept going
    assert metric(server[0], 'tessera_requests_total{status="abort"}') == aborted + 1
    assert metric(server[0], "tessera_kv_blocks_used") == 0


# ---- 6. media fetch policy ----------------------------------------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    routes: dict = {}
    hits: list = []

    def do_GET(self):  # noqa: N802
        self.hits.append(self.path)
        self.routes.get(self.path, _not_found)(self)

    def log_message(self, *args):
        pass


def _not_found(handler):
    handler.send_error(404)


def _image(handler):
    data = IMAGE.read_bytes()
    handler.send_response(200)
    handler.send_header("Content-Type", "image/png")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def _trickle(handler):
    """Headers, then a byte every 0.1 s for as long as the client listens."""
    handler.send_response(200)
    handler.send_header("Content-Type", "image/png")
    handler.end_headers()
    try:
        for _ in range(600):
            handler.wfile.write(b"\x89")
            handler.wfile.flush()
            time.sleep(0.1)
    except OSError:
        pass


def _redirect_to(location):
    def handle(handler):
        handler.send_response(302)
        handler.send_header("Location", location)
        handler.end_headers()

    return handle


@pytest.fixture(scope="module")
def media_server():
    _Handler.routes = {"/image.png": _image, "/trickle.png": _trickle, "/to-file": _redirect_to("file:///etc/passwd")}
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    port = httpd.server_address[1]
    _Handler.routes["/to-loopback"] = _redirect_to(f"http://127.0.0.1:{port}/image.png")
    yield port
    httpd.shutdown()


def fetch_error(base: str, url: str) -> str:
    return assert_json_error(chat(base, ask(url)), 400)


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "localhost", "[::1]", "127.1", "2130706433", "0x7f000001", "[::ffff:127.0.0.1]"]
)
def test_loopback_in_every_spelling_is_refused_without_a_fetch(server, media_server, host):
    _Handler.hits.clear()
    generic = fetch_error(server[0], "http://10.0.0.1/image.png")
    assert fetch_error(server[0], f"http://{host}:{media_server}/image.png") == generic
    assert _Handler.hits == []


def test_every_fetch_failure_reads_the_same(lan_server, media_server):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    base = lan_server[0]
    messages = {fetch_error(base, f"http://127.0.0.1:{media_server}/missing.png"),
                fetch_error(base, f"http://127.0.0.1:{closed_port}/image.png"),
                fetch_error(base, f"http://127.0.0.1:{media_server}/to-file")}  # fmt: skip
    assert len(messages) == 1
    assert str(closed_port) not in messages.pop()


def test_redirects_within_the_policy_are_followed(lan_server, media_server):
    response = chat(lan_server[0], ask(f"http://127.0.0.1:{media_server}/to-loopback"))
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"].strip() == CAPTION


# ---- 2. slow URLs -------------------------------------------------------------------------------------------------


def test_trickling_urls_fail_at_the_deadline_and_stall_nobody(lan_server, media_server, reference):
    base, url = lan_server[0], f"http://127.0.0.1:{media_server}/trickle.png"
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        slow = [pool.submit(chat, base, ask(url)) for _ in range(5)]  # more than the 3 download slots
        start = time.monotonic()
        assert well_formed_answer(base) == reference  # a data URL needs no download slot
        answered_in = time.monotonic() - start
        statuses = sorted(f.result(timeout=30).status_code for f in slow)
        failed_in = time.monotonic() - start
    assert answered_in < FETCH_DEADLINE  # it did not wait for any of the downloads
    assert statuses == [400, 400, 400, 503, 503]  # 3 hit the total deadline, 2 found no free slot
    assert failed_in < FETCH_DEADLINE + 3  # per-read timeouts would let a trickle last a minute
    assert httpx.get(base + "/health").status_code == 200
    wait_until_idle(base)


# ---- 7. unsupported parameters ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, extra",
    [("/v1/chat/completions", {"response_format": {"type": "structural_tag"}}),
     ("/v1/chat/completions", {"logit_bias": {"5": 10}}),
     ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}),
     ("/v1/completions", {"echo": True}), ("/v1/completions", {"suffix": "end"}),
     ("/v1/chat/completions", {"frobnicate": 1})],
)  # fmt: skip
def test_unsupported_parameters_are_refused_by_name(server, path, extra):
    body = {"model": "demo", "max_tokens": 2, **extra}
    body.update({"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": "Hi"})
    (name,) = extra
    assert_json_error(post(server[0], path, body), 400, name)
    assert post(server[0], path, body).json()["error"]["param"] == name


@pytest.mark.parametrize(
    "extra",
    [{"logit_bias": {}}, {"tools": []}, {"response_format": {"type": "text"}}, {"frequency_penalty": 0},
     {"user": "someone"}, {"tool_choice": "none"}],
)  # fmt: skip
def test_neutral_values_of_unsupported_parameters_are_accepted(server, extra):
    response = chat(server[0], [{"role": "user", "content": "Hi"}], **extra)
    assert response.status_code == 200, response.text


# ---- 8/9. confusing messages, image modes --------------------------------------------------------------------------


def test_a_seed_out_of_range_is_400(server):
    assert_json_error(chat(server[0], [{"role": "user", "content": "Hi"}], seed=2**70), 400, "seed")


def test_garbage_image_bytes_name_the_problem_without_reprs(server):
    assert_json_error(chat(server[0], ask(png_url(b"definitely not a png"))), 400, "could not be decoded")


def test_line_wrapped_base64_is_accepted(server, reference):
    encoded = base64.encodebytes(IMAGE.read_bytes()).decode()  # 76-character lines
    assert "\n" in encoded
    assert (
        chat(server[0], ask("data:image/png;base64," + encoded)).json()["choices"][0]["message"]["content"].strip()
        == reference
    )


def test_a_directory_is_not_a_file(server, media_dir):
    (media_dir / "folder").mkdir(exist_ok=True)
    message = fetch_error(server[0], str(media_dir / "folder"))
    assert "not a file" in message or "no image" in message.lower()
    assert "does not exist" not in message


@pytest.mark.parametrize("size", [(1, 1), (2, 2), (3, 3), (1, 40), (40, 3)])
def test_tiny_images_work_or_get_a_clear_400(server, size):
    buffer = io.BytesIO()
    Image.new("RGB", size, "red").save(buffer, format="PNG")
    response = chat(server[0], ask(png_url(buffer.getvalue())))
    if response.status_code != 200:
        message = assert_json_error(response, 400, "pixels")
        assert "mean must have" not in message


# ---- 10. connections that send nothing ---------------------------------------------------------------------------


def test_silent_and_trickling_connections_are_closed(demo_engine):
    from tessera.multimodal.media import MediaPolicy

    with serve_demo(demo_engine, MediaPolicy(), head_timeout=0.5) as base:
        host, port = base.removeprefix("http://").split(":")
        silent = socket.create_connection((host, int(port)))
        partial = socket.create_connection((host, int(port)))
        partial.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never finishes its head
        for connection in (silent, partial):
            connection.settimeout(5)
            assert connection.recv(1024) == b""  # closed by the server, well before 5 s
            connection.close()
        assert httpx.get(base + "/health").status_code == 200  # a prompt client is served


# ---- processor kwargs that would ask for unbounded work ------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, where",
    [({"size": {"shortest_edge": 50000}}, "mm_processor_kwargs.size.shortest_edge=50000"),
     ({"crop_size": [64, 10**9]}, "mm_processor_kwargs.crop_size[1]")],
)  # fmt: skip
def test_processor_kwargs_beyond_the_image_limits_are_400(server, reference, kwargs, where):
    response = alongside(
        server[0], lambda: chat(server[0], ask(data_url(IMAGE)), mm_processor_kwargs=kwargs), reference
    )
    assert_json_error(response, 400, where, "over 8192")
