"""Tiny, randomly initialised Idefics3 and SmolVLM (SmolVLM2, with videos) checkpoints in Hugging Face
folder format, built offline.

Vision: Idefics3's SigLIP-like tower, 32-pixel tiles of 8-pixel patches (4x4 patches), width 32, 2
layers, 4 heads; pixel shuffle by 2, so each tile gives 4 `<image>` tokens. Text: Llama, hidden 32, 2
layers, 4 heads over 2 KV heads. The processor resizes each image's longest edge to 96 pixels and
splits it into up to 3x3 tiles of 32 pixels plus the whole image shrunk to one tile. The tokenizer is
the test "llava" tokenizer with Idefics3's special tokens added (`<fake_token_around_image>`,
`<global-img>`, `<row_i_col_j>`, `<end_of_utterance>`, and SmolVLM's `<video>`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import AddedToken
from transformers import (
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3ImageProcessor,
    Idefics3Processor,
    LlamaConfig,
)

from .tokenizer import build_tokenizer

TILE, PATCH, SCALE_FACTOR, LONGEST_EDGE = 32, 8, 2, 96
IMAGE_SEQ_LEN = (TILE // PATCH) ** 2 // SCALE_FACTOR**2
IDEFICS3_SPECIAL_TOKENS = (
    "<fake_token_around_image>", "<global-img>", "<end_of_utterance>", "<video>",
    *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)),
)  # fmt: skip
# As SmolVLM's: "User:<image>...<end_of_utterance>\nAssistant:"
IDEFICS3_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}{{ '<image>' }}{% elif part['type'] == 'video' %}{{ '<video>' }}"
    "{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def idefics3_tokenizer(*, video_token: bool = True):
    """`video_token=False`: without SmolVLM's `<video>` (as some SmolVLM checkpoints), which then is
    plain text, as SmolVLMProcessor treats it."""
    tokenizer = build_tokenizer("llava")
    specials = [t for t in IDEFICS3_SPECIAL_TOKENS if video_token or t != "<video>"]
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [AddedToken(t, normalized=False, special=True) for t in specials]}
    )
    tokenizer.chat_template = IDEFICS3_CHAT_TEMPLATE
    return tokenizer


def _configs(tokenizer) -> tuple[dict, dict]:
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=TILE,
        patch_size=PATCH, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
    )  # fmt: skip
    text = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(tokenizer), max_position_embeddings=2048, rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    return vision, text


def _save_model(folder: Path, model_cls, config, seed: int) -> None:
    """Widened random weights (HF's init leaves small ones, so outputs would hardly depend on the image)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.ndim >= 2 and "norm" not in name:
                    param.normal_(0, 0.2)
        model.save_pretrained(folder, safe_serialization=True)


def _image_processor_kwargs() -> dict:
    return dict(
        do_resize=True, size={"longest_edge": LONGEST_EDGE}, max_image_size={"longest_edge": TILE},
        do_image_splitting=True, do_pad=True,
    )  # fmt: skip


def build_tiny_idefics3(folder, *, seed: int = 0) -> Path:
    """Write the checkpoint (config, safetensors, tokenizer, processor) to `folder`; returns it."""
    folder = Path(folder)
    tokenizer = idefics3_tokenizer()
    vision, text = _configs(tokenizer)
    config = Idefics3Config(
        vision_config=vision, text_config=text, scale_factor=SCALE_FACTOR,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    _save_model(folder, Idefics3ForConditionalGeneration, config, seed)
    Idefics3Processor(
        image_processor=Idefics3ImageProcessor(**_image_processor_kwargs()),
        tokenizer=tokenizer,
        image_seq_len=IMAGE_SEQ_LEN,
        chat_template=IDEFICS3_CHAT_TEMPLATE,
    ).save_pretrained(folder)
    return folder


def build_tiny_smolvlm(folder, *, seed: int = 0, max_frames: int = 8, video_token: bool = True) -> Path:
    """SmolVLM2 layout (SmolVLMForConditionalGeneration, SmolVLMProcessor with a video processor whose
    frames are squared to one 32-pixel tile each); write the checkpoint to `folder`; returns it.
    `video_token=False`: the tokenizer has no `<video>` token (see `idefics3_tokenizer`).
    SmolVLMProcessor needs the `num2words` package."""
    from transformers import (
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
        SmolVLMImageProcessor,
        SmolVLMProcessor,
        SmolVLMVideoProcessor,
    )

    folder = Path(folder)
    tokenizer = idefics3_tokenizer(video_token=video_token)
    vision, text = _configs(tokenizer)
    config = SmolVLMConfig(
        vision_config=vision, text_config=text, scale_factor=SCALE_FACTOR,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    _save_model(folder, SmolVLMForConditionalGeneration, config, seed)
    video_processor = SmolVLMVideoProcessor(
        size={"longest_edge": LONGEST_EDGE}, max_image_size={"longest_edge": TILE},
        video_sampling={"max_frames": max_frames, "fps": 1, "video_size": {"longest_edge": LONGEST_EDGE}},
    )  # fmt: skip
    SmolVLMProcessor(
        image_processor=SmolVLMImageProcessor(**_image_processor_kwargs()),
        tokenizer=tokenizer,
        video_processor=video_processor,
        image_seq_len=IMAGE_SEQ_LEN,
        chat_template=IDEFICS3_CHAT_TEMPLATE,
    ).save_pretrained(folder)
    return folder
