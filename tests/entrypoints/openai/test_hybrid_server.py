"""A hybrid model (LFM2-VL: convolutions with a per-sequence state) behind the OpenAI server: a chat about an
image through the openai client answers as the offline API does, its second turn hits the prefix cache, and
/metrics shows the state rows."""

from __future__ import annotations

import base64
import io

import openai

from tessera import LLM, SamplingParams
from tessera.engine.async_engine import AsyncEngine
from tessera.engine.llm_engine import LLMEngine
from tessera.entrypoints.openai.api_server import ServerThread, build_app
from testkit import random_images
from testkit.lfm2_vl import build_tiny_lfm2_vl
from testkit.server import metric

OPTIONS = {"kv_cache_memory": "4MiB", "max_num_seqs": 4}


def test_an_image_chat_over_two_turns(tmp_path):
    folder = str(build_tiny_lfm2_vl(tmp_path / "lfm2_vl"))
    image = random_images([(80, 60)], seed=3)[0]
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    first = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                          {"type": "text", "text": "What is it?"}]}]  # fmt: skip
    offline = LLM(folder, **OPTIONS)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine = AsyncEngine(LLMEngine.from_options(folder, **OPTIONS))
    try:
        with ServerThread(build_app(engine, model_name="tiny")) as base:
            client = openai.OpenAI(base_url=base + "/v1", api_key="none")
            messages = list(first)
            for question in ("And the colours?", None):
                reply = client.chat.completions.create(
                    model="tiny", messages=messages, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
                )
                (expected,) = offline.chat(messages, params, use_tqdm=False)
                assert reply.choices[0].message.content == expected.outputs[0].text
                if question:
                    messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                                 {"role": "user", "content": question}]  # fmt: skip
            assert metric(base, "tessera_state_slots_total") == 4
            assert metric(base, "tessera_state_slots_used") == 0
            assert metric(base, "tessera_prefix_cache_hit_rate") > 0  # the second turn reused the first
    finally:
        engine.shutdown()
