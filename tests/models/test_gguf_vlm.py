"""GGUF vision-model pairs (``model.gguf`` + ``mmproj.gguf``, as llama.cpp's converter writes them) against the HF
folder they were made from: the same prompt ids and greedy tokens, F16 and F32 exactly (the folders' weights are
float16 values), Q8_0 within a stated logit bound; and the pairs that are wrong, each a clear error at load."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tessera import LLM, SamplingParams
from tessera.config import ModelConfig
from tessera.layers import native_kernels as nk
from tessera.layers.cpu_kernels import NATIVE
from tessera.layers.quantization import dequantized_weight
from tessera.models.loader import load_model
from testkit.checkpoints import build_tiny_llava
from testkit.gemma3 import build_tiny_gemma3
from testkit.generation import greedy_logprobs
from testkit.gguf_vlm import convert_pairs, prepare_for_conversion
from testkit.idefics3 import build_tiny_idefics3, build_tiny_smolvlm
from testkit.internvl import build_tiny_internvl
from testkit.llava_next import build_tiny_llava_next
from testkit.mistral3 import build_tiny_mistral3
from testkit.qwen_vl import build_tiny_qwen2_5_vl, build_tiny_qwen2_vl

BUILDERS = {
    "qwen2_vl": build_tiny_qwen2_vl,
    "qwen2_5_vl": build_tiny_qwen2_5_vl,
    "gemma3": build_tiny_gemma3,
    "idefics3": build_tiny_idefics3,
    "smolvlm": build_tiny_smolvlm,
    "llava": build_tiny_llava,
    "llava_next": build_tiny_llava_next,
    "internvl": build_tiny_internvl,
    "mistral3": build_tiny_mistral3,
}
OUTTYPES = {"qwen2_vl": ("f16", "f32", "q8_0")}
"""Every family as F16; one also as F32 and Q8_0 (the reading of each type is shared by all)."""
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """kind -> (HF folder, folder of lm-<type>.gguf and mmproj-<type>.gguf)."""
    root = tmp_path_factory.mktemp("gguf_vlm")
    jobs = []
    for kind, build in BUILDERS.items():
        folder = prepare_for_conversion(build(root / f"{kind.replace('_', '-')}-hf"), kind)
        jobs.append((folder, kind, root / kind, OUTTYPES.get(kind, ("f16",))))
    convert_pairs(jobs)
    return {kind: (folder, out) for folder, kind, out, _ in jobs}


def image(width: int = 64, height: int = 48, seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def chat(text: str = "What is in the picture?", seed: int = 0) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_pil", "image_pil": image(seed=seed)},
                                         {"type": "text", "text": text}]}]  # fmt: skip


PROCESSOR_OPTIONS = {"qwen2_vl": {"size": {"shortest_edge": 256, "longest_edge": 3072}},
                     "qwen2_5_vl": {"size": {"shortest_edge": 256, "longest_edge": 3072}},
                     "internvl": {"max_patches": 4}}  # fmt: skip
"""What the HF folders' processors set that the GGUF files do not carry (the tiny Qwen folders' pixel range, the
tiny InternVL's tile count): passed to the pair as a user would, as processor options."""


