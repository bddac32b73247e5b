"""Video through the offline API and the CLI: video_url parts loaded (sampled as media_io_kwargs
say) and placed beside the images; a model that takes no videos refuses them by name. The tiny
LLaVA takes no videos, so the tests that need one give its preprocessor a video placeholder and
stop before the model (the end-to-end run waits for a video model)."""

from __future__ import annotations

import io
import json

import pytest

from tessera import LLM
from tessera.entrypoints.cli import build_parser, main
from tessera.errors import InputError
from tessera.multimodal.video import VideoFrames
from testkit import random_images, video_bytes


@pytest.fixture(scope="module")
def llm(tiny_llava_dir):
    return LLM(str(tiny_llava_dir), kv_cache_memory="64MiB")


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """16 frames at 8 fps: 2 seconds."""
    folder = tmp_path_factory.mktemp("videos")
    random_images([(40, 30)], seed=3)[0].save(folder / "scene.png")
    path = folder / "clip.mp4"
    video_bytes(num_frames=16, fps=8, path=path)
    return path


@pytest.fixture
def takes_video(llm, monkeypatch):
    monkeypatch.setattr(llm.engine.input_preprocessor, "video_placeholder", lambda i: f"<video{i}>")
    return llm


def video_message(*urls, image=None):
    parts = [{"type": "image_url", "image_url": {"url": image}}] if image else []
    parts += [{"type": "video_url", "video_url": {"url": str(url)}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What happens?"}]}]


def test_a_model_without_video_refuses_video_parts_by_name(llm, clip):
    with pytest.raises(InputError, match="does not support video"):
        llm.chat(video_message(clip), use_tqdm=False)


def test_video_data_in_a_prompt_reaches_the_processor(llm, clip):
    from tessera.multimodal.media import LOCAL_FILES, load_video_url

    frames = load_video_url(str(clip), LOCAL_FILES, num_frames=2)
    with pytest.raises(ValueError, match="does not support video"):  # the LLaVA processor's answer
        llm.generate({"prompt": "Hi", "multi_modal_data": {"video": frames}}, use_tqdm=False)


@pytest.mark.parametrize("io_kwargs, frames", [(None, 16), ({"video": {"num_frames": 4}}, 4),
                                               ({"video": {"fps": 1}}, 2)])  # fmt: skip
def test_videos_load_in_order_beside_images_as_media_io_kwargs_say(takes_video, clip, io_kwargs, frames):
    image = str(clip.parent / "scene.png")
    prompt = takes_video.render_chat(video_message(clip, "file://" + str(clip), image=image), media_io_kwargs=io_kwargs)
    videos = prompt["multi_modal_data"]["video"]
    assert len(prompt["multi_modal_data"]["image"]) == 1 and len(videos) == 2
    assert all(isinstance(v, VideoFrames) and v.num_frames == frames for v in videos)


def test_chat_passes_media_io_kwargs_to_the_loader(takes_video, clip, monkeypatch):
    monkeypatch.setattr(takes_video, "generate", lambda prompts, *args, **kwargs: prompts)
    (prompt,) = takes_video.chat(video_message(clip), media_io_kwargs={"video": {"num_frames": 3}})
    assert prompt["multi_modal_data"]["video"][0].num_frames == 3


@pytest.mark.parametrize("io_kwargs, message", [({"video": {"frames": 3}}, "unsupported option"),
                                                ({"audio": {}}, "unknown modality"),
                                                ({"video": {"num_frames": 0}}, "num_frames")])  # fmt: skip
def test_bad_media_io_kwargs_are_input_errors(takes_video, clip, io_kwargs, message):
    with pytest.raises(InputError, match=message):
        takes_video.render_chat(video_message(clip), media_io_kwargs=io_kwargs)


# ---- the CLI ---------------------------------------------------------------------------------------------


def run(argv):
    out = io.StringIO()
    return main(argv, stdin=io.StringIO(""), stdout=out), out.getvalue()


def test_video_is_repeatable_and_comes_after_the_images(monkeypatch, clip):
    from tessera.entrypoints import cli

    args = build_parser().parse_args(["generate", "Hi", "--video", "a.mp4", "--image", "i.png", "--video", "b.mp4",
                                      "--media-io-kwargs", '{"video": {"num_frames": 8}}'])  # fmt: skip
    assert (args.video, args.image) == (["a.mp4", "b.mp4"], ["i.png"])
    assert args.media_io_kwargs == {"video": {"num_frames": 8}}
    seen = {}

    class FakeLLM:
        def render_chat(self, messages, **options):
            seen.update(messages=messages, **options)
            return {"prompt": "x"}

        def stream(self, prompt, params):
            return iter(())

    monkeypatch.setattr(cli, "_load", lambda *args: FakeLLM())
    image = str(clip.parent / "scene.png")
    code, _ = run(["generate", "Hi", "--image", image, "--video", str(clip), "--video", str(clip),
                   "--media-io-kwargs", '{"video": {"fps": 2}}'])  # fmt: skip
    assert code == 0 and seen["media_io_kwargs"] == {"video": {"fps": 2}}
    kinds = [p["type"] for p in seen["messages"][0]["content"]]
    assert kinds == ["image_url", "video_url", "video_url", "text"]
    assert seen["messages"][0]["content"][1]["video_url"]["url"] == str(clip.resolve())


def test_a_missing_video_or_a_model_without_video_is_one_line(tiny_llava_dir, clip, capsys):
    code, _ = run(["generate", "Hi", "--video", "/no/such.mp4", "--model", str(tiny_llava_dir)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1] == "tessera: error: Video file /no/such.mp4 does not exist."
    code, _ = run(["generate", "Hi", "--video", str(clip), "--model", str(tiny_llava_dir)])
    err = capsys.readouterr().err
    assert code == 1 and "does not support video" in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_media_io_kwargs_are_checked_when_parsed(capsys, command):
    argv = [command, *(["Hi"] if command == "generate" else []), "--media-io-kwargs", '{"video": {"frames": 2}}']
    with pytest.raises(SystemExit) as exit:
        main(argv)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "--media-io-kwargs" in err and "unsupported option" in err


def test_serve_passes_media_io_kwargs_to_the_server(tiny_llava_dir, monkeypatch):
    from tessera.entrypoints.openai import api_server

    seen = {}
    monkeypatch.setattr(api_server, "serve", lambda model, **options: seen.update(options) or 0)
    given = {"video": {"num_frames": 8}}
    assert run(["serve", str(tiny_llava_dir), "--media-io-kwargs", json.dumps(given)])[0] == 0
    assert seen["media_io_kwargs"] == given
