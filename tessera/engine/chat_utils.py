"""OpenAI-style conversations to engine prompts, through the model's chat template.

Shared by `LLM.chat` and the server; they differ only in how an image or video URL is loaded (the
server restricts local files and fetches http(s) with limits). Image parts ("image_url",
"image_pil") and video parts ("video_url") become "image" and "video" items, each modality's in
the order of its parts, and `{"type": "image"}` / `{"type": "video"}` parts for the template."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Optional

import jinja2

from ..errors import InputError
from ..multimodal.embeds import ImageEmbedsRef
from ..special_tokens import adds_special_token
from .mistral_chat import mistral_common_tokenizer, render_mistral_chat

Message = Mapping[str, Any]
ImageLoader = Callable[[str], Any]
VideoLoader = Callable[[str], Any]
AudioLoader = Callable[[str], Any]
AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "opus", "webm", "m4a", "mp4", "aac")
Placeholder = Callable[[int], Optional[str]]


def media_url_of(part: Mapping[str, Any], kind: str) -> str:
    """The URL of an `image_url` or `video_url` content part (`kind` "image" or "video")."""
    value = part.get(f"{kind}_url")
    url = value.get("url") if isinstance(value, Mapping) else value
    if not isinstance(url, str) or not url:
        article = "An" if kind in ("image", "audio") else "A"
        raise InputError(
            f"{article} {kind}_url content part needs {{'{kind}_url': {{'url': 'data:{kind}/...;base64,...'}}}}."
        )
    return url


def no_video(url: str) -> Any:
    raise InputError("Video input (a video_url part) is not supported here; send images or text.")


def no_audio(url: str) -> Any:
    raise InputError("Audio input (an input_audio or audio_url part) is not supported here; send images or text.")


def audio_data_url(part: Mapping[str, Any], where: str) -> str:
    """An `input_audio` part ({"input_audio": {"data": <base64>, "format": "wav"}}, OpenAI's) as a data URL."""
    value = part.get("input_audio")
    data = value.get("data") if isinstance(value, Mapping) else None
    fmt = value.get("format") if isinstance(value, Mapping) else None
    if not isinstance(data, str) or not data:
        raise InputError(
            f"{where}: an input_audio part needs {{'input_audio': {{'data': <base64>, 'format': 'wav'}}}}."
        )
    if not isinstance(fmt, str) or fmt.lower() not in AUDIO_FORMATS:
        raise InputError(f"{where}.input_audio.format must be one of {', '.join(AUDIO_FORMATS)}, got {fmt!r}.")
    mime = {"mp3": "mpeg", "m4a": "mp4"}.get(fmt.lower(), fmt.lower())
    return f"data:audio/{mime};base64,{data}"


def parse_chat_messages(
    messages: Sequence[Message], load_image: ImageLoader, image_text: Optional[str] = None
) -> tuple[list[dict], list[Any]]:
    """(messages in the form HF chat templates take, the images in order of appearance). With
    `image_text` (a model whose template takes text only: `chat_placeholders_inline`) each message
    becomes one string with `image_text` where its images were. Malformed messages raise InputError."""
    hf_messages, images, _ = parse_chat_messages_with_uuids(messages, load_image, image_text)
    return hf_messages, images


def parse_chat_messages_with_uuids(
    messages: Sequence[Message], load_image: ImageLoader, image_text: Optional[str] = None
) -> tuple[list[dict], list[Any], list[Optional[str]]]:
    """As parse_chat_messages, with the images' ids aligned with them: an image part's "uuid"
    (vLLM's field, beside "image_url" or "image_pil"), None where a part has none. A video part
    is an InputError here (see parse_chat_media)."""
    hf_messages, media, uuids = parse_chat_media(messages, load_image, image_text)
    return hf_messages, media["image"], uuids["image"]


def parse_chat_media(
    messages: Sequence[Message],
    load_image: ImageLoader,
    image_text: Optional[str] = None,
    *,
    load_video: VideoLoader = no_video,
    load_audio: AudioLoader = no_audio,
) -> tuple[list[dict], dict[str, list[Any]], dict[str, list[Optional[str]]]]:
    """(HF messages, {"image": [...], "video": [...], "audio": [...]} loaded in order of appearance, their ids
    per modality). `load_video(url)` loads a video_url part's video, `load_audio(url)` an input_audio
    (as a data URL) or audio_url part's recording (by default both are refused); with `image_text`
    (text-only templates) videos and audio are refused."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InputError(f"messages must be a list of message objects, got {type(messages).__name__}.")
    media: dict[str, list[Any]] = {"image": [], "video": [], "audio": []}
    uuids: dict[str, list[Optional[str]]] = {"image": [], "video": [], "audio": []}
    images = media["image"]
    hf_messages = []
    for m, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InputError(f"messages[{m}] must be an object with 'role' and 'content', got {_kind(message)}.")
        role = message.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise InputError(f"messages[{m}]: unsupported role {role!r}; use 'system', 'user', 'assistant' or 'tool'.")
        extra = _tool_fields(message, f"messages[{m}]")  # tool_calls of an assistant, tool_call_id of a tool
        content = message.get("content")
        if isinstance(content, str) or content is None:
            text = content or ""
            hf_messages.append(
                {"role": role, "content": text if image_text is not None else [{"type": "text", "text": text}],
                 **extra}
            )  # fmt: skip
            continue
        if not isinstance(content, list):
            raise InputError(
                f"messages[{m}].content must be a string or a list of content parts, got {_kind(content)}."
            )
        parts = []
        for p, part in enumerate(content):
            where = f"messages[{m}].content[{p}]"
            if isinstance(part, str):  # a bare string is a text part (as vLLM takes it)
                part = {"type": "text", "text": part}
            if not isinstance(part, Mapping):
                raise InputError(f"{where} must be a string or an object with a 'type', got {_kind(part)}.")
            kind = part.get("type")
            if kind == "text":
                text = part.get("text")
                if not isinstance(text, (str, type(None))):
                    raise InputError(f"{where}.text must be a string, got {_kind(text)}.")
                parts.append({"type": "text", "text": text or ""})
            elif kind in ("image_url", "image_pil"):
                uuid = part.get("uuid")
                if not isinstance(uuid, (str, type(None))):
                    raise InputError(f"{where}.uuid must be a string (the image's id), got {_kind(uuid)}.")
                if kind == "image_url":
                    images.append(load_image(media_url_of(part, "image")))
                elif part.get("image_pil") is not None:  # an in-memory image (vLLM's part for the offline API)
                    images.append(part["image_pil"])
                else:
                    raise InputError(f"{where}: an image_pil part needs {{'image_pil': <PIL image>}}.")
                uuids["image"].append(uuid)
                parts.append({"type": "image"})
            elif kind == "image_embeds":  # precomputed (vLLM's part): the server decodes and checks them
                images.append(load_image(ImageEmbedsRef(part.get("image_embeds"))))
                uuids["image"].append(None)
                parts.append({"type": "image"})
            elif kind == "video_url":
                uuid = part.get("uuid")
                if not isinstance(uuid, (str, type(None))):
                    raise InputError(f"{where}.uuid must be a string (the video's id), got {_kind(uuid)}.")
                url = media_url_of(part, "video")
                if image_text is not None:
                    raise InputError("Video input is not supported by this model; send images or text.")
                media["video"].append(load_video(url))
                uuids["video"].append(uuid)
                parts.append({"type": "video"})
            elif kind in ("input_audio", "audio_url"):
                uuid = part.get("uuid")
                if not isinstance(uuid, (str, type(None))):
                    raise InputError(f"{where}.uuid must be a string (the audio's id), got {_kind(uuid)}.")
                url = audio_data_url(part, where) if kind == "input_audio" else media_url_of(part, "audio")
                if image_text is not None:
                    raise InputError("Audio input is not supported by this model; send images or text.")
                media["audio"].append(load_audio(url))
                uuids["audio"].append(uuid)
                parts.append({"type": "audio"})
            else:
                raise InputError(
                    f"{where}: unsupported content part type {kind!r}; use 'text', 'image_url', 'video_url', "
                    "'input_audio', 'audio_url' or 'image_embeds'."
                )
        if image_text is not None:
            text = "".join(image_text if p["type"] == "image" else p["text"] for p in parts)
            hf_messages.append({"role": role, "content": text, **extra})
        else:
            hf_messages.append({"role": role, "content": parts, **extra})
    return hf_messages, media, uuids


def _tool_fields(message: Message, where: str) -> dict:
    """The tool-calling fields of a message as HF chat templates take them: an assistant's
    `tool_calls` with each call's `function.arguments` a dict (OpenAI sends a JSON string), a tool
    message's `tool_call_id`, and a `name` where one is given."""
    fields: dict[str, Any] = {}
    role = message.get("role")
    name = message.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise InputError(f"{where}.name must be a string, got {_kind(name)}.")
        fields["name"] = name
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise InputError(f"{where}: a tool message needs 'tool_call_id' (a string), got {_kind(call_id)}.")
        fields["tool_call_id"] = call_id
    calls = message.get("tool_calls")
    if calls is None:
        return fields
    if role != "assistant":
        raise InputError(f"{where}: only assistant messages have 'tool_calls'.")
    if not isinstance(calls, list):
        raise InputError(f"{where}.tool_calls must be a list, got {_kind(calls)}.")
    fields["tool_calls"] = [_tool_call(call, f"{where}.tool_calls[{c}]") for c, call in enumerate(calls)]
    return fields


def _tool_call(call: Any, where: str) -> dict:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise InputError(f"{where} must be {{'type': 'function', 'function': {{'name': ..., 'arguments': '...'}}}}.")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError:
            raise InputError(f"{where}.function.arguments is not valid JSON.") from None
    if not isinstance(arguments, Mapping):
        raise InputError(f"{where}.function.arguments must be a JSON object, got {_kind(arguments)}.")
    converted = {"type": "function", "function": {"name": function["name"], "arguments": dict(arguments)}}
    if isinstance(call.get("id"), str):
        converted["id"] = call["id"]
    return converted


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__
    )