def answers(llm: LLM, chats: list[list[dict]]) -> tuple[list[list[int]], list[list[int]]]:
    prompts = [llm.render_chat(c) for c in chats]
    ids = [llm.engine.input_preprocessor.process(p, GREEDY).token_ids for p in prompts]
    return ids, [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def pair_llm(pairs, kind: str, outtype: str = "f16", **options) -> LLM:
    _, out = pairs[kind]
    return LLM(str(out / f"lm-{outtype}.gguf"), mmproj=str(out / f"mmproj-{outtype}.gguf"), device="cpu",
               kv_cache_memory="8MiB", mm_processor_kwargs=PROCESSOR_OPTIONS.get(kind), **options)  # fmt: skip


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_the_f16_pair_answers_as_the_hf_folder(pairs, kind):
    """Each mapped family: the pair's config, processor and weights give the folder's prompt ids (image tokens
    and all) and greedy tokens, for two images batched."""
    folder, _ = pairs[kind]
    chats = [chat(), chat("Describe it.", seed=1)]
    expected = answers(LLM(str(folder), device="cpu", kv_cache_memory="8MiB"), chats)
    llm = pair_llm(pairs, kind)
    assert llm.engine.model_config.architectures == json.loads((folder / "config.json").read_text())["architectures"]
    assert answers(llm, chats) == expected


def first_logprobs(llm: LLM, vocab: int) -> torch.Tensor:
    ((_, logprobs),) = greedy_logprobs(llm, [llm.render_chat(chat())], 1, vocab)
    return logprobs[0]


def test_f32_and_f16_are_the_folder_and_q8_0_is_within_its_bound(pairs):
    """F32 and F16 (of float16-valued weights) hold the checkpoint exactly: the first step's log-probabilities
    equal the folder's up to float32 rounding. Q8_0 (8-bit blocks of 32 weights, one scale each) stays within
    0.25 of them, de-quantized or run as int8 blocks by the native kernels (quantization="auto"), with the same
    greedy tokens."""
    folder, _ = pairs["qwen2_vl"]
    reference = LLM(str(folder), device="cpu", kv_cache_memory="8MiB")
    vocab = reference.engine.model_config.hf_config.text_config.vocab_size
    expected = first_logprobs(reference, vocab)
    for outtype in ("f32", "f16"):
        torch.testing.assert_close(first_logprobs(pair_llm(pairs, "qwen2_vl", outtype), vocab), expected,
                                   atol=1e-5, rtol=0)  # fmt: skip
    for quantization in (None, "auto"):
        llm = pair_llm(pairs, "qwen2_vl", "q8_0", quantization=quantization)
        assert llm.engine.model_config.quantization == ("int8" if quantization else None)
        error = (first_logprobs(llm, vocab) - expected).abs().max().item()
        assert 0 < error < 0.25, error  # measured 0.12 on this checkpoint (widened N(0, 0.2) weights)
        assert answers(llm, [chat()]) == answers(reference, [chat()])
    _, out = pairs["qwen2_vl"]
    kept = load_model(ModelConfig(str(out / "lm-q8_0.gguf"), mmproj=str(out / "mmproj-q8_0.gguf"), device="cpu",
                                  quantization="auto"))  # fmt: skip
    dense = load_model(ModelConfig(str(out / "lm-q8_0.gguf"), mmproj=str(out / "mmproj-q8_0.gguf"), device="cpu"))
    layers = {n: m for n, m in kept.named_modules() if getattr(m, "quantization", None) is not None}
    assert len(layers) == 2 * 4 + 1 and all(n.startswith("language_model.") for n in layers)  # the tower stays float
    if nk.available():  # the file's blocks, each weight exactly the de-quantized file's, run by the int8 kernels
        for name, layer in layers.items():
            assert (layer.quantization, layer.quant_kernel) == ("int8", NATIVE), name
            assert torch.equal(dequantized_weight(layer), dense.get_submodule(name).weight.double()), name


def write_mmproj(path, projector_type: str, vision: bool = True, **tensors: tuple[int, ...]) -> str:
    """A small mmproj-shaped file: the clip architecture, a projector type, a tower tensor and `tensors` (shapes)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_string("clip.projector_type", projector_type)
    writer.add_bool("clip.has_vision_encoder", vision)
    writer.add_tensor("v.patch_embd.weight", np.zeros((4, 3, 2, 2), dtype=np.float32))
    for name, shape in tensors.items():
        writer.add_tensor(name.replace("_", "."), np.zeros(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_wrong_pairs_and_files_are_clear_errors_at_load(pairs, tmp_path):
    """Each names the file and what is wrong: an mmproj of another model (another architecture, or another
    width), a truncated mmproj or model, an unknown projector type, an audio-only projector, the two files swapped, an
    mmproj without a GGUF model."""
    _, qwen = pairs["qwen2_vl"]
    _, gemma = pairs["gemma3"]
    _, llava = pairs["llava"]
    lm, mmproj = qwen / "lm-f16.gguf", qwen / "mmproj-f16.gguf"
    truncated = tmp_path / "mmproj-truncated.gguf"
    truncated.write_bytes(mmproj.read_bytes()[: mmproj.stat().st_size // 2])
    truncated_lm = tmp_path / "lm-truncated.gguf"
    truncated_lm.write_bytes(lm.read_bytes()[: lm.stat().st_size // 2])
    cases = [
        (lm, gemma / "mmproj-f16.gguf", "goes with a gemma3 language model"),
        (llava / "lm-f16.gguf", write_mmproj(tmp_path / "wide.gguf", "mlp", mm_2_weight=(48, 64)), "not belong to"),
        (lm, truncated, "truncated"),
        (truncated_lm, mmproj, "truncated"),
        (lm, write_mmproj(tmp_path / "resampler.gguf", "resampler"), "projector type 'resampler'"),
        (lm, write_mmproj(tmp_path / "audio.gguf", "qwen2vl_merger", vision=False), "no vision encoder"),
        (lm, lm, "is not an mmproj file"),
        (mmproj, mmproj, "is an mmproj file"),
        (pairs["qwen2_vl"][0], mmproj, "is not a GGUF file"),
    ]
    for model, projector, message in cases:
        with pytest.raises(ValueError, match=message) as error:
            LLM(str(model), mmproj=str(projector), device="cpu", kv_cache_memory="4MiB")
        assert Path(projector).name in str(error.value) or Path(model).name in str(error.value)


def test_tessera_serve_takes_the_pair_and_answers_an_image_chat_through_openai(pairs):
    """`tessera serve model.gguf --mmproj mmproj.gguf`, as llama-server takes the pair: an image chat through the
    openai client gets the offline API's answer."""
    import socket
    import subprocess
    import sys
    import time

    import openai

    from testkit.inputs import image_data_url

    _, out = pairs["gemma3"]
    lm, mmproj = out / "lm-f16.gguf", out / "mmproj-f16.gguf"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "tessera.entrypoints.cli", "serve", str(lm), "--mmproj", str(mmproj),
               "--port", str(port), "--kv-cache-memory", "8MiB", "--device", "cpu"]  # fmt: skip
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        offline = LLM(str(lm), mmproj=str(mmproj), device="cpu", kv_cache_memory="8MiB")
        (expected,) = offline.chat(chat(), GREEDY, use_tqdm=False)
        content = [{"type": "image_url", "image_url": {"url": image_data_url(image())}},
                   {"type": "text", "text": "What is in the picture?"}]  # fmt: skip
        deadline = time.monotonic() + 120
        while True:
            try:
                reply = client.chat.completions.create(model=lm.name, max_tokens=8, temperature=0.0,
                                                       messages=[{"role": "user", "content": content}])  # fmt: skip
                break
            except openai.APIConnectionError:
                assert server.poll() is None and time.monotonic() < deadline, server.stdout.read()
                time.sleep(0.3)
        assert reply.choices[0].message.content == expected.outputs[0].text
        assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
    finally:
        server.terminate()
        server.wait(timeout=30)


