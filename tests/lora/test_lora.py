"""LoRA adapters per request against first principles: HF transformers' model with each adapter merged into its
weights (W + alpha / r * B @ A, as PEFT merges) gives the greedy tokens Tessera gives with the adapter unmerged, for
two adapters (one on attention with q/v fused into qkv, one rsLoRA on the MLP and k) and the base model in one
batch, also in prefill chunks, and on the tiny LLaVA with an adapter of the vision tower and projector; an
adapter's cached blocks never serve another adapter or the base model; bad adapters are refused by name; served
adapters are chosen by the request's model name."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from tessera import LLM, SamplingParams
from tessera.errors import InputError
from tessera.lora import LoRARequest
from testkit import build_tiny_text_model
from testkit.generation import hf_greedy_tokens

PROMPTS = ["The circle is red and the square is blue.", "One two three four five six seven eight"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ADAPTERS = {  # name: (target modules, rank, alpha, rsLoRA)
    "attention": (["q_proj", "v_proj"], 4, 8, False),
    "mlp": (["gate_proj", "down_proj", "k_proj"], 2, 4, True),
}


def write_adapter(folder, model, targets, rank, alpha, rslora, seed):
    """A PEFT adapter folder of random A, B for `targets` in every layer; returns {HF weight name: B @ A * scale}."""
    generator = torch.Generator().manual_seed(seed)
    tensors, deltas = {}, {}
    scale = alpha / (math.sqrt(rank) if rslora else rank)
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in targets:
            a = torch.randn(rank, module.in_features, generator=generator) * 0.3
            b = torch.randn(module.out_features, rank, generator=generator) * 0.3
            tensors[f"base_model.model.{name}.lora_A.weight"] = a
            tensors[f"base_model.model.{name}.lora_B.weight"] = b
            deltas[f"{name}.weight"] = scale * b @ a
    folder.mkdir()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": rslora, "target_modules": targets,
              "bias": "none", "task_type": "CAUSAL_LM"}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return deltas


def merged(model, deltas):
    """A copy of the HF model with each adapter update added to its weight (what PEFT's merge computes)."""
    copied = copy.deepcopy(model)
    state = copied.state_dict()
    with torch.no_grad():
        for key, delta in deltas.items():
            state[key] += delta
    copied.load_state_dict(state)
    return copied


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    """(model folder, {adapter name: LoRARequest}, {adapter name or None: HF's greedy tokens per prompt})."""
    root = tmp_path_factory.mktemp("lora")
    folder = build_tiny_text_model(root / "base", LlamaForCausalLM, LlamaConfig)
    base = LlamaForCausalLM.from_pretrained(folder).eval()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    expected = {None: hf_greedy_tokens(base, tokenizer, PROMPTS, 8)}
    requests = {}
    for i, (name, (targets, rank, alpha, rslora)) in enumerate(ADAPTERS.items()):
        deltas = write_adapter(root / name, base, targets, rank, alpha, rslora, seed=i)
        expected[name] = hf_greedy_tokens(merged(base, deltas), tokenizer, PROMPTS, 8)
        requests[name] = LoRARequest(name, i + 1, str(root / name))
    assert len({tuple(map(tuple, v)) for v in expected.values()}) == 3  # each adapter changes the answers
    return folder, requests, expected


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 5}], ids=["batched", "chunked-prefill"])
def test_two_adapters_and_the_base_model_in_one_batch(adapted, options):
    folder, requests, expected = adapted
    llm = LLM(str(folder), kv_cache_memory="4MiB", block_size=4, **options)
    order = [requests["attention"], requests["mlp"], None]
    prompts = [p for p in PROMPTS for _ in order]
    outputs = llm.generate(prompts, GREEDY, lora_request=order * len(PROMPTS), use_tqdm=False)
    names = ["attention", "mlp", None]
    got = tokens(outputs)
    for i, prompt_index in enumerate(k for k in range(len(PROMPTS)) for _ in order):
        assert got[i] == expected[names[i % 3]][prompt_index]


def test_cached_blocks_belong_to_their_adapter(adapted):
    folder, requests, expected = adapted
    llm = LLM(str(folder), kv_cache_memory="4MiB", block_size=4)
    manager = llm.engine.core.block_manager
    assert tokens(llm.generate(PROMPTS[0], GREEDY, lora_request=requests["attention"])) == [expected["attention"][0]]
    hits = manager.prefix_hits
    assert tokens(llm.generate(PROMPTS[0], GREEDY, lora_request=requests["mlp"])) == [expected["mlp"][0]]
    assert tokens(llm.generate(PROMPTS[0], GREEDY)) == [expected[None][0]]
    assert manager.prefix_hits == hits  # the same prompt under another adapter, or none: nothing reused
    assert tokens(llm.generate(PROMPTS[0], GREEDY, lora_request=requests["attention"])) == [expected["attention"][0]]
    assert manager.prefix_hits > hits  # its own blocks again


def test_bad_adapters_are_refused_by_name(adapted, tmp_path):
    folder, requests, _ = adapted
    llm = LLM(str(folder), kv_cache_memory="4MiB", max_loras=1)
    with pytest.raises(InputError, match="adapter_config.json"):
        llm.generate("hi", GREEDY, lora_request=LoRARequest("missing", 7, str(tmp_path / "nowhere")))
    other = LoRARequest("impostor", requests["attention"].lora_int_id, requests["mlp"].lora_path)
    llm.generate("hi", GREEDY, lora_request=requests["attention"])
    with pytest.raises(InputError, match="already means adapter 'attention'"):
        llm.generate("hi", GREEDY, lora_request=other)
    assert tokens(llm.generate("hi", GREEDY))  # the engine serves on
    with pytest.raises(ValueError, match="positive integer"):
        LoRARequest("zero", 0, "x")


