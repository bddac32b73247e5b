"""The web chat page in headless Chromium (Playwright driving the system `chromium`): upload an
image, ask the bundled model about it, see the streamed answer and the image in the history; upload
a short clip to a tiny Qwen2-VL and see the answer the server gives the same request sent directly;
a video the model cannot take is a 400 shown in the page, and the conversation goes on; likewise a WAV
recording to a tiny Qwen2-Audio, and to the demo model, which cannot hear."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from examples import make_example_images
from testkit import video_bytes
from testkit.server import API_KEY
from tools import tiny_demo_data

REPO = Path(__file__).resolve().parents[3]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (make test installs it with apt)")

IMAGE = REPO / "examples" / "three_shapes.png"
CAPTION = tiny_demo_data.describe(make_example_images.SCENES["three_shapes.png"])


@pytest.fixture(scope="module")
def page():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.set_default_timeout(15_000)
            yield page
        finally:
            browser.close()


def open_with_key(page, url: str, model: str = "demo") -> None:
    """Load the page and enter the server's API key in the settings, as a user would."""
    page.goto(url + "/")
    page.click("#settings summary")
    page.fill("#api-key", API_KEY)
    page.dispatch_event("#api-key", "change")
    page.wait_for_selector(f"#model-name:has-text('{model}')")


def test_upload_ask_and_see_the_streamed_answer(server, page, tmp_path):
    url = server[0]
    open_with_key(page, url)

    page.set_input_files("#file-input", str(IMAGE))
    page.wait_for_selector("#attachments .preview img")  # previewed before sending
    page.fill("#message", "Describe the image.")
    page.click("#send")

    answer = page.locator(".message.assistant").last
    page.wait_for_selector(".message.assistant:not(.streaming)")
    assert answer.inner_text().strip() == CAPTION

    user = page.locator(".message.user").last
    image_src = user.locator("img").get_attribute("src")
    assert image_src.startswith("data:image/jpeg;base64,")  # kept as a base64 JPEG <img> in the history
    assert user.inner_text().strip() == "Describe the image."
    assert page.locator("#attachments img").count() == 0 and page.is_hidden("#error")

    # A follow-up question in the same conversation (the image stays in the history).
    page.fill("#message", "How many shapes are there?")
    page.keyboard.press("Enter")
    page.wait_for_function("document.querySelectorAll('.message.assistant:not(.streaming)').length === 2")
    expected = tiny_demo_data.NUMBER_WORDS[len(make_example_images.SCENES["three_shapes.png"])]
    assert page.locator(".message.assistant").last.inner_text().strip() == expected
    page.screenshot(path=str(tmp_path / "chat.png"), full_page=True)
    assert (tmp_path / "chat.png").stat().st_size > 0

    page.click("#clear")
    assert page.locator(".message").count() == 0


def test_errors_are_shown_in_the_page(server, page, tmp_path):
    open_with_key(page, server[0])
    for i in range(3):  # one more image than the server takes
        path = tmp_path / f"{i}.png"
        path.write_bytes(IMAGE.read_bytes())
        page.set_input_files("#file-input", str(path))
    page.wait_for_function("document.querySelectorAll('#attachments img').length === 3")
    page.fill("#message", "Describe the image.")
    page.click("#send")
    page.wait_for_selector("#error:not([hidden])")
    assert "at most 2 per prompt" in page.inner_text("#error")
    assert page.locator(".message.assistant").count() == 0  # the failed turn is not left in the history


# ---- video clips ------------------------------------------------------------------------------------------------

CLIP = video_bytes(num_frames=4, width=32, height=32, fps=4)
QUESTION, MAX_TOKENS = "What happens in the video?", 8


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("clips") / "shapes.mp4"
    path.write_bytes(CLIP)
    return path


@pytest.fixture(scope="module")
def qwen_server(tmp_path_factory):
    """A server (API key required) over a tiny Qwen2-VL, which takes videos."""
    from tessera.engine.async_engine import AsyncEngine
    from tessera.engine.llm_engine import LLMEngine
    from tessera.entrypoints.openai.api_server import ServerThread, build_app
    from tessera.multimodal.media import MediaPolicy
    from testkit.qwen_vl import build_tiny_qwen2_vl

    folder = build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl_page"))
    engine = AsyncEngine(LLMEngine.from_options(str(folder), kv_cache_memory="16MiB"))
    try:
        with ServerThread(build_app(engine, model_name="qwen", api_key=API_KEY, media_policy=MediaPolicy())) as url:
            yield url
    finally:
        engine.shutdown()


