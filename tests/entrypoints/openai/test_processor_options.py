"""HF processor options (`mm_processor_kwargs`) through the OpenAI-compatible server, on tiny checkpoints.

A request's `mm_processor_kwargs` (vLLM's body field; the openai client sends it in `extra_body`), a
server's (the engine's model-level ones) and the model's processor files combine key by key, request
over server over files, and the answer and prompt tokens are those of HF `generate` with the same
settings: on Qwen2.5-VL (`max_pixels`, `min_pixels`, the `size` dict form, `do_normalize`), Qwen2-VL and
Qwen3-VL (`max_pixels`, `size`) and Idefics3 (`size={"longest_edge": ...}`), on /v1/chat/completions,
/v1/completions and /tokenize (the other tiling families: test_tiled_models.py). Two requests
for the same picture with different settings, sent at once and repeated (warm processor, encoder and
prefix caches), each get their own answer. A request whose settings make its image larger than the
engine's encoder budget or KV cache is a JSON 400 naming the limit and the numbers, while a request
beside it completes and the server ends idle; an option the processor does not take, or a number asking
for an absurd image, is a JSON 400 naming it, and the server keeps serving. Options HF's processor takes
but whose output the model cannot run (HF fails on them too: a patch size other than the model's...) are
a JSON 400 for that request alone: the requests running beside it complete.

Every expectation comes from transformers (processor and `generate`), none from Tessera's own output.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import io
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from tessera.engine.async_engine import AsyncEngine
from tessera.engine.llm_engine import LLMEngine
from tessera.entrypoints.openai.api_server import build_app
from tessera.entrypoints.openai.http_server import ServerThread
from tessera.multimodal.media import MediaPolicy
from testkit import random_images
from testkit.idefics3 import build_tiny_idefics3
from testkit.qwen_vl import build_tiny_qwen2_5_vl, build_tiny_qwen2_vl, build_tiny_qwen3_vl
from testkit.server import metric, wait_until_idle

pytestmark = pytest.mark.filterwarnings("ignore:Passing `min_pixels` and `max_pixels`:FutureWarning")

QUESTION, MAX_TOKENS = "What is it?", 6
# Qwen2.5-VL's tiny processor (8-pixel patches, 2x2 merge: a token per 16x16 block, 256..3072 pixels)
# gives this picture 12 tokens by default, 4 under max_pixels 16*16*4, 6 under 16*16*8.
PICTURE, LARGE_PICTURE = random_images([(200, 150)], seed=1)[0], random_images([(400, 300)], seed=2)[0]
IDEFICS_PICTURE = random_images([(200, 90)], seed=4)[0]  # 6 tiles + the global one by default; 2 + 1 at 64 px
SERVER_KWARGS = {"max_pixels": 16 * 16 * 4}  # the tight server's: the profiled largest image is 4 tokens
STEP_TOKENS = 32  # the tight server's max_num_batched_tokens, so its encoder budget
KV_BLOCKS, BLOCK_SIZE = 3, 16  # the tight server's KV cache: 48 tokens
IMAGE_TEXT = {"qwen": "<|vision_start|><|image_pad|><|vision_end|>", "idefics3": "<image>"}  # the templates' images


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def chat_messages(image, question: str = QUESTION, uuid: str | None = None) -> list[dict]:
    """One image and a question; `uuid`: the image's id (vLLM's: the caller promises it means this content)."""
    part = {"type": "image_url", "image_url": {"url": data_url(image)}}
    if uuid is not None:
        part["uuid"] = uuid
    return [{"role": "user", "content": [part, {"type": "text", "text": question}]}]


class HFReference:
    """HF's processor and model for a folder, with its prompt for one image and QUESTION; answers memoised
    per (picture, options). `processor_kwargs`: options the processor is loaded with (a server's)."""

    def __init__(self, folder, image_text: str, **processor_kwargs):
        self.image_text = image_text  # what the chat template writes for the image
        self.processor = AutoProcessor.from_pretrained(folder, **processor_kwargs)
        self.model = AutoModelForImageTextToText.from_pretrained(folder).eval()
        content = [{"type": "image"}, {"type": "text", "text": QUESTION}]
        messages = [{"role": "user", "content": content}]
        self.text = self.processor.apply_chat_template(messages, add_generation_prompt=True)
        bos = self.processor.tokenizer.bos_token
        self.add_special_tokens = not (bos and self.text.startswith(bos))  # a template that writes the BOS
        self._answers: dict = {}

    def inputs(self, image, kwargs: dict | None = None):
        return self.processor(text=self.text, images=[image], return_tensors="pt",
                              add_special_tokens=self.add_special_tokens, **copy.deepcopy(kwargs or {}))  # fmt: skip

    def prompt_ids(self, image, kwargs: dict | None = None) -> list[int]:
        return self.inputs(image, kwargs)["input_ids"][0].tolist()

    def answer(self, image, kwargs: dict | None = None, max_tokens: int = MAX_TOKENS) -> tuple[str, int]:
        """(HF generate's greedy answer of `max_tokens` tokens, the prompt's token count)."""
        key = (id(image), json.dumps(kwargs or {}, sort_keys=True), max_tokens)
        if key not in self._answers:
            inputs = self.inputs(image, kwargs)
            with torch.no_grad():
                out = self.model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, eos_token_id=None)
            prompt_len = inputs["input_ids"].shape[1]
            text = self.processor.tokenizer.decode(out[0, prompt_len:], skip_special_tokens=True)
            self._answers[key] = (text, prompt_len)
        return self._answers[key]


