"""The `tessera` command: ask a model about images, videos and audio from the shell, or chat with it.

tessera generate "What colour is the circle?" --image photo.png
tessera generate "What happens?" --video clip.mp4 --media-io-kwargs '{"video": {"num_frames": 8}}'
tessera generate "What is said?" --audio note.mp3 --model path/to/audio-model
tessera transcribe note.mp3 --model path/to/audio-model
tessera chat --model path/to/model  (then /image, /video or /audio PATH attaches media to the next message)
tessera chat path/to/model.gguf
tessera serve model.gguf --mmproj mmproj-model.gguf  (llama.cpp's vision pair, as llama-server takes it)
tessera bench serve --base-url http://127.0.0.1:8000 --dataset random-mm --num-prompts 100 --max-concurrency 8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, TextIO

from ..config import AUTO_QUANTIZATION, DISTRIBUTED_EXECUTOR_BACKENDS, QUANTIZATION_METHODS
from ..gguf_file import find_gguf_file
from ..multimodal.media import (
    MediaPolicy,
    check_media_io_kwargs,
)
from ..plugins import add_plugin_cli_arguments, plugin_options_from_cli
from ..sampling_params import SamplingParams
from . import bench_serve as bench_serve_module
from .terminal_chat import chat_loop, stream_answer, user_message


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description="Run vision-language models locally.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    generate = commands.add_parser("generate", help="answer one prompt (with images) and exit",
                                   description="Answer one prompt, streaming the answer to stdout.")  # fmt: skip
    generate.add_argument("prompt", help="the question or instruction")
    generate.add_argument("--image", action="append", default=[], metavar="PATH", help="an image (repeatable)")
    generate.add_argument("--video", action="append", default=[], metavar="PATH",
                          help="a video, after the images (repeatable)")  # fmt: skip
    generate.add_argument("--audio", action="append", default=[], metavar="PATH",
                          help="a recording (WAV, FLAC, MP3, OGG, M4A), after the videos (repeatable)")  # fmt: skip
    _common_options(generate)

    transcribe = commands.add_parser("transcribe", help="print what a recording says",
                                     description="Transcribe recordings with an audio model, as "
                                     "/v1/audio/transcriptions does.")  # fmt: skip
    transcribe.add_argument("audio", nargs="+", metavar="PATH", help="a recording (WAV, FLAC, MP3, OGG, M4A)")
    transcribe.add_argument("--language", default=None, help="what the speech is in: an ISO 639-1 code or a name")
    transcribe.add_argument("--prompt", default="", help="text the transcript continues")
    _common_options(transcribe)

    chat_help = ("Chat with the model. Commands: /image PATH attaches an image, /video PATH a video (sampled as "
                 "--media-io-kwargs say) and /audio PATH a recording to the next message, in the order given; "
                 "/reset clears the history, /exit quits.")  # fmt: skip
    chat = commands.add_parser("chat", help="chat in the terminal", description=chat_help)
    _model_argument(chat)
    _common_options(chat)

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible API and the web chat page",
                                description="Serve /v1/chat/completions, /v1/completions, /v1/models, /tokenize, "
                                "/health, /metrics and a chat page at /.")  # fmt: skip
    _model_argument(serve)
    serve.add_argument("--model", default=None, metavar="MODEL", help=MODEL_HELP)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* and /tokenize")
    serve.add_argument("--allowed-local-media-path", "--allowed-media-dir", dest="allowed_media_dir", default=None,
                       metavar="DIR", help="read local image files (file:// URLs or paths) inside this folder; "
                       "by default none are read")  # fmt: skip
    serve.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                       help="fetch http(s) image URLs only from these hosts (default: any public host)")  # fmt: skip
    serve.add_argument("--disable-media-url-fetch", action="store_true", help="never fetch http(s) image URLs")
    serve.add_argument("--tool-call-parser", default=None, metavar="NAME",
                       help="parse tool calls from the model's output: hermes (Qwen2.5 / Qwen3 <tool_call>), "
                       "llama3_json, mistral (default: hermes when the chat template writes <tool_call>, "
                       "else none)")  # fmt: skip
    serve.add_argument("--chat-template-content-format", choices=["auto", "string", "openai"], default="auto",
                       help="message content as a string or as parts (default: what the template reads)")  # fmt: skip
    serve.add_argument("--allow-private-media-urls", action="store_true",
                       help="also fetch loopback, private and link-local addresses (default: refused)")  # fmt: skip
    serve.add_argument("--media-fetch-timeout", type=float, default=10.0, metavar="S",
                       help="total seconds for one image download, redirects included (default 10)")  # fmt: skip
    _media_io_kwargs_option(serve, "the server's default; a request's media_io_kwargs go over it")
    serve.add_argument("--max-images-per-prompt", type=int, default=None, metavar="N", help="refuse prompts with more")
    serve.add_argument("--served-model-name", default=None, help="the model id clients use (default: folder name)")
    serve.add_argument("--kv-cache-memory", default="1GiB", help="KV cache size, e.g. 512MiB, 4GiB (default 1GiB)")
    serve.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="serve PEFT LoRA adapters: a request whose model is NAME runs with the adapter at PATH")
    serve.add_argument("--max-loras", type=int, default=None, metavar="N",
                       help="LoRA adapters held at once (default 4; the least recently used idle one makes room)")
    serve.add_argument("--allow-runtime-lora-updating", action="store_true",
                       help="open /v1/load_lora_adapter and /v1/unload_lora_adapter")
    serve.add_argument("--enable-prompt-embeds", action="store_true",
                       help="take completions' prompt_embeds (base64 torch.save tensors, checked)")
    serve.add_argument("--enable-mm-embeds", action="store_true",
                       help="take precomputed image_embeds chat parts (base64 torch.save tensors, checked)")
    serve.add_argument("--runner", choices=["auto", "generate", "pooling"], default="auto",
                       help="pooling: serve /v1/embeddings, /score and /rerank with the model's pooled hidden states "
                       "(default auto: pooling for retrieval and embedding architectures, else generate)")
    serve.add_argument("--pooler-config", type=_json_object, default=None, metavar="JSON",
                       help='how a pooling model pools, e.g. \'{"pooling_type": "MEAN", "normalize": true}\' '
                       "(default: the folder's sentence-transformers modules.json, else the last token, normalized)")
    serve.add_argument("--max-request-bytes", type=int, default=32 * 2**20, help="larger bodies get 413")
    serve.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                       help="engine replicas, each a process of its own, routed by image (default 1)")  # fmt: skip
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="on SIGTERM, seconds running requests get to finish before they are ended (default 5)",
    )
    _mm_processor_kwargs_option(serve)
    add_plugin_cli_arguments(serve)  # the options installed plugins add

    bench = commands.add_parser("bench", help="benchmark a running server",
                                description="Benchmarks: `tessera bench serve` loads an OpenAI-compatible "
                                "server.")  # fmt: skip
    benchmarks = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    bench_serve = benchmarks.add_parser("serve", help="load an OpenAI-compatible server and report its latencies",
                                        description="Send streaming image+text chat requests to an OpenAI-compatible "
                                        "server (Tessera, vLLM, llama-server) at a request rate or concurrency, and "
                                        "report throughput and TTFT / TPOT / ITL / E2E latency as vllm bench serve "
                                        "does.")  # fmt: skip
    bench_serve_module.add_arguments(bench_serve)
    return parser


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _lora_modules(values: Optional[list[str]]) -> Optional[dict[str, str]]:
    """--lora-modules NAME=PATH ... as {name: path}."""
    if not values:
        return None
    pairs = [value.partition("=") for value in values]
    bad = [value for value, (name, eq, path) in zip(values, pairs) if not (name and eq and path)]
    if bad:
        raise ValueError(f"--lora-modules takes NAME=PATH pairs; got {', '.join(bad)}")
    return {name: path for name, _, path in pairs}


def _media_io_kwargs(text: str) -> dict[str, Any]:
    value = _json_object(text)
    try:
        return check_media_io_kwargs(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _media_io_kwargs_option(parser: argparse.ArgumentParser, note: str = "") -> None:
    parser.add_argument("--media-io-kwargs", type=_media_io_kwargs, default=None, metavar="JSON",
                        help="how media are loaded, e.g. '{\"video\": {\"num_frames\": 16, \"fps\": 2}}'"
                        + (f" ({note})" if note else ""))  # fmt: skip


def _mm_processor_kwargs_option(parser: argparse.ArgumentParser) -> None:
    _device_options(parser)
    parser.add_argument("--mm-processor-kwargs", type=_json_object, default=None, metavar="JSON",
                        help="keyword arguments for the model's HF processor, as HF takes them, e.g. "
                        "'{\"max_pixels\": 313600}' for Qwen-VL (applied to every prompt; a request's own go over "
                        "them key by key; an option the processor does not take is refused)")  # fmt: skip
    parser.add_argument("--hf-overrides", type=_json_object, default=None, metavar="JSON",
                        help="changes to the model's config.json, e.g. '{\"architectures\": [\"MyModel\"]}' "
                        "for a model class a plugin registers")  # fmt: skip


def _mm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """LLM / engine options for --mm-processor-kwargs, --hf-overrides, --device, --dtype, --quantization and
    the parallel options (those given)."""
    options = {
        "mm_processor_kwargs": args.mm_processor_kwargs, "hf_overrides": args.hf_overrides,
        "device": args.device, "dtype": args.dtype,
        "quantization": args.quantization, "tensor_parallel_size": args.tensor_parallel_size,
        "distributed_executor_backend": args.distributed_executor_backend, "mmproj": getattr(args, "mmproj", None),
    }  # fmt: skip
    return {key: value for key, value in options.items() if value is not None}


def _device_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mmproj", default=None, metavar="FILE",
                        help="with a .gguf model: its vision projector file (mmproj-*.gguf), as llama-server "
                        "--mmproj takes it; the pair runs as the vision model it was converted from")  # fmt: skip
    parser.add_argument("--device", default=None, metavar="DEVICE",
                        help="auto (default: cuda if available, else cpu), cpu, cuda, cuda:1")  # fmt: skip
    parser.add_argument("--dtype", default=None, metavar="DTYPE",
                        help="float32, bfloat16 or float16 (default: auto, the model config's dtype)")  # fmt: skip
    parser.add_argument("--quantization", default=None, choices=(*QUANTIZATION_METHODS, AUTO_QUANTIZATION),
                        help="quantize the language model's weights at load: int8 or int4 (groups of 32 "
                        "inputs); auto: a GGUF file's quantized blocks run as they are (Q8_0, Q4_0/1, Q5_0/1, "
                        "Q4_K, Q5_K, Q6_K; others as int4 / int8)")  # fmt: skip
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=None,
        metavar="N",
        help="split the language model over N ranks (this process + N-1 workers; default 1)",
    )
    parser.add_argument("--distributed-executor-backend", default=None, choices=DISTRIBUTED_EXECUTOR_BACKENDS,
                        help="where the workers run: mp (local processes, default) or ray (Ray actors "
                        "on the cluster of RAY_ADDRESS, else a local Ray; pip install 'tessera[ray]')")  # fmt: skip


MODEL_HELP = "a local Hugging Face model folder or a .gguf file (default: the bundled demo model)"


def _model_argument(parser: argparse.ArgumentParser) -> None:
    """The model as an optional positional argument too, as `vllm serve MODEL` takes it."""
    parser.add_argument("model_path", nargs="?", default=None, metavar="MODEL", help=f"{MODEL_HELP}; or --model")


def _model_of(args: argparse.Namespace) -> Optional[str]:
    positional = getattr(args, "model_path", None)
    if positional is not None and args.model is not None and positional != args.model:
        raise ValueError(f"Two models given: {positional} and --model {args.model}; pass one.")
    return positional if positional is not None else args.model


def _common_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, metavar="MODEL", help=MODEL_HELP)
    _mm_processor_kwargs_option(parser)
    _media_io_kwargs_option(parser)
    add_plugin_cli_arguments(parser)
    parser.add_argument("--max-tokens", type=int, default=128, help="longest answer in tokens (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 for greedy (default), higher for variety")


def main(argv: Optional[Sequence[str]] = None, *, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "bench":
        return bench_serve_module.run(args, stdout)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
        if args.command == "generate":  # refuse a missing file before loading the model
            messages = [user_message(args.prompt, args.image, args.video, args.audio)]
        if args.command == "transcribe":
            missing = [path for path in args.audio if not Path(path).is_file()]
            if missing:
                raise ValueError(f"Audio file {missing[0]} does not exist.")
        llm = _load(_model_of(args), stdout, {**plugin_options_from_cli(args), **_mm_kwargs(args)})
        if args.command == "generate":
            stream_answer(llm, messages, params, stdout, args.media_io_kwargs)
        elif args.command == "transcribe":
            for result in llm.transcribe(args.audio, params, language=args.language, prompt=args.prompt,
                                         use_tqdm=False):  # fmt: skip
                stdout.write(result.text + "\n")
        else:
            chat_loop(llm, params, stdin, stdout, args.media_io_kwargs)
    except (ValueError, OSError) as e:  # the user's input: one clear line, no traceback
        print(f"tessera: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def _model_folder(model: Optional[str]) -> Path:
    """The model path: a Hugging Face folder, or a GGUF file (or a folder holding one)."""
    if not model:  # the default: the demo model, assembled on first use (tessera.DEMO_MODEL)
        from ..models.demo_vlm import demo_model_folder

        return demo_model_folder()
    folder = Path(model)
    if find_gguf_file(folder) is None and not (folder / "config.json").is_file():
        raise ValueError(
            f"{folder} is not a model folder: it has no config.json and no .gguf file; pass --model FOLDER"
        )
    return folder


def _serve(args: argparse.Namespace) -> int:
    try:
        if args.shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout must be 0 or more seconds, got {args.shutdown_timeout:g}.")
        if args.allowed_media_dir is not None and not Path(args.allowed_media_dir).is_dir():
            raise ValueError(f"--allowed-media-dir {args.allowed_media_dir} is not a folder.")
        folder = _model_folder(_model_of(args))
        from .openai.api_server import serve

        policy = MediaPolicy(
            allowed_local_dir=args.allowed_media_dir,
            fetch_urls=not args.disable_media_url_fetch,
            allowed_domains=tuple(args.allowed_media_domains) if args.allowed_media_domains else None,
            allow_private_networks=args.allow_private_media_urls,
            timeout=args.media_fetch_timeout,
        )
        name = args.served_model_name or (None if _model_of(args) else "demo_model")  # not the cache folder's name
        return serve(str(folder), host=args.host, port=args.port, served_model_name=name,
                     api_key=args.api_key, media_policy=policy, max_images_per_prompt=args.max_images_per_prompt,
                     chat_template_content_format=args.chat_template_content_format,
                     max_request_bytes=args.max_request_bytes, kv_cache_memory=args.kv_cache_memory,
                     media_io_kwargs=args.media_io_kwargs, tool_call_parser=args.tool_call_parser,
                     data_parallel_size=args.data_parallel_size, shutdown_timeout=args.shutdown_timeout,
                     runner=args.runner, **({"pooler_config": args.pooler_config} if args.pooler_config else {}),
                     enable_mm_embeds=args.enable_mm_embeds, lora_modules=_lora_modules(args.lora_modules),
                     allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                     enable_prompt_embeds=args.enable_prompt_embeds,
                     **({"max_loras": args.max_loras} if args.max_loras else {}),
                     **plugin_options_from_cli(args), **_mm_kwargs(args))  # fmt: skip
    except (ValueError, OSError) as e:
        print(f"tessera: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _load(model: Optional[str], out: TextIO, options: Optional[dict] = None) -> Any:
    folder = _model_folder(model)
    print(f"Loading {folder} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    from .llm import LLM  # heavy imports only once the arguments are known to be good

    llm = LLM(str(folder), kv_cache_memory="256MiB", **(options or {}))
    print(f"Ready in {time.perf_counter() - start:.1f} s.", file=sys.stderr, flush=True)
    return llm


if __name__ == "__main__":
    sys.exit(main())