def test_served_adapters_are_chosen_by_model_name(adapted):
    """`--lora-modules name=path`: /v1/models lists the adapters; a completion asking for one runs with it."""
    import openai

    from tessera.engine.async_engine import AsyncEngine
    from tessera.engine.llm_engine import LLMEngine
    from tessera.entrypoints.openai.api_server import ServerThread, build_app

    folder, requests, expected = adapted
    offline = LLM(str(folder), kv_cache_memory="4MiB")
    engine = AsyncEngine(LLMEngine.from_options(str(folder), kv_cache_memory="4MiB"))
    modules = {name: request.lora_path for name, request in requests.items()}
    try:
        with ServerThread(build_app(engine, model_name="base", lora_modules=modules)) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            assert [m.id for m in client.models.list().data] == ["base", "attention", "mlp"]
            for name in ("attention", "mlp", "base"):
                reply = client.completions.create(model=name, prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                                  extra_body={"ignore_eos": True})  # fmt: skip
                lora = requests.get(name)
                (want,) = offline.generate(PROMPTS[1], GREEDY, lora_request=lora, use_tqdm=False)
                assert reply.choices[0].text == want.outputs[0].text
                assert want.outputs[0].token_ids == expected[name if lora else None][1]
    finally:
        engine.shutdown()


def test_a_vision_tower_adapter_and_a_language_model_adapter_with_images(tiny_llava_dir, tmp_path):
    """On the tiny LLaVA: one adapter of the CLIP tower's attention and MLP, the projector and the decoder's q, one
    of the decoder's MLP, and the base model, one image prompt each, in one batch = HF with each merged. The
    image's encoder output under the vision adapter is its own (cached apart from the base model's)."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from testkit import random_images

    hf = LlavaForConditionalGeneration.from_pretrained(tiny_llava_dir).eval()
    processor = AutoProcessor.from_pretrained(tiny_llava_dir)
    image = random_images([(40, 30)], seed=3)[0]
    prompt = "USER: <image>\nWhat is this? ASSISTANT:"
    inputs = processor(text=prompt, images=image, return_tensors="pt")

    def greedy(model):
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=8, do_sample=False, eos_token_id=None)
        return out[0, inputs["input_ids"].shape[1] :].tolist()

    expected, loras = [], []
    adapters = [("vision", ["q_proj", "fc1", "linear_1"], 4, 8), ("language", ["gate_proj", "down_proj"], 2, 4)]
    for i, (name, targets, rank, alpha) in enumerate(adapters):
        deltas = write_adapter(tmp_path / name, hf, targets, rank, alpha, False, seed=10 + i)
        assert name != "vision" or any("vision_tower" in key for key in deltas)
        expected.append(greedy(merged(hf, deltas)))
        loras.append(LoRARequest(name, i + 1, str(tmp_path / name)))
    expected.append(greedy(hf))
    assert len({tuple(e) for e in expected}) == 3
    llm = LLM(str(tiny_llava_dir), kv_cache_memory="8MiB")
    request = {"prompt": prompt, "multi_modal_data": {"image": image}}
    outputs = llm.generate([request] * 3, GREEDY, lora_request=[*loras, None], use_tqdm=False)
    assert tokens(outputs) == expected
    assert llm.engine.core.loras.adapts_encoder == {1}


def test_adapters_load_and_unload_at_run_time_behind_the_flag(adapted, tmp_path):
    """/v1/load_lora_adapter and /v1/unload_lora_adapter: off by default (a 400 naming the flag); on, a loaded adapter
    answers as offline and an unloaded one is a 404 model; a folder that is no adapter is a 400."""
    import httpx

    from tessera.engine.async_engine import AsyncEngine
    from tessera.engine.llm_engine import LLMEngine
    from tessera.entrypoints.openai.api_server import ServerThread, build_app

    folder, requests, expected = adapted
    engine = AsyncEngine(LLMEngine.from_options(str(folder), kv_cache_memory="4MiB"))
    body = {"lora_name": "mlp", "lora_path": requests["mlp"].lora_path}
    completion = {"model": "mlp", "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    try:
        with ServerThread(build_app(engine, model_name="base")) as url:
            response = httpx.post(url + "/v1/load_lora_adapter", json=body)
            assert response.status_code == 400 and "--allow-runtime-lora-updating" in response.text
        with ServerThread(build_app(engine, model_name="base", allow_runtime_lora_updating=True)) as url:
            assert httpx.post(url + "/v1/completions", json=completion).status_code == 404
            assert httpx.post(url + "/v1/load_lora_adapter", json=body).status_code == 200
            reply = httpx.post(url + "/v1/completions", json=completion, timeout=60).json()
            offline = LLM(str(folder), kv_cache_memory="4MiB")
            (want,) = offline.generate(PROMPTS[1], GREEDY, lora_request=requests["mlp"], use_tqdm=False)
            assert (
                reply["choices"][0]["text"] == want.outputs[0].text and want.outputs[0].token_ids == expected["mlp"][1]
            )
            bad = {"lora_name": "nothing", "lora_path": str(tmp_path)}
            response = httpx.post(url + "/v1/load_lora_adapter", json=bad)
            assert response.status_code == 400 and "adapter_config.json" in response.text
            assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "mlp"}).status_code == 200
            assert httpx.post(url + "/v1/completions", json=completion).status_code == 404
    finally:
        engine.shutdown()
