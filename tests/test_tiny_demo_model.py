"""The tiny demo model (tessera/tiny_demo_model, the tests' fast fixture) answers held-out questions about
synthetic scenes.

Expected answers come from the scene generator (tools/tiny_demo_data.py), never from the model.
"""

from __future__ import annotations

import io
from collections import Counter
from pathlib import Path

import pytest

from examples import make_example_images
from tessera import LLM, TINY_DEMO_MODEL, SamplingParams
from tessera.entrypoints.cli import main as cli_main
from tools import tiny_demo_data

REPO = Path(__file__).resolve().parents[1]

HELD_OUT_SEED = 777  # training uses seeds 1 and 2, tools/eval_tiny_demo_model.py 12345


@pytest.fixture(scope="module")
def demo_llm():
    return LLM(str(TINY_DEMO_MODEL), kv_cache_memory="64MiB")


def test_bundled_folder_is_a_small_standard_hf_checkpoint():
    names = {p.name for p in TINY_DEMO_MODEL.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json"} <= names
    assert sum(p.stat().st_size for p in TINY_DEMO_MODEL.iterdir()) <= 20 * 2**20


def test_answers_held_out_questions(demo_llm):
    data = tiny_demo_data.make_dataset(40, seed=HELD_OUT_SEED)
    conversations = [
        [{"role": "user", "content": [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": question}]}]
        for image, question, _, _ in data
    ]
    outputs = demo_llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    right = [o.outputs[0].text.strip() == answer for o, (_, _, answer, _) in zip(outputs, data)]
    assert set(Counter(kind for *_, kind in data)) == set(tiny_demo_data.KINDS)  # every kind is asked
    assert sum(right) / len(right) >= 0.9, [(q, a, o.outputs[0].text) for o, (_, q, a, _) in zip(outputs, data)]


def expected_answers(shapes: list[dict]) -> dict[str, str]:
    """Question -> answer for every question the scene allows, from the scene definition."""
    qa = {"How many shapes are there?": tiny_demo_data.NUMBER_WORDS[len(shapes)],
          "Describe the image.": tiny_demo_data.describe(shapes)}  # fmt: skip
    for s in shapes:
        qa[f"What colour is the {s['shape']}?"] = s["colour"]
        qa[f"Where is the {s['shape']}?"] = tiny_demo_data.position_of(s["cx"], s["cy"])
        qa[f"What shape is the {s['colour']} object?"] = s["shape"]
    return qa


@pytest.mark.parametrize("name", sorted(make_example_images.SCENES))
def test_example_images_are_answered_correctly(demo_llm, name):
    image = str(REPO / "examples" / name)
    questions = expected_answers(make_example_images.SCENES[name])
    conversations = [
        [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": q}],
            }
        ]  # fmt: skip
        for q in questions
    ]
    outputs = demo_llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    assert {q: o.outputs[0].text.strip() for q, o in zip(questions, outputs)} == questions


def test_cli_answers_about_an_example_image(capsys):
    out = io.StringIO()
    code = cli_main(["generate", "Describe the image.", "--image", str(REPO / "examples" / "three_shapes.png"),
                     "--model", str(TINY_DEMO_MODEL)], stdout=out)  # fmt: skip
    assert code == 0
    assert out.getvalue() == tiny_demo_data.describe(make_example_images.SCENES["three_shapes.png"]) + "\n"
    assert "Loading" in capsys.readouterr().err  # model loading is reported