@contextlib.contextmanager
def serve(folder, **engine_options):
    engine = AsyncEngine(LLMEngine.from_options(str(folder), **engine_options))
    app = build_app(engine, model_name="tiny", media_policy=MediaPolicy())
    try:
        with ServerThread(app) as url:
            yield url
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    folder = build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))
    return folder, HFReference(folder, IMAGE_TEXT["qwen"])


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    folder = build_tiny_idefics3(tmp_path_factory.mktemp("idefics3"))
    return folder, HFReference(folder, IMAGE_TEXT["idefics3"])


@pytest.fixture(scope="module")
def qwen_server(qwen):
    with serve(qwen[0], kv_cache_memory="16MiB") as url:
        yield url


@pytest.fixture(scope="module")
def tight_server(qwen):
    """Qwen2.5-VL with server-level max_pixels 16*16*4 (its profiled largest image: 4 tokens), a step of
    32 tokens (so an encoder budget of 32 rows) and a KV cache of 3 blocks of 16 tokens."""
    with serve(qwen[0], kv_cache_memory=f"{KV_BLOCKS * 4}KiB", mm_processor_kwargs=SERVER_KWARGS,
               max_num_batched_tokens=STEP_TOKENS) as url:  # fmt: skip
        yield url


@pytest.fixture(scope="module")
def idefics3_server(idefics3):
    with serve(idefics3[0], kv_cache_memory="16MiB") as url:
        yield url


@pytest.fixture(scope="module")
def tight_hf(qwen):
    """HF's processor loaded with the tight server's options."""
    return HFReference(qwen[0], IMAGE_TEXT["qwen"], **SERVER_KWARGS)