ContentFormat = Literal["auto", "string", "openai"]


@functools.lru_cache(maxsize=32)
def detect_content_format(chat_template: str) -> Literal["string", "openai"]:
    """How a chat template reads message content (vLLM's --chat-template-content-format auto):
    "openai" if it loops over `message['content']` (a list of parts, as LLaVA's does), else
    "string" (ChatML-style templates such as SmolLM2's and Qwen2.5's concatenate it)."""
    try:
        tree = jinja2.Environment().parse(chat_template)
    except jinja2.TemplateSyntaxError:
        return "string"
    for loop in tree.find_all(jinja2.nodes.For):
        target = loop.iter
        if isinstance(target, jinja2.nodes.Filter):  # e.g. `message['content'] | selectattr(...)`
            target = target.node
        if isinstance(target, jinja2.nodes.Getitem) and getattr(target.arg, "value", None) == "content":
            return "openai"
        if isinstance(target, jinja2.nodes.Getattr) and target.attr == "content":
            return "openai"
    return "string"


def as_string_content(
    hf_messages: list[dict],
    placeholder: Optional[Placeholder] = None,
    video_placeholder: Optional[Placeholder] = None,
    audio_placeholder: Optional[Placeholder] = None,
) -> list[dict]:
    """Messages with each content list joined into one string, as vLLM's "string" format: the
    model's placeholder for each of the message's images and videos first (in their order), then
    its texts, one per line."""
    joined, index = [], {"image": 0, "video": 0, "audio": 0}
    texts = {"image": placeholder, "video": video_placeholder, "audio": audio_placeholder}
    for message in hf_messages:
        content = message["content"]
        if isinstance(content, list):
            pieces = []
            for part in (p for p in content if p["type"] in index):
                kind = part["type"]
                text_of = texts[kind]
                pieces.append((text_of(index[kind]) if text_of else None) or "")
                index[kind] += 1
            pieces = [p for p in pieces if p] + [p["text"] for p in content if p["type"] == "text"]
            content = "\n".join(pieces)
        joined.append({**message, "content": content})
    return joined


