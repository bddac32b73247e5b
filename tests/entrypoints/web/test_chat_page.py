"""The web chat page in headless Chromium (Playwright driving the system `chromium`): upload an
image, ask the bundled model about it, see the streamed answer and the image in the history."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from examples import make_example_images
from tessera.testing.server import API_KEY
from tools import demo_data

REPO = Path(__file__).resolve().parents[3]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (make test installs it with apt)")

IMAGE = REPO / "examples" / "three_shapes.png"
CAPTION = demo_data.describe(make_example_images.SCENES["three_shapes.png"])


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


def open_with_key(page, url: str) -> None:
    """Load the page and enter the server's API key in the settings, as a user would."""
    page.goto(url + "/")
    page.click("#settings summary")
    page.fill("#api-key", API_KEY)
    page.dispatch_event("#api-key", "change")
    page.wait_for_selector("#model-name:has-text('demo')")


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
    expected = demo_data.NUMBER_WORDS[len(make_example_images.SCENES["three_shapes.png"])]
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