def chat(url: str, image, kwargs: dict | None = None, *, uuid: str | None = None, max_tokens: int = MAX_TOKENS):
    body = {"model": "tiny", "messages": chat_messages(image, uuid=uuid), "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True}  # fmt: skip
    if kwargs is not None:
        body["mm_processor_kwargs"] = kwargs
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def completion(url: str, hf: HFReference, image, kwargs: dict | None = None) -> httpx.Response:
    """The chat template's text as a plain prompt, the image inline in its placeholder's place."""
    assert hf.text.count(hf.image_text) == 1
    prompt = hf.text.replace(hf.image_text, f'<img src="{data_url(image)}">')
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    if kwargs is not None:
        body["mm_processor_kwargs"] = kwargs
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def tokenize(url: str, image, kwargs: dict | None = None) -> httpx.Response:
    body = {"model": "tiny", "messages": chat_messages(image)}
    if kwargs is not None:
        body["mm_processor_kwargs"] = kwargs
    return httpx.post(url + "/tokenize", json=body, timeout=60)


def answer_of(response: httpx.Response) -> tuple[str, int]:
    assert response.status_code == 200, response.text
    reply = response.json()
    choice = reply["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"], reply["usage"]["prompt_tokens"]


def error_message(response: httpx.Response) -> str:
    assert response.status_code == 400, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["code"] == 400
    return error["message"]


def check_still_serving(url: str, hf: HFReference, image=PICTURE) -> None:
    """A request without options gets HF's answer (`hf` loaded with the server's options, if any)."""
    assert answer_of(chat(url, image)) == hf.answer(image)


# ---- 1. a request's options, a server's options ---------------------------------------------------------

REQUEST_CASES = {  # name: (model, picture, request options)
    "qwen-max_pixels": ("qwen", PICTURE, {"max_pixels": 16 * 16 * 4}),
    "qwen-size": ("qwen", PICTURE, {"size": {"shortest_edge": 16 * 16, "longest_edge": 16 * 16 * 6}}),
    "qwen-min_pixels": ("qwen", random_images([(20, 30)], seed=6)[0], {"min_pixels": 16 * 16 * 9}),
    "idefics3-size": ("idefics3", IDEFICS_PICTURE, {"size": {"longest_edge": 64}}),
}


@pytest.fixture(params=list(REQUEST_CASES))
def request_case(request):
    model, image, kwargs = REQUEST_CASES[request.param]
    folder_and_hf = request.getfixturevalue(model)
    url = request.getfixturevalue(f"{model}_server")
    return url, folder_and_hf[1], image, kwargs


def test_request_options_give_hf_answer(request_case):
    from openai import OpenAI

    url, hf, image, kwargs = request_case
    expected = hf.answer(image, kwargs)
    assert expected[1] != hf.answer(image)[1]  # the options change the prompt, so the test can tell
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    reply = client.chat.completions.create(
        model="tiny", messages=chat_messages(image), max_tokens=MAX_TOKENS, temperature=0.0,
        extra_body={"mm_processor_kwargs": kwargs, "ignore_eos": True},
    )  # fmt: skip
    assert (reply.choices[0].message.content, reply.usage.prompt_tokens) == expected
    assert answer_of(chat(url, image)) == hf.answer(image)  # and none stick to the server


def test_tokenize_takes_request_options(request_case):
    url, hf, image, kwargs = request_case
    counted = tokenize(url, image, kwargs)
    assert counted.status_code == 200, counted.text
    expected = hf.prompt_ids(image, kwargs)
    assert counted.json()["tokens"] == expected and counted.json()["count"] == len(expected)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_vl"])
def other_qwen(request, tmp_path_factory):
    """(server URL, HFReference) of Qwen2-VL and Qwen3-VL, which share Qwen2.5-VL's size options."""
    build = {"qwen2_vl": build_tiny_qwen2_vl, "qwen3_vl": build_tiny_qwen3_vl}[request.param]
    folder = build(tmp_path_factory.mktemp(request.param))
    with serve(folder, kv_cache_memory="16MiB") as url:
        yield url, HFReference(folder, IMAGE_TEXT["qwen"])


def test_qwen2_and_qwen3_vl_take_request_options(other_qwen):
    url, hf = other_qwen
    for kwargs in ({"max_pixels": 16 * 16 * 4}, {"size": {"shortest_edge": 16 * 16, "longest_edge": 16 * 16 * 6}}):
        expected = hf.answer(PICTURE, kwargs)
        assert expected[1] != hf.answer(PICTURE)[1]  # the options change the prompt, so the test can tell
        assert answer_of(chat(url, PICTURE, kwargs)) == expected
    assert answer_of(chat(url, PICTURE)) == hf.answer(PICTURE)


def test_completions_take_request_options(qwen, qwen_server):
    hf = qwen[1]
    for kwargs in ({"max_pixels": 16 * 16 * 8}, {"max_pixels": 16 * 16 * 4, "do_normalize": False}):
        assert answer_of(completion(qwen_server, hf, PICTURE, kwargs)) == hf.answer(PICTURE, kwargs)


SERVER_CASES = [  # (request options, what HF's call gets besides the server's options at load)
    (None, {}),
    ({"min_pixels": 16 * 16 * 2}, {"min_pixels": 16 * 16 * 2}),  # key by key: the server's max_pixels stays
    ({"max_pixels": 16 * 16 * 8}, {"max_pixels": 16 * 16 * 8}),  # the request's wins
    ({"do_normalize": False}, {"do_normalize": False}),
]


@pytest.mark.parametrize(("request_kwargs", "call_kwargs"), SERVER_CASES)
def test_server_options_under_request_options_give_hf_answer(qwen, tight_server, tight_hf, request_kwargs, call_kwargs):
    expected = tight_hf.answer(PICTURE, call_kwargs)
    # HF loaded with the server's options and called with the request's is HF called with both merged
    assert expected == qwen[1].answer(PICTURE, {**SERVER_KWARGS, **call_kwargs})
    if request_kwargs is None:
        assert expected[1] != qwen[1].answer(PICTURE)[1]  # the server's options change the prompt
    elif "min_pixels" in request_kwargs:
        assert expected[1] != qwen[1].answer(PICTURE, request_kwargs)[1]  # dropping the server's would show
    assert answer_of(chat(tight_server, PICTURE, request_kwargs)) == expected
    counted = tokenize(tight_server, PICTURE, request_kwargs)
    assert counted.status_code == 200 and counted.json()["tokens"] == tight_hf.prompt_ids(PICTURE, call_kwargs)


# ---- 2. the same picture, different options, at once ------------------------------------------------------

PAIRS = [
    ({"max_pixels": 16 * 16 * 4}, {"max_pixels": 16 * 16 * 8}),  # different token counts
    ({"max_pixels": 16 * 16 * 4}, {"max_pixels": 16 * 16 * 4, "do_normalize": False}),  # same tokens, other pixels
]


@pytest.mark.parametrize("uuid", [None, "one-picture"], ids=["hashed", "named"])
@pytest.mark.parametrize("pair", PAIRS, ids=["max_pixels", "do_normalize"])
def test_concurrent_requests_for_one_picture_get_their_own_answers(qwen, qwen_server, pair, uuid):
    hf = qwen[1]
    expected = [hf.answer(PICTURE, kwargs) for kwargs in pair]
    assert expected[0][0] != expected[1][0]  # a crossed cache would show in the text
    barrier = threading.Barrier(len(pair))

    def send(kwargs):
        barrier.wait()
        return answer_of(chat(qwen_server, PICTURE, kwargs, uuid=uuid))

    with ThreadPoolExecutor(len(pair)) as pool:
        for _ in range(3):  # the second and third rounds find the caches warm
            assert list(pool.map(send, pair)) == expected
            assert list(pool.map(send, pair[::-1])) == expected[::-1]
    wait_until_idle(qwen_server)


# ---- 3. settings over the engine's budgets -----------------------------------------------------------------


def test_options_over_the_budgets_are_a_json_400_beside_a_running_request(qwen, tight_server, tight_hf):
    hf = qwen[1]
    kv_tokens = int(metric(tight_server, "tessera_kv_blocks_total")) * BLOCK_SIZE
    assert kv_tokens == KV_BLOCKS * BLOCK_SIZE
    # 192 encoder rows (a 24 x 32 grid of 8-pixel patches, 2x2 merged) against a budget of 32
    large = {"max_pixels": 16 * 16 * 200}
    rows = int(hf.inputs(LARGE_PICTURE, large)["image_grid_thw"].prod()) // 4
    assert rows > STEP_TOKENS
    # 24 rows fit the encoder budget, but the prompt and MAX_TOKENS do not fit the KV cache
    long_prompt = {"max_pixels": 16 * 16 * 30}
    needed = hf.answer(PICTURE, long_prompt)[1] + MAX_TOKENS
    assert hf.inputs(PICTURE, long_prompt)["image_grid_thw"].prod() // 4 <= STEP_TOKENS < needed - MAX_TOKENS
    assert needed > kv_tokens >= tight_hf.answer(PICTURE)[1] + MAX_TOKENS
    barrier = threading.Barrier(3)

    def send(args):
        barrier.wait()
        return chat(tight_server, *args)

    with ThreadPoolExecutor(3) as pool:
        normal, too_large, too_long = pool.map(send, [(PICTURE, None), (LARGE_PICTURE, large), (PICTURE, long_prompt)])
    assert answer_of(normal) == tight_hf.answer(PICTURE)
    message = error_message(too_large)
    assert "encoder" in message and re.search(rf"\b{rows}\b.*\b{STEP_TOKENS}\b", message), message
    message = error_message(too_long)
    assert "KV cache" in message and re.search(rf"\b{needed}\b.*\b{kv_tokens}\b", message), message
    # the same refusal on /v1/completions; then the server is idle and still serves
    assert "encoder" in error_message(completion(tight_server, hf, LARGE_PICTURE, large))
    wait_until_idle(tight_server)
    assert metric(tight_server, "tessera_kv_blocks_used") == 0
    check_still_serving(tight_server, tight_hf)
    wait_until_idle(tight_server)


# ---- 4. options the processor does not take, absurd numbers ------------------------------------------------


@pytest.mark.parametrize("endpoint", ["chat", "completions", "tokenize"])
def test_an_option_the_processor_does_not_take_is_a_json_400_naming_it(qwen, qwen_server, endpoint):
    hf, kwargs = qwen[1], {"max_pixel": 16 * 16 * 4}
    if endpoint == "completions":
        response = completion(qwen_server, hf, PICTURE, kwargs)
    else:
        response = (chat if endpoint == "chat" else tokenize)(qwen_server, PICTURE, kwargs)
    message = error_message(response)
    assert "'max_pixel'" in message and "max_pixels" in message.replace("'max_pixel'", ""), message
    check_still_serving(qwen_server, hf)


ABSURD = [  # (model, picture, request options, the option the message names)
    ("qwen", PICTURE, {"min_pixels": 10**12}, "min_pixels"),
    ("qwen", PICTURE, {"size": {"shortest_edge": 10**10, "longest_edge": 10**10}}, "shortest_edge"),
    ("idefics3", IDEFICS_PICTURE, {"size": {"longest_edge": 50000}}, "longest_edge"),
]


@pytest.mark.parametrize(
    ("model", "image", "kwargs", "named"), ABSURD, ids=["qwen-min_pixels", "qwen-size", "idefics3-size"]
)
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_options_asking_for_an_absurd_image_are_a_json_400(request, model, image, kwargs, named, endpoint):
    url, hf = request.getfixturevalue(f"{model}_server"), request.getfixturevalue(model)[1]
    response = chat(url, image, kwargs) if endpoint == "chat" else completion(url, hf, image, kwargs)
    message = error_message(response)
    assert named in message, message
    check_still_serving(url, hf, image)


def test_a_misspelt_server_option_fails_at_start(qwen):
    with pytest.raises(ValueError, match="'max_pixel'"):
        LLMEngine.from_options(str(qwen[0]), kv_cache_memory="1MiB", mm_processor_kwargs={"max_pixel": 1024})


# ---- 5. options HF's processor takes but whose inputs the model cannot -------------------------------------

RUNNING_TOKENS = 32  # the requests beside: long enough to be running when the misfit arrives
MISFITS = {  # name: (model, picture, request options); HF's processor runs, then HF's model fails on its output
    "qwen-patch_size": ("qwen", PICTURE, {"patch_size": 3}),
    "qwen-temporal_patch_size": ("qwen", PICTURE, {"temporal_patch_size": 1}),
    "qwen-device": ("qwen", PICTURE, {"device": "meta"}),
    "idefics3-max_image_size": ("idefics3", IDEFICS_PICTURE, {"max_image_size": {"longest_edge": 16}}),
}


@pytest.mark.parametrize("case", list(MISFITS))
def test_options_the_model_cannot_take_are_a_json_400_beside_running_requests(request, case):
    model, image, kwargs = MISFITS[case]
    url, hf = request.getfixturevalue(f"{model}_server"), request.getfixturevalue(model)[1]
    with pytest.raises((RuntimeError, ValueError, IndexError, NotImplementedError)):
        hf.answer(image, kwargs)  # HF cannot answer it either
    expected = hf.answer(image, max_tokens=RUNNING_TOKENS)
    barrier = threading.Barrier(3)

    def send(kwargs):
        barrier.wait()
        if kwargs is None:
            return chat(url, image, max_tokens=RUNNING_TOKENS)
        time.sleep(0.05)  # the others are running by now
        return chat(url, image, kwargs)

    with ThreadPoolExecutor(3) as pool:
        first, second, misfit = pool.map(send, [None, None, kwargs])
    assert answer_of(first) == answer_of(second) == expected  # not failed with the misfit's step
    error_message(misfit)
    wait_until_idle(url)
    check_still_serving(url, hf, image)


def test_idefics3_without_padding_gives_hf_answer(idefics3, idefics3_server):
    """do_pad=False: HF's image processor gives no pixel_attention_mask (every tile is whole)."""
    hf, kwargs = idefics3[1], {"do_pad": False}
    assert "pixel_attention_mask" not in hf.inputs(IDEFICS_PICTURE, kwargs)
    assert answer_of(chat(idefics3_server, IDEFICS_PICTURE, kwargs)) == hf.answer(IDEFICS_PICTURE, kwargs)
