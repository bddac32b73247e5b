"""OpenAI-style messages to HF chat-template messages: every malformed shape is an InputError
that says where it is; the shapes vLLM accepts are accepted."""

from __future__ import annotations

import pytest

from tessera.engine.chat_utils import parse_chat_messages, parse_chat_messages_with_uuids, render_prompt
from tessera.errors import InputError
from testkit import CHATML_TEMPLATE


def parse(messages, image_text=None):
    return parse_chat_messages(messages, lambda url: f"loaded:{url}", image_text)


def test_text_and_image_parts_in_order():
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "image_url", "image_url": {"url": "u1"}},
                                             {"type": "image_url", "image_url": "u2"}]}]  # fmt: skip
    hf, images = parse(messages)
    assert images == ["loaded:u1", "loaded:u2"]
    assert hf == [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "image"}]}]


def test_plain_strings_in_a_content_list_are_text_parts():
    hf, _ = parse([{"role": "user", "content": ["How many", " shapes?"]}])
    assert hf[0]["content"] == [{"type": "text", "text": "How many"}, {"type": "text", "text": " shapes?"}]


def test_a_text_only_template_gets_each_message_as_one_string():
    hf, images = parse([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}, "Hi"]}], "<I>")
    assert hf == [{"role": "user", "content": "<I>Hi"}] and images == ["loaded:u"]


@pytest.mark.parametrize(
    "messages, where",
    [
        ("hello", "messages must be a list"),
        ([42], r"messages\[0\] must be an object"),
        ([{"role": "robot", "content": "x"}], r"messages\[0\]: unsupported role 'robot'"),
        ([{"role": "user", "content": {"text": "x"}}], r"messages\[0\]\.content must be a string or a list.*an object"),
        ([{"role": "user", "content": 7}], r"messages\[0\]\.content must be .*a number"),
        ([{"role": "user", "content": ["ok", 3]}], r"messages\[0\]\.content\[1\] must be a string or an object"),
        ([{"role": "user", "content": [{"type": "text", "text": 5}]}], r"content\[0\]\.text must be a string"),
        ([{"role": "user", "content": [{"type": "file"}]}], r"content\[0\]: unsupported content part type"),
        ([{"role": "user", "content": [{"type": "audio_url"}]}], "An audio_url content part needs"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "image_url content part needs"),
        ([{"role": "user", "content": [{"type": "image_pil"}]}], r"content\[0\]: an image_pil part needs"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}, "uuid": 7}]}],
            r"content\[0\]\.uuid must be a string \(the image's id\), got a number",
        ),
    ],
)
def test_malformed_messages_say_what_and_where(messages, where):
    with pytest.raises(InputError, match=where):
        parse(messages)


# ---- image ids (vLLM's "uuid" beside the image) --------------------------------------------------------


def test_image_ids_are_aligned_with_the_images():
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "u1"}, "uuid": "first"},
                "and",
                {"type": "image_url", "image_url": "u2"},
            ],
        },
        {"role": "assistant", "content": "ok"},
        {
            "role": "user",
            "content": [
                {"type": "image_pil", "image_pil": "<pil>", "uuid": "third"},
                {"type": "image_url", "image_url": {"url": "u4"}, "uuid": None},
            ],
        },
    ]
    hf, images, uuids = parse_chat_messages_with_uuids(messages, lambda url: f"loaded:{url}")
    assert images == ["loaded:u1", "loaded:u2", "<pil>", "loaded:u4"]
    assert uuids == ["first", None, "third", None]
    assert (hf, images) == parse(messages)  # the two-value form is unchanged


class Renderer:
    def apply_chat_template(self, messages, *, chat_template, add_generation_prompt, tokenize):
        return chat_template + "|" + "".join(p["type"][0] for m in messages for p in m["content"])


@pytest.mark.parametrize(
    "uuids, expected",
    [
        (None, None),
        ([None, None], None),  # nothing named: nothing to pass
        (["a", None], {"image": ["a", None]}),
    ],
)
def test_render_prompt_adds_the_ids_when_an_image_is_named(uuids, expected):
    hf = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}, {"type": "image"}]}]
    prompt = render_prompt(Renderer(), "T", hf, ["img1", "img2"], uuids=uuids, content_format="openai")
    assert prompt["prompt"] == "T|iti" and prompt["multi_modal_data"] == {"image": ["img1", "img2"]}
    assert prompt.get("multi_modal_uuids") == expected


# ---- template content formats (vLLM's --chat-template-content-format) -------------------------------------

CHATML = CHATML_TEMPLATE
PARTS_LOOP = "{% for message in messages %}{% for part in message.content %}{{ part['text'] }}{% endfor %}{% endfor %}"


@pytest.mark.parametrize(
    "template, expected",
    [(CHATML, "string"), (PARTS_LOOP, "openai"), ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
     ("{% for c in message['content'] | selectattr('type', 'equalto', 'image') %}<image>{% endfor %}", "openai"),
     ("{% for x in %}", "string")],
)  # fmt: skip
def test_the_content_format_is_read_from_the_template(template, expected):
    from tessera.engine.chat_utils import detect_content_format

    assert detect_content_format(template) == expected


def test_string_content_puts_image_placeholders_first_then_the_texts_one_per_line():
    from tessera.engine.chat_utils import as_string_content

    hf, _ = parse(
        [{"role": "user", "content": ["What is", {"type": "image_url", "image_url": "a"}, "this?"]},
         {"role": "assistant", "content": "A cat."},
         {"role": "user", "content": [{"type": "image_url", "image_url": "b"}, "And this?"]}]
    )  # fmt: skip
    joined = as_string_content(hf, lambda i: f"<image{i}>")
    assert [m["content"] for m in joined] == ["<image0>\nWhat is\nthis?", "A cat.", "<image1>\nAnd this?"]


def test_a_chatml_template_renders_string_content_as_hf_does():
    """ChatML-style templates concatenate content: given parts, jinja raises TypeError (the crash
    SmolLM2 users hit); rendered as strings, the prompt is what HF renders for string messages."""
    from tessera.engine.chat_utils import render_prompt
    from testkit import build_tokenizer

    tokenizer = build_tokenizer("llava")
    hf, _ = parse([{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}])
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], chat_template=CHATML, add_generation_prompt=True, tokenize=False
    )
    assert render_prompt(tokenizer, CHATML, hf, [])["prompt"] == expected
    with pytest.raises(TypeError):
        render_prompt(tokenizer, CHATML, hf, [], content_format="openai")


def test_audio_parts_become_audio_items_or_are_refused():
    from tessera.engine.chat_utils import parse_chat_media

    messages = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "mp3"}},
        {"type": "audio_url", "audio_url": {"url": "file.wav"}, "uuid": "a2"}, "Compare."]}]  # fmt: skip
    hf, media, uuids = parse_chat_media(messages, lambda url: url, load_audio=lambda url: f"audio:{url}")
    assert hf[0]["content"][:2] == [{"type": "audio"}, {"type": "audio"}]
    assert media["audio"] == ["audio:data:audio/mpeg;base64,UklGRg==", "audio:file.wav"]
    assert uuids["audio"] == [None, "a2"]
    with pytest.raises(InputError, match="Audio input .* is not supported here"):
        parse_chat_media(messages, lambda url: url)  # no loader: this entry point takes no audio
    with pytest.raises(InputError, match="Audio input is not supported by this model"):
        parse_chat_media(messages, lambda url: url, "<I>", load_audio=lambda url: url)  # a text-only template
