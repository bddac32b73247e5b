"""Video parts in chat messages: `video_url` parts become "video" items beside the images, each
modality in the order of its parts, with the model's placeholder text for videos."""

from __future__ import annotations

import pytest

from tessera.engine.chat_utils import parse_chat_media, parse_chat_messages_with_uuids, render_chat, render_plain
from tessera.errors import InputError
from testkit import CHATML_TEMPLATE, build_tokenizer

MIXED = [{"role": "user", "content": [
    {"type": "video_url", "video_url": {"url": "v1"}, "uuid": "clip"},
    {"type": "image_url", "image_url": {"url": "i1"}},
    {"type": "text", "text": "Compare."},
    {"type": "video_url", "video_url": "v2"},
    {"type": "image_url", "image_url": {"url": "i2"}},
]}]  # fmt: skip


def load_image(url):
    return f"image:{url}"


def load_video(url):
    return f"video:{url}"


def test_video_parts_are_items_in_order_beside_the_images():
    hf, media, uuids = parse_chat_media(MIXED, load_image, load_video=load_video)
    assert media == {"image": ["image:i1", "image:i2"], "video": ["video:v1", "video:v2"], "audio": []}
    assert uuids == {"image": [None, None], "video": ["clip", None], "audio": []}
    assert [p["type"] for p in hf[0]["content"]] == ["video", "image", "text", "video", "image"]


def test_string_content_gets_each_modalitys_placeholders_in_part_order():
    tokenizer = build_tokenizer("llava")
    prompt = render_chat(tokenizer, CHATML_TEMPLATE, MIXED, load_image, load_video=load_video,
                         placeholder=lambda i: f"<image{i}>", video_placeholder=lambda i: f"<video{i}>")  # fmt: skip
    assert "<video0>\n<image0>\n<video1>\n<image1>\nCompare." in prompt["prompt"]
    assert prompt["multi_modal_data"] == {"image": ["image:i1", "image:i2"], "video": ["video:v1", "video:v2"]}
    assert prompt["multi_modal_uuids"] == {"video": ["clip", None]}


def test_a_video_only_prompt_has_no_image_list():
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "v"}}, "What happens?"]}]
    prompt = render_chat(build_tokenizer("llava"), CHATML_TEMPLATE, messages, load_image, load_video=load_video,
                         video_placeholder=lambda i: "<video>")  # fmt: skip
    assert prompt["multi_modal_data"] == {"video": ["video:v"]} and "multi_modal_uuids" not in prompt
    assert "<video>\nWhat happens?" in prompt["prompt"]


def test_plain_rendering_puts_the_placeholders_first_in_part_order():
    prompt = render_plain(MIXED, load_image, lambda i: "<I>", load_video=load_video,
                          video_placeholder=lambda i: "<V>")  # fmt: skip
    media = {"image": ["image:i1", "image:i2"], "video": ["video:v1", "video:v2"]}
    assert prompt == {"prompt": "<V><I><V><I>Compare.", "multi_modal_data": media}


@pytest.mark.parametrize(
    "call",
    [
        lambda: parse_chat_messages_with_uuids(MIXED, load_image),  # the image-only API refuses videos
        lambda: parse_chat_media(MIXED, load_image),
        lambda: parse_chat_media(MIXED, load_image, "<I>", load_video=load_video),  # a text-only template: images only
    ],
)
def test_videos_are_refused_where_they_are_not_taken(call):
    with pytest.raises(InputError, match="[Vv]ideo"):
        call()


@pytest.mark.parametrize("part", [{"type": "video_url"}, {"type": "video_url", "video_url": {"url": ""}},
                                  {"type": "video_url", "video_url": {"url": "v"}, "uuid": 3}])  # fmt: skip
def test_malformed_video_parts_say_what_is_wrong(part):
    with pytest.raises(InputError, match="video"):
        parse_chat_media([{"role": "user", "content": [part]}], load_image, load_video=load_video)
