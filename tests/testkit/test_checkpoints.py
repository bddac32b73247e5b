"""The tiny checkpoints must behave like the real ones under Hugging Face's own processors and models,
since the rest of the suite uses HF as the reference for tessera."""

import math

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    AutoConfig,
    AutoProcessor,
    AutoTokenizer,
    FuyuForCausalLM,
    FuyuProcessor,
    LlavaForConditionalGeneration,
    LlavaProcessor,
)

from testkit import build_llava_15_shaped_processor_folder, build_tiny_fuyu, build_tiny_llava, build_tokenizer

TEXTS = ["What is in the image?", "Describe  the image.\nThere are 12 red stars!", "héllo wörld 🙂 |x|"]


def random_image(height: int, width: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.mark.parametrize("flavour", ["llava", "fuyu"])
@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trip(flavour, text):
    tok = build_tokenizer(flavour)
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text


def test_fuyu_tokenizer_mimics_sentencepiece_word_boundary():
    tok = build_tokenizer("fuyu")
    assert tok.bos_token == tok.eos_token == "|ENDOFTEXT|"
    for marker in ("|SPEAKER|", "|NEWLINE|"):
        assert tok.convert_ids_to_tokens(tok(marker, add_special_tokens=False).input_ids) == ["Ġ", marker]
    assert tok.convert_ids_to_tokens(tok("What").input_ids) == ["|ENDOFTEXT|", "ĠWhat"]
    assert {"<s>", "<0x04>"} <= tok.vocab.keys()


def test_llava_tokenizer_special_tokens_and_chat_template():
    tok = build_tokenizer("llava")
    image_id = tok.convert_tokens_to_ids("<image>")
    assert tok("a<image>b", add_special_tokens=False).input_ids.count(image_id) == 1
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the image?"}]}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "USER: <image>\nWhat is in the image? ASSISTANT:"


@pytest.mark.parametrize(
    ("folder_fixture", "model_class", "processor_class"),
    [
        ("tiny_llava_dir", LlavaForConditionalGeneration, LlavaProcessor),
        ("tiny_fuyu_dir", FuyuForCausalLM, FuyuProcessor),
    ],
)
def test_folders_reload_through_auto_classes(request, folder_fixture, model_class, processor_class):
    folder = request.getfixturevalue(folder_fixture)
    config = AutoConfig.from_pretrained(folder)
    assert config.architectures == [model_class.__name__]
    assert isinstance(AutoProcessor.from_pretrained(folder), processor_class)
    assert len(AutoTokenizer.from_pretrained(folder)) == config.text_config.vocab_size
    _, info = model_class.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


def test_builds_are_deterministic_per_seed(tmp_path):
    weights = [(build_tiny_fuyu(tmp_path / str(s), seed=s) / "model.safetensors").read_bytes() for s in (0, 0, 1)]
    assert weights[0] == weights[1] != weights[2]


@pytest.mark.parametrize(("strategy", "extra"), [("default", 0), ("full", 1)])
def test_llava_processor_expansion_matches_model(tmp_path, strategy, extra):
    folder = build_tiny_llava(tmp_path, image_size=32, patch_size=8, vision_feature_select_strategy=strategy)
    processor = AutoProcessor.from_pretrained(folder)
    inputs = processor(text="USER: <image>\nWhat colour? ASSISTANT:", images=random_image(40, 70), return_tensors="pt")
    model = LlavaForConditionalGeneration.from_pretrained(folder)
    config = model.config
    assert (inputs.input_ids == config.image_token_index).sum() == (32 // 8) ** 2 + extra == config.image_seq_length
    assert inputs.pixel_values.shape == (1, 3, 32, 32)
    with torch.no_grad():  # HF checks that image features and <image> tokens agree in number
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs.input_ids.shape[1], config.text_config.vocab_size)


def test_llava_15_shaped_processor_gives_576_image_tokens(tmp_path):
    folder = build_llava_15_shaped_processor_folder(tmp_path)
    inputs = AutoProcessor.from_pretrained(folder)(text="<image>hi", images=random_image(480, 640), return_tensors="pt")
    assert (inputs.input_ids == AutoConfig.from_pretrained(folder).image_token_index).sum() == 576
    assert inputs.pixel_values.shape == (1, 3, 336, 336)


@pytest.mark.parametrize(("height", "width"), [(48, 48), (20, 30), (96, 64), (13, 200)])
def test_fuyu_processor_layout_matches_first_principles(tiny_fuyu_dir, height, width):
    processor = AutoProcessor.from_pretrained(tiny_fuyu_dir)
    tok = processor.tokenizer
    # FuyuImageProcessor only shrinks (aspect preserved, floor) to fit 48x48, then tiles with 8x8 patches.
    scale = min(1.0, 48 / height, 48 / width)
    rows, cols = math.ceil(int(height * scale) / 8), math.ceil(int(width * scale) / 8)
    inputs = processor(text="What colour?", images=random_image(height, width))

    ids = inputs.input_ids[0].tolist()
    speaker, newline = tok.vocab["|SPEAKER|"], tok.vocab["|NEWLINE|"]
    image_part = ([speaker] * cols + [newline]) * rows
    prompt = tok("What colour?", add_special_tokens=False).input_ids
    assert ids == image_part + [tok.vocab["<s>"]] + prompt + [tok.vocab["<0x04>"]]
    assert inputs.image_patches.shape == (rows * cols, 8 * 8 * 3)  # transformers 5: the prompt's patches

    model = FuyuForCausalLM.from_pretrained(tiny_fuyu_dir)
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, len(ids), model.config.text_config.vocab_size)