LLAMA_CPP_OPTIONS = {"qwen2_vl": {"size": {"shortest_edge": 2048, "longest_edge": 32768}},
                     "qwen2_5_vl": {"size": {"shortest_edge": 2048, "longest_edge": 32768}}}  # fmt: skip
"""A pixel range inside llama.cpp's (8 to 4096 tokens) that the tiny models' 1024-token context holds."""


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl", "gemma3", "internvl"])
def test_the_pair_answers_as_llama_cpp(pairs, kind):
    """Where llama-cpp-python's multimodal API runs the pair (the `bench` extra; llama.cpp refuses the tiny SmolVLM
    pair's image slices and has no LLaVA converter left): the same greedy answer, for an image neither resizes.
    Text is compared without U+FFFD: a byte token that ends mid-character is shown as one by the HF detokenizer
    and dropped by llama-cpp-python."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the bench extra) is not installed")
    from llama_cpp.llama_chat_format import MTMDChatHandler

    from testkit.inputs import image_data_url

    _, out = pairs[kind]
    lm, mmproj = str(out / "lm-f16.gguf"), str(out / "mmproj-f16.gguf")
    side = 32 if kind in ("gemma3", "internvl") else 64  # one tile of the tower's size; 16 Qwen tokens
    content = [{"type": "image_url", "image_url": {"url": image_data_url(image(side, side))}},
               {"type": "text", "text": "What is in the picture?"}]  # fmt: skip
    messages = [{"role": "user", "content": content}]
    handler = MTMDChatHandler(clip_model_path=mmproj, verbose=False, use_gpu=False)
    reference = llama_cpp.Llama(model_path=lm, chat_handler=handler, n_ctx=1024, n_threads=2, verbose=False, seed=0)
    expected = reference.create_chat_completion(messages=messages, max_tokens=8, temperature=0.0)
    llm = LLM(lm, mmproj=mmproj, device="cpu", kv_cache_memory="8MiB", mm_processor_kwargs=LLAMA_CPP_OPTIONS.get(kind))
    (answer,) = llm.chat(messages, GREEDY, use_tqdm=False)
    text = expected["choices"][0]["message"]["content"]
    assert answer.outputs[0].text.replace("\ufffd", "") == text.replace("\ufffd", "") and text.strip()


def test_a_folder_holding_the_model_and_its_mmproj_is_the_pair(pairs, tmp_path):
    """As llama.cpp's repositories publish them: the model's GGUF and ``mmproj-*.gguf`` side by side. The folder is
    the pair; a second mmproj in it is an error naming both."""
    _, out = pairs["gemma3"]
    folder = tmp_path / "gemma3-gguf"
    folder.mkdir()
    (folder / "model-F16.gguf").symlink_to(out / "lm-f16.gguf")
    (folder / "mmproj-model-f16.gguf").symlink_to(out / "mmproj-f16.gguf")
    llm = LLM(str(folder), device="cpu", kv_cache_memory="8MiB")
    assert Path(llm.engine.model_config.mmproj).name == "mmproj-model-f16.gguf"
    assert answers(llm, [chat()]) == answers(pair_llm(pairs, "gemma3"), [chat()])
    (folder / "mmproj-other.gguf").symlink_to(out / "mmproj-f16.gguf")
    with pytest.raises(ValueError, match="holds 2 mmproj files"):
        LLM(str(folder), device="cpu", kv_cache_memory="8MiB")


def copy_gguf(source: Path, target: Path, tensors=None, **values) -> Path:
    """A copy of a float GGUF file with its tensors as `tensors` (name -> array) gives them, and more metadata
    `values` (float32)."""
    import gguf

    from tessera.gguf_reading import gguf_reader

    reader = gguf_reader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(target), arch)
    for field in reader.fields.values():
        if not field.name.startswith(("GGUF.", "general.architecture")):
            sub_type = field.types[-1] if len(field.types) > 1 else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    for key, value in values.items():
        writer.add_float32(key, value)
    for name, data in (tensors or {t.name: np.array(t.data) for t in reader.tensors}).items():
        writer.add_tensor(name, data)  # float files only: F32 / F16 arrays
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def test_an_mmproj_with_fused_qkv_is_the_same_model(pairs, tmp_path):
    """llama.cpp's converter can write a tower's q, k, v as one ``attn_qkv`` tensor (``--fuse-qkv``): the same
    weights, the same answers."""
    from tessera.gguf_reading import gguf_reader

    _, out = pairs["qwen2_vl"]
    tensors = {t.name: np.array(t.data) for t in gguf_reader(out / "mmproj-f32.gguf").tensors}
    fused = {}
    for name in sorted(tensors):
        if ".attn_q." in name:
            parts = [tensors[name.replace("attn_q", part)] for part in ("attn_q", "attn_k", "attn_v")]
            fused[name.replace("attn_q", "attn_qkv")] = np.concatenate(parts)
        elif ".attn_k." not in name and ".attn_v." not in name:
            fused[name] = tensors[name]
    mmproj = copy_gguf(out / "mmproj-f32.gguf", tmp_path / "mmproj-fused.gguf", fused)
    assert sum(".attn_qkv." in t.name for t in gguf_reader(mmproj).tensors) == 2 * 2
    llm = LLM(str(out / "lm-f32.gguf"), mmproj=str(mmproj), device="cpu", kv_cache_memory="8MiB",
              mm_processor_kwargs=PROCESSOR_OPTIONS["qwen2_vl"])  # fmt: skip
    assert answers(llm, [chat()]) == answers(pair_llm(pairs, "qwen2_vl", "f32"), [chat()])


def test_a_language_model_read_as_another_architecture_keeps_its_settings_or_is_refused(pairs, tmp_path):
    """Mistral 3's language model is read as a Llama: a file with settings a Llama has no place for (Ministral 3's
    yarn multiplier) is refused by name rather than run without them."""
    _, out = pairs["mistral3"]
    lm = copy_gguf(out / "lm-f16.gguf", tmp_path / "lm-yarn.gguf", **{"mistral3.rope.scaling.yarn_log_multiplier": 1.0})
    with pytest.raises(ValueError, match="rope.scaling.yarn_log_multiplier.*would drop"):
        LLM(str(lm), mmproj=str(out / "mmproj-f16.gguf"), device="cpu", kv_cache_memory="8MiB")


def test_a_largest_image_longer_than_the_context_says_how_to_cap_it(pairs):
    """Qwen-VL images may take up to 4096 tokens (llama.cpp's range), more than the tiny model's 1024-token
    context: the start-up error says so and names the option that caps them; with it the pair starts."""
    _, out = pairs["qwen2_vl"]
    with pytest.raises(ValueError, match=r"1 image of up to 4096 tokens.*context is 1024.*mm_processor_kwargs"):
        LLM(str(out / "lm-f16.gguf"), mmproj=str(out / "mmproj-f16.gguf"), device="cpu", kv_cache_memory="8MiB")
    assert pair_llm(pairs, "qwen2_vl").engine.model_config.mmproj is not None


def test_two_ranks_run_the_pair_as_one(pairs):
    """Tensor parallelism over a pair: each rank reads both files (the tower runs on rank 0); the same tokens."""
    _, out = pairs["llava"]
    tokens = {}
    for size in (1, 2):
        llm = LLM(str(out / "lm-f16.gguf"), mmproj=str(out / "mmproj-f16.gguf"), device="cpu", kv_cache_memory="8MiB",
                  tensor_parallel_size=size)  # fmt: skip
        try:
            tokens[size] = answers(llm, [chat(), chat("Describe it.", seed=1)])
        finally:
            llm.shutdown()
    assert tokens[2] == tokens[1]


def test_every_mapped_projector_has_a_config_and_a_tensor_map():
    """A projector type the pair's config accepts must have its tensor names mapped, and the other way round."""
    from tessera.gguf_vlm_families import FAMILIES
    from tessera.models.gguf_mmproj import RENAMES

    assert set(FAMILIES) == set(RENAMES)
