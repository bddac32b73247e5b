"""The OpenAI-compatible server, driven by the official `openai` client (and httpx for raw HTTP).

Expected answers come from the example scenes' definitions (examples/make_example_images.py)."""

from __future__ import annotations

import base64
import functools
import http.server
import io
import threading
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoConfig, AutoTokenizer

from examples import make_example_images
from tessera import TINY_DEMO_MODEL
from testkit.server import API_KEY, MAX_IMAGES, data_url, metric, wait_until_idle
from tools import tiny_demo_data

REPO = Path(__file__).resolve().parents[3]

IMAGE = REPO / "examples" / "three_shapes.png"
SCENE = make_example_images.SCENES["three_shapes.png"]
CAPTION = tiny_demo_data.describe(SCENE)
CIRCLE_COLOUR = next(s["colour"] for s in SCENE if s["shape"] == "circle")
_VISION = AutoConfig.from_pretrained(TINY_DEMO_MODEL).vision_config
NUM_IMAGE_TOKENS = (_VISION.image_size // _VISION.patch_size) ** 2  # CLS dropped ("default" strategy)


def ask(question: str, url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": question}]}]  # fmt: skip


def headers() -> dict:
    return {"Authorization": f"Bearer {API_KEY}"}


# ---- chat ------------------------------------------------------------------------------------------


def test_chat_with_an_image_answers_and_counts_image_tokens(client, server):
    response = client.chat.completions.create(
        model="demo", messages=ask("Describe the image.", data_url(IMAGE)), temperature=0, max_tokens=32
    )
    choice = response.choices[0]
    assert choice.message.content.strip() == CAPTION
    assert choice.finish_reason == "stop" and choice.message.role == "assistant"
    tokenized = httpx.post(server[0] + "/tokenize", headers=headers(),
                           json={"messages": ask("Describe the image.", data_url(IMAGE))}).json()  # fmt: skip
    assert response.usage.prompt_tokens == tokenized["count"] > NUM_IMAGE_TOKENS
    assert response.usage.completion_tokens >= 1
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_streaming_sends_the_same_answer_in_chunks(client):
    messages = ask("Describe the image.", data_url(IMAGE))
    chunks = list(client.chat.completions.create(model="demo", messages=messages, temperature=0, max_tokens=32,
                                                 stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip() == CAPTION
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # really streamed
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > NUM_IMAGE_TOKENS


def test_n_gives_n_choices(client):
    response = client.chat.completions.create(model="demo", messages=ask("Describe the image.", data_url(IMAGE)),
                                              n=3, temperature=1.0, seed=1, max_tokens=8)  # fmt: skip
    assert sorted(c.index for c in response.choices) == [0, 1, 2]
    assert all(c.message.content for c in response.choices)


def test_logprobs_of_a_greedy_answer_are_the_most_likely(client):
    response = client.chat.completions.create(model="demo", messages=ask("What colour is the circle?", data_url(IMAGE)),
                                              temperature=0, max_tokens=4, logprobs=True, top_logprobs=2)  # fmt: skip
    content = response.choices[0].logprobs.content
    eos = AutoTokenizer.from_pretrained(TINY_DEMO_MODEL).eos_token  # the end token is scored too
    assert "".join(t.token for t in content).strip() == CIRCLE_COLOUR + eos
    for token in content:
        assert token.logprob <= 0 and token.logprob == max(t.logprob for t in token.top_logprobs)


def test_streamed_logprobs_equal_the_whole_answers(client):
    kwargs = dict(model="demo", messages=ask("What colour is the circle?", data_url(IMAGE)), temperature=0,
                  max_tokens=4, logprobs=True, top_logprobs=2)  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed = [
        token
        for chunk in client.chat.completions.create(**kwargs, stream=True)
        for choice in chunk.choices
        if choice.logprobs is not None
        for token in choice.logprobs.content or []
    ]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in whole]
    assert [[x.token for x in t.top_logprobs] for t in streamed] == [[x.token for x in t.top_logprobs] for t in whole]


def test_completions_take_an_inline_img_tag(client):
    for mime in ("image/png", "image/webp", "image/jpeg"):
        prompt = f'USER: <img src="{encoded(mime)}">\nWhat colour is the circle? ASSISTANT:'
        response = client.completions.create(model="demo", prompt=prompt, temperature=0, max_tokens=4)
        assert response.choices[0].text.strip() == CIRCLE_COLOUR, mime
        assert response.usage.prompt_tokens > NUM_IMAGE_TOKENS


def encoded(mime: str) -> str:
    """The example image as a data URL of this type."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.open(IMAGE).convert("RGB").save(buffer, format=mime.split("/")[1], quality=95)
    return f"data:{mime};base64," + base64.b64encode(buffer.getvalue()).decode()


def test_tokenize_reports_the_placeholder_ranges(server):
    prompt = f'USER: <img src="{data_url(IMAGE)}">\nWhat colour is the circle? ASSISTANT:'
    body = httpx.post(server[0] + "/tokenize", headers=headers(), json={"prompt": prompt}).json()
    (placeholder,) = body["mm_placeholders"]["image"]
    tokens = body["tokens"]
    start, length = placeholder["offset"], placeholder["length"]
    image_token = AutoConfig.from_pretrained(TINY_DEMO_MODEL).image_token_index
    assert length == NUM_IMAGE_TOKENS
    assert tokens[start : start + length] == [image_token] * length and tokens.count(image_token) == length
    assert body["count"] == len(tokens)


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["demo"]
    assert httpx.get(server[0] + "/health").status_code == 200
    assert metric(server[0], "tessera_kv_blocks_total") > 0
    assert metric(server[0], 'tessera_requests_total{status="stop"}') >= 1


def test_local_files_only_inside_the_allowed_folder(client, media_dir, tmp_path):
    inside = media_dir / "scene.png"
    inside.write_bytes(IMAGE.read_bytes())
    response = client.chat.completions.create(model="demo", messages=ask("What colour is the circle?", f"file://{inside}"),
                                              temperature=0, max_tokens=4)  # fmt: skip
    assert response.choices[0].message.content.strip() == CIRCLE_COLOUR
    outside = tmp_path / "scene.png"
    outside.write_bytes(IMAGE.read_bytes())
    with pytest.raises(openai.BadRequestError, match="not inside the allowed media folder"):
        client.chat.completions.create(model="demo", messages=ask("Hi", str(outside)), max_tokens=2)


def test_http_image_urls_are_fetched(lan_server):
    from openai import OpenAI

    client = OpenAI(base_url=lan_server[0] + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(IMAGE.parent))
    handler.log_message = lambda *a: None  # type: ignore[assignment]
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{httpd.server_address[1]}"
        messages = ask("What colour is the circle?", f"{base}/{IMAGE.name}")
        response = client.chat.completions.create(model="demo", messages=messages, temperature=0, max_tokens=4)
        assert response.choices[0].message.content.strip() == CIRCLE_COLOUR
        with pytest.raises(openai.BadRequestError, match="could not be fetched"):
            client.chat.completions.create(model="demo", messages=ask("Hi", f"{base}/missing.png"), max_tokens=2)
    finally:
        httpd.shutdown()


# ---- mm_processor_kwargs and item ids ---------------------------------------------------------------------


@pytest.fixture
def applied(server, monkeypatch):
    """What the server's engine handed the processor's apply (which still runs)."""
    processor = server[1].engine.processor
    calls, original = [], processor.apply

    def recording(prompt, mm_data, hf_processor_mm_kwargs={}, *, mm_uuids=None):
        calls.append((dict(hf_processor_mm_kwargs), mm_uuids))
        return original(prompt, mm_data, hf_processor_mm_kwargs, mm_uuids=mm_uuids)

    monkeypatch.setattr(processor, "apply", recording)
    return calls


def test_chat_takes_mm_processor_kwargs_and_image_ids(client, applied):
    messages = ask("What colour is the circle?", data_url(IMAGE))
    messages[0]["content"][0]["uuid"] = "three-shapes"
    kwargs = {"do_normalize": True}  # the default
    response = client.chat.completions.create(model="demo", messages=messages, temperature=0, max_tokens=4,
                                              extra_body={"mm_processor_kwargs": kwargs})  # fmt: skip
    assert response.choices[0].message.content.strip() == CIRCLE_COLOUR
    assert applied == [(kwargs, {"image": ["three-shapes"]})]


def test_completions_take_mm_processor_kwargs_and_ids_of_inline_images(client, applied):
    prompt = f'USER: <img src="{data_url(IMAGE)}">\nWhat colour is the circle? ASSISTANT:'
    body = {"mm_processor_kwargs": {"do_normalize": True}, "multi_modal_uuids": {"image": ["inline-1"]}}
    response = client.completions.create(model="demo", prompt=prompt, temperature=0, max_tokens=4, extra_body=body)
    assert response.choices[0].text.strip() == CIRCLE_COLOUR
    assert applied == [({"do_normalize": True}, {"image": ["inline-1"]})]
    ids = AutoTokenizer.from_pretrained(TINY_DEMO_MODEL).encode("USER: Hi ASSISTANT:")
    body = {"mm_processor_kwargs": {"padding": False}}  # a text option
    client.completions.create(model="demo", prompt=ids, max_tokens=2, extra_body=body)
    assert applied[-1] == ({"padding": False}, None)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_an_option_the_processor_does_not_take_is_a_json_400(server, client, path):
    body = {"model": "demo", "max_tokens": 2, "mm_processor_kwargs": {"do_normalise": False}}
    if path == "/v1/completions":
        body["prompt"] = f'USER: <img src="{data_url(IMAGE)}">\nWhat colour is the circle? ASSISTANT:'
    else:
        body["messages"] = ask("What colour is the circle?", data_url(IMAGE))
    response = httpx.post(server[0] + path, headers=headers(), json=body)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "'do_normalise'" in message and "did you mean 'do_normalize'" in message and "LlavaProcessor" in message
    check_still_serving(client)


def test_tokenize_takes_mm_processor_kwargs(server, applied):
    body = {"messages": ask("Hi", data_url(IMAGE)), "mm_processor_kwargs": {"do_normalize": True}}
    response = httpx.post(server[0] + "/tokenize", headers=headers(), json=body)
    assert response.status_code == 200 and response.json()["mm_placeholders"]["image"][0]["length"] == NUM_IMAGE_TOKENS
    assert applied == [({"do_normalize": True}, None)]


@pytest.mark.parametrize(
    "path, body, message",
    [
        ("/v1/completions", {"prompt": f'<img src="{data_url(IMAGE)}"> Hi', "multi_modal_uuids": {"image": ["a", "b"]}},
         "multi_modal_uuids['image'] has 2 id(s) for 1 image item(s)"),
        ("/v1/completions", {"prompt": "Hi", "multi_modal_uuids": {"image": ["a"]}},
         "names the modality 'image', which has no items"),
        ("/v1/completions", {"prompt": "Hi", "multi_modal_uuids": ["a"]}, "multi_modal_uuids"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(IMAGE)}, "uuid": 5}]}]},
         "messages[0].content[0].uuid must be a string"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "mm_processor_kwargs": [1]},
         "mm_processor_kwargs"),
    ],
)  # fmt: skip
def test_malformed_ids_and_kwargs_are_400(server, client, applied, path, body, message):
    response = httpx.post(server[0] + path, headers=headers(), json={"model": "demo", "max_tokens": 2, **body})
    assert response.status_code == 400 and message in response.json()["error"]["message"]
    assert applied == []  # refused before processing
    check_still_serving(client)


# ---- bad input: a clear 4xx, and the server keeps serving ------------------------------------------------


GARBAGE = "data:image/png;base64," + base64.b64encode(b"definitely not a png").decode()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"messages": ask("Hi", "data:image/png;base64,@@@not-base64@@@")}, "not valid base64"),
        ({"messages": ask("Hi", GARBAGE)}, "could not be decoded"),
        ({"messages": ask("Hi", "data:text/plain;base64,aGVsbG8=")}, "Unsupported media type 'text/plain'"),
        ({"messages": ask("Hi", "ftp://example.com/a.png")}, "Unsupported image URL scheme"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}] * 3}]},
         f"at most {MAX_IMAGES} per prompt"),
        ({"messages": [{"role": "user", "content": "circle " * 600}]}, "context"),
        ({"messages": [{"role": "user", "content": "Hi"}], "temperature": 5}, "temperature"),
        ({"messages": [{"role": "user", "content": "Hi"}], "n": 0}, "n"),
        ({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "Hi"}], "presence_penalty": 0.5}, "presence_penalty"),
        ({"messages": [{"role": "robot", "content": "Hi"}]}, "messages[0]: unsupported role 'robot'"),
        ({"messages": []}, "messages"),
    ],
)  # fmt: skip
def test_bad_requests_get_400_with_a_reason(client, kwargs, message):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="demo", **{"max_tokens": 4, **kwargs})
    assert message in error.value.message
    assert error.value.status_code == 400
    check_still_serving(client)


def check_still_serving(client):
    response = client.chat.completions.create(model="demo", messages=ask("What colour is the circle?", data_url(IMAGE)),
                                              temperature=0, max_tokens=4)  # fmt: skip
    assert response.choices[0].message.content.strip() == CIRCLE_COLOUR


def test_completion_with_a_bad_inline_image_is_400(client):
    with pytest.raises(openai.BadRequestError, match="could not be decoded"):
        client.completions.create(model="demo", prompt=f'<img src="{GARBAGE}"> Hi', max_tokens=2)


def test_an_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)


def test_an_oversized_body_is_413(server, client):
    big = {"model": "demo", "messages": [{"role": "user", "content": "x" * (2**20 + 10)}]}
    response = httpx.post(server[0] + "/v1/chat/completions", headers=headers(), json=big)
    assert response.status_code == 413 and "over the limit" in response.json()["error"]["message"]
    check_still_serving(client)


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_a_missing_or_wrong_api_key_is_401(server, client, key):
    auth = {} if key is None else {"Authorization": f"Bearer {key}"}
    response = httpx.post(server[0] + "/v1/chat/completions", headers=auth,
                          json={"model": "demo", "messages": [{"role": "user", "content": "Hi"}]})  # fmt: skip
    assert response.status_code == 401 and "API key" in response.json()["error"]["message"]
    check_still_serving(client)


# ---- disconnects ---------------------------------------------------------------------------------------


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server, client):
    body = {"model": "demo", "messages": ask("Describe the image.", data_url(IMAGE)), "stream": True,
            "max_tokens": 400, "ignore_eos": True, "temperature": 0}  # fmt: skip
    aborted = metric(server[0], 'tessera_requests_total{status="abort"}') if _has_aborts(server) else 0.0
    with httpx.stream("POST", server[0] + "/v1/chat/completions", headers=headers(), json=body, timeout=60) as r:
        lines = r.iter_lines()
        received = [next(lines) for _ in range(6)]  # a few chunks in, then hang up
    assert any(line.startswith("data: ") for line in received)
    wait_until_idle(server[0])
    assert metric(server[0], 'tessera_requests_total{status="abort"}') == aborted + 1
    check_still_serving(client)
    wait_until_idle(server[0])


def _has_aborts(server) -> bool:
    return 'tessera_requests_total{status="abort"}' in httpx.get(server[0] + "/metrics").text


# ---- a dead engine --------------------------------------------------------------------------------------------


@pytest.fixture
def serve_engines(monkeypatch):
    """The AsyncEngines that api_server.serve() creates, in order."""
    from tessera.entrypoints.openai import api_server

    engines = []

    class RecordedEngine(api_server.AsyncEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            engines.append(self)

    monkeypatch.setattr(api_server, "AsyncEngine", RecordedEngine)
    return engines


def test_serve_exits_with_status_1_when_the_engine_dies(serve_engines):
    """Never a zombie answering 503: a failed request, /health says dead, and serve() returns 1
    so that a supervisor restarts the server."""
    import socket
    import time

    from tessera.entrypoints.openai import api_server

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    base, seen = f"http://127.0.0.1:{port}", {}

    def break_the_engine():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)  # still loading the model

        def scheduler_bug():
            raise RuntimeError("scheduler bug")

        serve_engines[0].engine.core.scheduler.schedule = scheduler_bug
        response = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        seen["status"], seen["error"] = response.status_code, response.json()["error"]
        try:
            seen["health"] = httpx.get(base + "/health").json()
        except httpx.TransportError:
            seen["health"] = "gone"

    worker = threading.Thread(target=break_the_engine, daemon=True)
    worker.start()
    code = api_server.serve(str(TINY_DEMO_MODEL), port=port, log_level="warning", kv_cache_memory="16MiB")
    worker.join(timeout=30)
    assert code == 1
    assert seen["status"] == 503 and seen["error"]["type"] == "server_error"
    assert seen["health"] == "gone" or seen["health"]["status"] == "dead"  # "gone" once it has exited


def test_health_says_dead_once_the_engine_has_died(tiny_llava_dir):
    from tessera.engine.async_engine import AsyncEngine
    from tessera.engine.llm_engine import LLMEngine
    from tessera.entrypoints.openai.api_server import ServerThread, build_app

    engine = AsyncEngine(LLMEngine.from_options(str(tiny_llava_dir), kv_cache_memory="16MiB"))
    try:
        with ServerThread(build_app(engine, model_name="tiny")) as url:
            assert httpx.get(url + "/health").json() == {"status": "ok"}
            engine.engine.core.scheduler.schedule = None  # calling it raises TypeError on the engine thread
            response = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
            assert response.status_code == 503 and response.json()["error"]["type"] == "server_error"
            health = httpx.get(url + "/health")
            assert health.status_code == 503 and health.json()["status"] == "dead"
    finally:
        engine.shutdown()


def test_the_media_options_from_before_media_policy_still_apply(demo_engine, media_dir):
    from tessera.entrypoints.openai.api_server import build_app

    app = build_app(demo_engine, model_name="demo", allowed_media_dir=str(media_dir), image_fetch_timeout=2.5)
    policy = app.state.serving.media.policy
    assert policy.fetch_urls and not policy.allow_private_networks  # the safe defaults stay
    assert (policy.timeout, str(policy.allowed_local_dir)) == (2.5, str(media_dir))


def test_serve_hands_engine_options_to_the_engine(serve_engines, monkeypatch):
    """`tessera serve --mm-processor-kwargs` reaches the engine's config, not the app."""
    import uvicorn

    from tessera.entrypoints.openai import api_server

    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: None)
    kwargs = {"vision_feature_select_strategy": "default"}
    assert api_server.serve(str(TINY_DEMO_MODEL), kv_cache_memory="16MiB", mm_processor_kwargs=kwargs) == 0
    assert serve_engines[0].engine.model_config.multimodal_config.mm_processor_kwargs == kwargs