def render_prompt(
    renderer: Any, chat_template: Optional[str], hf_messages: list[dict], images: list[Any],
    add_generation_prompt: bool = True, *, uuids: Optional[Sequence[Optional[str]]] = None,
    content_format: ContentFormat = "auto", placeholder: Optional[Placeholder] = None,
    videos: Sequence[Any] = (), video_uuids: Optional[Sequence[Optional[str]]] = None,
    video_placeholder: Optional[Placeholder] = None, tools: Optional[list[dict]] = None,
    audios: Sequence[Any] = (), audio_uuids: Optional[Sequence[Optional[str]]] = None,
    audio_placeholder: Optional[Placeholder] = None,
) -> dict:  # fmt: skip
    """The engine prompt for parsed messages and their loaded images and videos (and their ids, if
    any is named: "multi_modal_uuids"). Message content goes to the template as a list of parts or
    as one string, as the template expects (`content_format`; "auto" reads the template). `tools`
    (OpenAI function tools) go to the template's `tools` variable."""
    mistral = mistral_common_tokenizer(renderer)
    if mistral is not None:  # the chat format is mistral-common's code: token ids, not a template's text
        media = {"image": images, "video": videos, "audio": audios}
        return render_mistral_chat(mistral, hf_messages, media, {"audio": audio_uuids}, add_generation_prompt, tools)
    if chat_template is None:
        raise InputError("This model has no chat template; pass chat_template=... or use generate().")
    if content_format not in ("auto", "string", "openai"):
        raise InputError(f"chat_template_content_format must be 'auto', 'string' or 'openai', got {content_format!r}.")
    if (content_format == "auto" and detect_content_format(chat_template) == "string") or content_format == "string":
        hf_messages = as_string_content(hf_messages, placeholder, video_placeholder, audio_placeholder)
    options = {"tools": tools} if tools else {}  # as before for requests without tools
    prompt = renderer.apply_chat_template(
        hf_messages, chat_template=chat_template, add_generation_prompt=add_generation_prompt, tokenize=False,
        **options,
    )  # fmt: skip
    prompt = without_template_bos(renderer, prompt)
    media = {"image": images, "video": videos, "audio": audios}
    return with_media(prompt, media, {"image": uuids, "video": video_uuids, "audio": audio_uuids})


