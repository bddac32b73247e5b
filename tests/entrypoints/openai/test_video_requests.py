"""Video URLs in chat requests: refused by name for a model without video; for a model that takes
them, loaded on the media pools (data URLs, http(s) through the fetch slots) with the image
errors' statuses: 400 for a bad video, 413 for one too large.

The demo model takes no videos: the tests that need one give its preprocessor a video placeholder,
so a video that loads reaches the LLaVA processor, whose refusal ("it accepts: image") shows that
loading and decoding went through."""

from __future__ import annotations

import base64
import concurrent.futures
import http.server
import io
import threading
import time

import httpx
import pytest
from PIL import Image

from tessera.multimodal.media import MediaPolicy
from testkit import video_bytes
from testkit.server import API_KEY, serve_demo

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
CLIP = video_bytes(num_frames=8, fps=8)
MAX_VIDEO_BYTES = len(CLIP) * 2
FETCH_SLOTS = 2


def video_url(data: bytes = CLIP, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def jpeg_frames_url(*frames: bytes) -> str:
    """vLLM's video as JPEG frames: data:video/jpeg;base64,<frame>,<frame>,..."""
    return "data:video/jpeg;base64," + ",".join(base64.b64encode(f).decode() for f in frames)


def jpeg(side: int = 32, colour: str = "red") -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (side, side), colour).save(buffer, format="JPEG")
    return buffer.getvalue()


def ask(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                         {"type": "text", "text": "What happens?"}]}]  # fmt: skip


def post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, headers=HEADERS, json=body, timeout=60)


def chat(base: str, messages, **extra) -> httpx.Response:
    return post(base, "/v1/chat/completions", {"model": "demo", "messages": messages, "max_tokens": 4, **extra})


def json_error(response: httpx.Response, status: int, *fragments: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status
    for fragment in fragments:
        assert fragment in error["message"], error["message"]
    assert "Traceback" not in error["message"]
    return error["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_a_video_for_a_model_without_video_is_a_clear_400(server, path):
    json_error(post(server[0], path, {"messages": ask(video_url())}), 400, "does not support video")


class _Handler(http.server.BaseHTTPRequestHandler):
    hits: list = []
    release = threading.Event()  # /held.mp4 answers once this is set
    release.set()

    def do_GET(self):  # noqa: N802
        self.hits.append(self.path)
        if self.path == "/held.mp4":
            self.release.wait(timeout=30)
        self.send_response(200)
        self.send_header("Content-Type", "video/mp4")
        self.send_header("Content-Length", str(len(CLIP)))
        self.end_headers()
        self.wfile.write(CLIP)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def video_server(demo_engine):
    """A server over the demo engine with a small video size limit, fetching from 127.0.0.1, and
    the port of an HTTP server that serves CLIP."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    policy = MediaPolicy(fetch_urls=True, allow_private_networks=True, max_video_bytes=MAX_VIDEO_BYTES, timeout=5)
    with serve_demo(
        demo_engine, policy, media_io_kwargs={"video": {"num_frames": 4}}, max_concurrent_fetches=FETCH_SLOTS
    ) as url:
        yield url, httpd.server_address[1]
    _Handler.release.set()
    httpd.shutdown()


@pytest.fixture
def takes_video(demo_engine, monkeypatch):
    monkeypatch.setattr(demo_engine.engine.input_preprocessor, "video_placeholder", lambda i: "<video>")


@pytest.mark.parametrize("where", ["data", "http", "jpeg_frames"])
def test_a_good_video_is_loaded_and_reaches_the_processor(video_server, takes_video, where):
    url = {"data": video_url(), "http": f"http://127.0.0.1:{video_server[1]}/clip.mp4",
           "jpeg_frames": jpeg_frames_url(jpeg(colour="red"), jpeg(colour="blue"))}[where]  # fmt: skip
    response = post(video_server[0], "/tokenize", {"messages": ask(url), "media_io_kwargs": {"video": {"fps": 2}}})
    json_error(response, 400, "does not support video inputs; it accepts: image")  # LLaVA's processor


@pytest.mark.parametrize(
    "url, status, fragment",
    [(video_url(b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 200), 400, "video"),
     (video_url(b"not a video at all"), 400, "video"),
     (video_url(mime="video/ogg"), 400, "Unsupported media type"),
     (video_url(CLIP * 3), 413, "size limit"),
     (jpeg_frames_url(jpeg(), b"\x89PNG\r\n\x1a\n" + b"\x00" * 40), 400, "frame 1 could not be decoded"),
     (jpeg_frames_url(jpeg(32), jpeg(48)), 400, "differ in size"),
     (jpeg_frames_url(*[jpeg(256)] * 40), 413, "size limit")],
)  # fmt: skip
def test_bad_and_too_large_videos_get_the_image_errors_statuses(video_server, takes_video, url, status, fragment):
    json_error(chat(video_server[0], ask(url)), status, fragment)


@pytest.mark.parametrize("io_kwargs, fragment", [({"video": {"frames": 2}}, "unsupported option"),
                                                 ({"video": {"num_frames": 100000}}, "num_frames")])  # fmt: skip
def test_bad_media_io_kwargs_are_400(video_server, takes_video, io_kwargs, fragment):
    json_error(chat(video_server[0], ask(video_url()), media_io_kwargs=io_kwargs), 400, fragment)


def test_video_downloads_beyond_the_fetch_slots_are_503_and_data_urls_still_load(video_server, takes_video):
    """With both download slots held by slow video URLs, a third video URL is told to retry (503)
    without a fetch; a data URL needs no slot; once the downloads end, the slots are free again."""
    base, port = video_server
    held, loaded = f"http://127.0.0.1:{port}/held.mp4", "does not support video inputs; it accepts: image"
    _Handler.hits.clear()
    _Handler.release.clear()
    try:
        with concurrent.futures.ThreadPoolExecutor(FETCH_SLOTS) as pool:
            slow = [pool.submit(chat, base, ask(held)) for _ in range(FETCH_SLOTS)]
            deadline = time.monotonic() + 30
            while len(_Handler.hits) < FETCH_SLOTS and time.monotonic() < deadline:  # both slots taken
                time.sleep(0.02)
            assert _Handler.hits == ["/held.mp4"] * FETCH_SLOTS
            busy = chat(base, ask(f"http://127.0.0.1:{port}/clip.mp4"))
            assert busy.status_code == 503, busy.text
            assert busy.json()["error"]["message"] == (
                "Too many video downloads are in progress; retry shortly or send a data URL."
            )
            assert _Handler.hits == ["/held.mp4"] * FETCH_SLOTS  # refused without a fetch
            json_error(chat(base, ask(video_url())), 400, loaded)  # a data URL: loaded, then LLaVA's refusal
            _Handler.release.set()
            for future in slow:  # the held downloads finish and their videos load
                json_error(future.result(timeout=30), 400, loaded)
    finally:
        _Handler.release.set()
    json_error(chat(base, ask(f"http://127.0.0.1:{port}/clip.mp4")), 400, loaded)  # the slots were given back
