"""OpenAI-style conversations to engine prompts, through the model's chat template.

Shared by `LLM.chat` and the server; they differ only in how an image URL is loaded (the server
restricts local files and fetches http(s) with limits)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

Message = Mapping[str, Any]
ImageLoader = Callable[[str], Any]


def image_url_of(part: Mapping[str, Any]) -> str:
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, Mapping) else value
    if not isinstance(url, str) or not url:
        raise ValueError("An image_url content part needs {'image_url': {'url': 'data:image/...;base64,...'}}.")
    return url


def parse_chat_messages(
    messages: Sequence[Message], load_image: ImageLoader, image_text: Optional[str] = None
) -> tuple[list[dict], list[Any]]:
    """(messages in the form HF chat templates take, the images in order of appearance). With
    `image_text` (pipeline mode: a text model's template knows no images) each message becomes
    one string with `image_text` where its images were."""
    images: list[Any] = []
    hf_messages = []
    for message in messages:
        role = message.get("role")
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"Unsupported message role {role!r}; use 'system', 'user' or 'assistant'.")
        content = message.get("content")
        if isinstance(content, str) or content is None:
            text = content or ""
            hf_messages.append(
                {"role": role, "content": text if image_text is not None else [{"type": "text", "text": text}]}
            )
            continue
        parts = []
        for part in content:
            kind = part.get("type")
            if kind == "text":
                parts.append({"type": "text", "text": part.get("text") or ""})
            elif kind == "image_url":
                images.append(load_image(image_url_of(part)))
                parts.append({"type": "image"})
            elif kind == "image_pil":  # an in-memory image (vLLM's part type for the offline API)
                images.append(part["image_pil"])
                parts.append({"type": "image"})
            else:
                raise ValueError(f"Unsupported content part type {kind!r}; use 'text', 'image_url' or 'image_pil'")
        if image_text is not None:
            text = "".join(image_text if p["type"] == "image" else p["text"] for p in parts)
            hf_messages.append({"role": role, "content": text})
        else:
            hf_messages.append({"role": role, "content": parts})
    return hf_messages, images


def render_chat(
    renderer: Any,
    chat_template: Optional[str],
    messages: Sequence[Message],
    load_image: ImageLoader,
    add_generation_prompt: bool = True,
    image_text: Optional[str] = None,
) -> dict:
    """The engine prompt for a conversation: {"prompt": text, "multi_modal_data": {"image": [...]}}.
    `renderer` is the model's HF processor (or tokenizer for text-only models)."""
    hf_messages, images = parse_chat_messages(messages, load_image, image_text)
    if chat_template is None:
        raise ValueError("This model has no chat template; pass chat_template=... or use generate().")
    prompt = renderer.apply_chat_template(
        hf_messages, chat_template=chat_template, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    return {"prompt": prompt, "multi_modal_data": {"image": images}} if images else {"prompt": prompt}