def direct_answer(url: str, content: list) -> str:
    """What the server answers the request the page sends, sent directly (not streamed)."""
    body = {"model": "qwen", "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
            "temperature": 0}  # fmt: skip
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_upload_a_clip_and_see_the_servers_answer(qwen_server, page, clip):
    import base64

    open_with_key(page, qwen_server, "qwen")
    page.fill("#max-tokens", str(MAX_TOKENS))
    page.set_input_files("#file-input", str(clip))
    page.wait_for_selector("#attachments .preview video")  # previewed, with its name, before sending
    assert page.inner_text("#attachments .preview .name") == "shapes.mp4"
    page.fill("#message", QUESTION)
    page.click("#send")
    page.wait_for_selector(".message.assistant:not(.streaming)")
    assert page.is_hidden("#error"), page.inner_text("#error")

    # the page sent the clip's bytes as they are, as a video_url data URL part before the text
    url = "data:video/mp4;base64," + base64.b64encode(CLIP).decode()
    expected = direct_answer(qwen_server, [{"type": "video_url", "video_url": {"url": url}},
                                           {"type": "text", "text": QUESTION}])  # fmt: skip
    assert expected.strip()
    assert page.locator(".message.assistant").last.inner_text().strip() == expected.strip()
    user = page.locator(".message.user").last
    assert user.locator("video").get_attribute("src") == url  # the clip stays in the history
    assert user.inner_text().strip() == QUESTION
    assert page.locator("#attachments .preview").count() == 0

    # an image in the next turn still works: the server's answer for the whole conversation
    page.set_input_files("#file-input", str(IMAGE))
    page.wait_for_selector("#attachments .preview img")
    image_url = page.locator("#attachments .preview img").get_attribute("src")
    page.fill("#message", "And this?")
    page.click("#send")
    page.wait_for_function("document.querySelectorAll('.message.assistant:not(.streaming)').length === 2")
    first = page.locator(".message.assistant").first.inner_text().strip()
    body = {"model": "qwen", "max_tokens": MAX_TOKENS, "temperature": 0, "messages": [
        {"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                     {"type": "text", "text": QUESTION}]},
        {"role": "assistant", "content": first},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}},
                                     {"type": "text", "text": "And this?"}]}]}  # fmt: skip
    response = httpx.post(qwen_server + "/v1/chat/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
    assert response.status_code == 200, response.text
    second = response.json()["choices"][0]["message"]["content"]
    assert page.locator(".message.assistant").last.inner_text().strip() == second.strip()


def test_a_video_the_model_cannot_take_is_shown_and_the_chat_goes_on(server, page, clip):
    open_with_key(page, server[0])  # the demo model takes images only
    page.set_input_files("#file-input", str(clip))
    page.wait_for_selector("#attachments .preview video")
    page.fill("#message", "Describe the image.")
    page.click("#send")
    page.wait_for_selector("#error:not([hidden])")
    assert "does not support video" in page.inner_text("#error")
    # the failed turn is gone, its text and clip are back in the composer to fix
    assert page.locator(".message").count() == 0
    assert page.input_value("#message") == "Describe the image."
    assert page.locator("#attachments .preview video").count() == 1

    page.click("#attachments .preview.video button")  # remove the clip, attach an image instead
    page.set_input_files("#file-input", str(IMAGE))
    page.wait_for_selector("#attachments .preview img")
    page.click("#send")
    page.wait_for_selector(".message.assistant:not(.streaming)")
    assert page.locator(".message.assistant").last.inner_text().strip() == CAPTION
    assert page.is_hidden("#error") and page.locator("#attachments .preview").count() == 0


# ---- recordings ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def audio_server(tmp_path_factory):
    """A server (API key required) over a tiny Qwen2-Audio, which hears, and a WAV recording."""
    from tessera.engine.async_engine import AsyncEngine
    from tessera.engine.llm_engine import LLMEngine
    from tessera.entrypoints.openai.api_server import ServerThread, build_app
    from tessera.multimodal.media import MediaPolicy
    from testkit.audio import random_audio, wav_bytes
    from testkit.qwen2_audio import build_tiny_qwen2_audio

    folder = build_tiny_qwen2_audio(tmp_path_factory.mktemp("qwen2_audio_page"))
    recording = tmp_path_factory.mktemp("recordings") / "note.wav"
    recording.write_bytes(wav_bytes(random_audio(1.5, seed=9)))
    engine = AsyncEngine(LLMEngine.from_options(str(folder), kv_cache_memory="8MiB"))
    try:
        with ServerThread(build_app(engine, model_name="ear", api_key=API_KEY, media_policy=MediaPolicy())) as url:
            yield url, recording
    finally:
        engine.shutdown()


def test_attach_a_recording_and_see_the_servers_answer(audio_server, page):
    import base64

    url, recording = audio_server
    open_with_key(page, url, "ear")
    page.fill("#max-tokens", str(MAX_TOKENS))
    page.set_input_files("#file-input", str(recording))
    page.wait_for_selector("#attachments .preview audio")  # a player and the file's name, before sending
    assert page.inner_text("#attachments .preview .name") == "note.wav"
    page.fill("#message", "What is said?")
    page.click("#send")
    page.wait_for_selector(".message.assistant:not(.streaming)")
    assert page.is_hidden("#error"), page.inner_text("#error")

    user = page.locator(".message.user").last
    src = user.locator("audio").get_attribute("src")  # the recording stays in the history, its bytes as they are
    head, payload = src.split(",", 1)
    assert head.startswith("data:audio/") and base64.b64decode(payload) == recording.read_bytes()
    body = {"model": "ear", "max_tokens": MAX_TOKENS, "temperature": 0, "messages": [
        {"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": src}},
                                     {"type": "text", "text": "What is said?"}]}]}  # fmt: skip
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
    assert response.status_code == 200, response.text
    expected = response.json()["choices"][0]["message"]["content"]
    assert expected.strip() and page.locator(".message.assistant").last.inner_text().strip() == expected.strip()


def test_a_recording_the_model_cannot_hear_is_shown_and_the_chat_goes_on(server, audio_server, page):
    open_with_key(page, server[0])  # the demo model takes images only
    page.set_input_files("#file-input", str(audio_server[1]))
    page.wait_for_selector("#attachments .preview audio")
    page.fill("#message", "Describe the image.")
    page.click("#send")
    page.wait_for_selector("#error:not([hidden])")
    assert "does not support audio" in page.inner_text("#error")
    assert page.locator(".message").count() == 0 and page.locator("#attachments .preview audio").count() == 1
    page.click("#attachments .preview.audio button")
    page.set_input_files("#file-input", str(IMAGE))
    page.wait_for_selector("#attachments .preview img")
    page.click("#send")
    page.wait_for_selector(".message.assistant:not(.streaming)")
    assert page.locator(".message.assistant").last.inner_text().strip() == CAPTION
