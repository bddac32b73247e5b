"""Inline `<img src=...>` tags in prompts (the text-generation-webui format)."""

from __future__ import annotations

from tessera.multimodal.inline_images import inline_images_to_prompt, split_inline_images


def test_split_keeps_text_and_images_in_order():
    text = 'A <img src="data:image/png;base64,AAA"> and <IMG alt="x" src=\'data:image/jpeg;base64,BBB\' /> end'
    assert split_inline_images(text) == [
        ("text", "A "),
        ("image", "data:image/png;base64,AAA"),
        ("text", " and "),
        ("image", "data:image/jpeg;base64,BBB"),
        ("text", " end"),
    ]


def test_text_without_tags_is_one_part():
    assert split_inline_images("no images <b>here</b>") == [("text", "no images <b>here</b>")]


def test_each_tag_becomes_the_placeholder_and_images_load_in_order():
    loaded = []
    prompt = inline_images_to_prompt(
        'USER: <img src="one">\n<img src="two"> Compare. ASSISTANT:',
        placeholder=lambda i: "<image>",
        load_image=lambda src: loaded.append(src) or src.upper(),
    )
    assert prompt == {
        "prompt": "USER: <image>\n<image> Compare. ASSISTANT:",
        "multi_modal_data": {"image": ["ONE", "TWO"]},
    }
    assert loaded == ["one", "two"]


def test_a_model_that_places_images_itself_gets_the_tags_removed():
    prompt = inline_images_to_prompt('<img src="a">Describe.', placeholder=None, load_image=str)
    assert prompt == {"prompt": "Describe.", "multi_modal_data": {"image": ["a"]}}


def test_no_tags_no_multimodal_data():
    assert inline_images_to_prompt("Hello", placeholder=lambda i: "<image>", load_image=str) == {"prompt": "Hello"}


def test_an_img_tag_without_src_or_closing_stays_text():
    text = 'a <img alt="x"> b <img src="unterminated'
    assert split_inline_images(text) == [("text", text)]


def test_hostile_unterminated_tags_are_text_and_scan_in_linear_time():
    """Each of these takes a backtracking regex minutes (quadratic); a linear scan, milliseconds."""
    for text in ['<img src="' + 'x"' * 200_000, '<img src="' * 200_000]:
        assert split_inline_images(text) == [("text", text)]
    text = '<img src="a" ' * 100_000 + ">"  # one long tag: its first src counts
    assert split_inline_images(text) == [("image", "a")]
