"""Pipeline flags on the command line and the server: --multimodal-pipeline, --pipelines-dir,
--pipeline-param; the server takes inline <img> tags and chat image parts for a pipeline model."""

from __future__ import annotations

import base64
import io

import httpx

from tessera import LLM, SamplingParams
from tessera.engine.async_engine import AsyncEngine
from tessera.engine.llm_engine import LLMEngine
from tessera.entrypoints.cli import main
from tessera.entrypoints.openai.api_server import ServerThread, build_app
from testkit import random_images


def reference(llava_parts, image, text: str, max_tokens: int = 6) -> str:
    llm = LLM(str(llava_parts["text"]), multimodal_pipeline="llava-v1.5-7b", kv_cache_memory="64MiB",
              pipeline_params={"vision_tower": str(llava_parts["vision"])})  # fmt: skip
    prompt = {"prompt": text, "multi_modal_data": {"image": image}}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text


def test_cli_generate_with_a_pipeline(llava_parts, tmp_path):
    image = random_images([(40, 30)], seed=6)[0]
    path = tmp_path / "x.png"
    image.save(path)
    out = io.StringIO()
    code = main(["generate", "Hi", "--image", str(path), "--model", str(llava_parts["text"]), "--max-tokens", "6",
                 "--multimodal-pipeline", "llava-v1.5-7b", "--pipeline-param", f"vision_tower={llava_parts['vision']}"],
                stdout=out)  # fmt: skip
    assert code == 0
    llm = LLM(str(llava_parts["text"]), multimodal_pipeline="llava-v1.5-7b", kv_cache_memory="64MiB",
              pipeline_params={"vision_tower": str(llava_parts["vision"])})  # fmt: skip
    message = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(path)}},
                                           {"type": "text", "text": "Hi"}]}  # fmt: skip
    (expected,) = llm.chat([message], SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    assert out.getvalue() == expected.outputs[0].text.lstrip() + "\n"
    assert "<image>" in expected.prompt  # the image part became the pipeline's marker


def test_cli_pipeline_errors_are_one_line(llava_parts, capsys):
    code = main(["generate", "Hi", "--model", str(llava_parts["text"]), "--pipelines-dir", "/no/such/dir"])
    err = capsys.readouterr().err
    assert code == 1 and "The pipelines directory /no/such/dir does not exist" in err and "Traceback" not in err
    code = main(["generate", "Hi", "--model", str(llava_parts["text"]), "--pipeline-param", "x=1"])
    assert code == 1 and "--pipeline-param needs --multimodal-pipeline" in capsys.readouterr().err


def test_server_completion_with_an_inline_img_tag(llava_parts):
    image = random_images([(40, 30)], seed=8)[0]
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    tag = '<img src="data:image/png;base64,' + base64.b64encode(buffer.getvalue()).decode() + '">'
    engine = AsyncEngine(LLMEngine.from_options(
        str(llava_parts["text"]), kv_cache_memory="64MiB", multimodal_pipeline="llava-v1.5-7b",
        pipeline_params={"vision_tower": str(llava_parts["vision"])}))  # fmt: skip
    try:
        with ServerThread(build_app(engine, model_name="tiny")) as url:
            body = {"prompt": f"USER: {tag}\nWhat is this? ASSISTANT:", "max_tokens": 6, "temperature": 0,
                    "ignore_eos": True}  # fmt: skip
            response = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    finally:
        engine.shutdown()
    expected = reference(llava_parts, image, "USER: <image>\nWhat is this? ASSISTANT:")
    assert response["choices"][0]["text"] == expected
    assert response["usage"]["prompt_tokens"] > engine.engine.core.built.model.pipeline.num_image_embeds()


def test_data_parallel_replicas_run_the_pipeline_plugin(llava_parts):
    """Replica processes load the plugin themselves (by its entry point) and build the pipeline model from
    the options: the same tokens as one engine in this process."""
    options = {"kv_cache_memory": "64MiB", "multimodal_pipeline": "llava-v1.5-7b",
               "pipeline_params": {"vision_tower": str(llava_parts["vision"])}}  # fmt: skip
    images = random_images([(40, 30), (24, 48)], seed=12)
    text = "USER: <image>\nWhat is this? ASSISTANT:"
    prompts = [{"prompt": text, "multi_modal_data": {"image": image}} for image in images]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = [out.outputs[0].token_ids for out in LLM(str(llava_parts["text"]), **options).generate(
        prompts, params, use_tqdm=False)]  # fmt: skip
    engine = LLMEngine.data_parallel(str(llava_parts["text"]), options, 2)
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        done = {}
        while len(done) < len(prompts):
            done.update({out.request_id: out.outputs[0].token_ids for out in engine.step() if out.finished})
    finally:
        engine.shutdown()
    assert [done[str(i)] for i in range(len(prompts))] == expected