def with_media(
    prompt: str, media: Mapping[str, Sequence[Any]], uuids: Optional[Mapping[str, Optional[Sequence[Any]]]] = None
) -> dict:
    """{"prompt": prompt} with "multi_modal_data" for the modalities that have items, and
    "multi_modal_uuids" for those where an item is named."""
    engine_prompt: dict = {"prompt": prompt}
    data = {kind: list(items) for kind, items in media.items() if len(items)}
    if not data:
        return engine_prompt
    engine_prompt["multi_modal_data"] = data
    named = {
        kind: list(ids) for kind, ids in (uuids or {}).items()
        if kind in data and ids is not None and any(uuid is not None for uuid in ids)
    }  # fmt: skip
    if named:
        engine_prompt["multi_modal_uuids"] = named
    return engine_prompt


def without_template_bos(renderer: Any, prompt: str) -> str:
    """`prompt` (a rendered chat template) without its leading BOS when tokenizing it adds one too,
    so that the prompt holds one BOS, never two: as llama.cpp renders chats, and as HF's
    ``apply_chat_template(tokenize=True)`` tokenizes them (adding no special tokens)."""
    tokenizer = getattr(renderer, "tokenizer", None) or renderer
    bos = getattr(tokenizer, "bos_token", None)
    if not bos or not prompt.startswith(bos) or not adds_special_token(tokenizer):
        return prompt
    return prompt[len(bos) :]


def render_chat(
    renderer: Any,
    chat_template: Optional[str],
    messages: Sequence[Message],
    load_image: ImageLoader,
    add_generation_prompt: bool = True,
    image_text: Optional[str] = None,
    *,
    content_format: ContentFormat = "auto",
    placeholder: Optional[Placeholder] = None,
    load_video: VideoLoader = no_video,
    video_placeholder: Optional[Placeholder] = None,
    tools: Optional[list[dict]] = None,
    load_audio: AudioLoader = no_audio,
    audio_placeholder: Optional[Placeholder] = None,
) -> dict:
    """The engine prompt for a conversation: {"prompt": text, "multi_modal_data": {"image": [...],
    "video": [...], "audio": [...]}} (the modalities it has), with "multi_modal_uuids" when a part has a
    "uuid". `renderer` is the model's HF processor (or tokenizer for text-only models)."""
    hf_messages, media, uuids = parse_chat_media(
        messages, load_image, image_text, load_video=load_video, load_audio=load_audio
    )
    return render_prompt(renderer, chat_template, hf_messages, media["image"], add_generation_prompt,
                         uuids=uuids["image"], content_format=content_format, placeholder=placeholder,
                         videos=media["video"], video_uuids=uuids["video"],
                         video_placeholder=video_placeholder, tools=tools, audios=media["audio"],
                         audio_uuids=uuids["audio"], audio_placeholder=audio_placeholder)  # fmt: skip


def render_plain(
    messages: Sequence[Message],
    load_image: ImageLoader,
    placeholder: Optional[Placeholder],
    *,
    load_video: VideoLoader = no_video,
    video_placeholder: Optional[Placeholder] = None,
    load_audio: AudioLoader = no_audio,
    audio_placeholder: Optional[Placeholder] = None,
) -> dict:
    """For a model without a chat template (e.g. Fuyu, a base audio model, or a text model given eyes by a plugin):
    the last message as it is, its text parts joined by spaces after its media's placeholders."""
    parts = messages[-1]["content"]
    if isinstance(parts, str):
        parts = [{"type": "text", "text": parts}]
    text = " ".join(p["text"] for p in parts if p["type"] == "text")
    kinds = {"image_url": ("image", placeholder), "video_url": ("video", video_placeholder),
             "audio_url": ("audio", audio_placeholder), "input_audio": ("audio", audio_placeholder)}  # fmt: skip
    urls: dict[str, list[str]] = {"image": [], "video": [], "audio": []}
    prefix = ""
    for part in parts:
        if part["type"] not in kinds:
            continue
        kind, text_of = kinds[part["type"]]
        prefix += (text_of(len(urls[kind])) if text_of else None) or ""
        where = "the last message"
        urls[kind].append(audio_data_url(part, where) if part["type"] == "input_audio" else media_url_of(part, kind))
    loaders = {"image": load_image, "video": load_video, "audio": load_audio}
    return with_media(prefix + text, {kind: [loaders[kind](url) for url in found] for kind, found in urls.items()})
