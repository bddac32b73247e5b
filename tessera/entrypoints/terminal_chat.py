"""The terminal side of `tessera generate` and `tessera chat`: user messages of the files given, answers streamed
as the engine produces them, and the chat loop with its /image, /video, /audio, /reset and /exit commands."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Optional, TextIO

from ..multimodal.media import LOCAL_FILES, load_audio_url, load_image_url, load_video_url
from ..sampling_params import SamplingParams


def user_message(text: str, images: Sequence[str], videos: Sequence[str] = (), audios: Sequence[str] = ()) -> dict:
    media = [("image", p) for p in images] + [("video", p) for p in videos] + [("audio", p) for p in audios]
    return _message_with_media(text, media)


def _message_with_media(text: str, media: Sequence[tuple[str, str]]) -> dict:
    """A user message of the ("image" | "video" | "audio", path) media in the order given, then the text."""
    parts: list[dict] = []
    for kind, path in media:
        if not Path(path).is_file():
            raise ValueError(f"{kind.capitalize()} file {path} does not exist.")
        parts.append({"type": f"{kind}_url", f"{kind}_url": {"url": str(Path(path).resolve())}})
    parts.append({"type": "text", "text": text})
    return {"role": "user", "content": parts}


def stream_chat(
    llm: Any, messages: list[dict], params: SamplingParams, media_io_kwargs: Optional[dict] = None
) -> Iterator[str]:
    """Yield the reply to `messages` piece by piece as the engine produces it."""
    printed = 0
    prompt = llm.render_chat(messages, plain_fallback=True, media_io_kwargs=media_io_kwargs)
    for output in llm.stream(prompt, params):
        if output.error is not None:
            raise RuntimeError(output.error)
        text = output.outputs[0].text
        if len(text) > printed:
            yield text[printed:]
            printed = len(text)


def stream_answer(
    llm: Any, messages: list[dict], params: SamplingParams, out: TextIO, media_io_kwargs: Optional[dict] = None
) -> str:
    answer = ""
    for piece in stream_chat(llm, messages, params, media_io_kwargs):
        if not answer:  # the reply usually starts with the space after "ASSISTANT:"; don't print it
            piece = piece.lstrip()
        answer += piece
        out.write(piece)
        out.flush()
    out.write("\n")
    return answer


def _check_media_file(kind: str, path: str, media_io_kwargs: Optional[dict]) -> None:
    """Load the image, video or recording at `path` as the turn will (videos sampled as `media_io_kwargs`
    say), so that a bad file is refused when attached, not mid-turn. ValueError (InputError) if it fails."""
    url = str(Path(path).resolve())
    if kind == "image":
        load_image_url(url, LOCAL_FILES)
    elif kind == "audio":
        load_audio_url(url, LOCAL_FILES)
    else:
        load_video_url(url, LOCAL_FILES, **(media_io_kwargs or {}).get("video", {}))


def chat_loop(
    llm: Any, params: SamplingParams, stdin: TextIO, out: TextIO, media_io_kwargs: Optional[dict] = None
) -> None:
    history: list[dict] = []
    attached: list[tuple[str, str]] = []  # ("image" | "video" | "audio", path) for the next message, in order
    out.write(
        "Chat with the model. /image PATH attaches an image, /video PATH a video, /audio PATH a recording, "
        "/reset clears the history, /exit quits.\n"
    )
    while True:
        out.write("> ")
        out.flush()
        line = stdin.readline()
        if not line or line.strip() in ("/exit", "/quit"):
            return
        line = line.strip()
        if not line:
            continue
        if line == "/reset":
            history, attached = [], []
            out.write("(history cleared)\n")
            continue
        command = line.split(maxsplit=1)[0]
        if command in ("/image", "/video", "/audio"):
            kind, path = command[1:], line[len(command) :].strip()
            if not path:
                out.write(f"(usage: {command} PATH)\n")
                continue
            try:
                _check_media_file(kind, path, media_io_kwargs)  # refuse a bad file now, not mid-turn
            except ValueError as e:
                out.write(f"(not attached: {e})\n")
            else:
                attached.append((kind, path))
                out.write(f"(attached {path})\n")
            continue
        turn = len(history)
        try:
            history.append(_message_with_media(line, attached))
            answer = stream_answer(llm, history, params, out, media_io_kwargs)
        except Exception as e:  # e.g. too many images: report it in one line, drop the turn, keep chatting
            del history[turn:]
            out.write(f"(error: {e})\n")
            continue
        finally:
            attached = []
        history.append({"role": "assistant", "content": answer})
