"""Demo: process an image prompt for a tiny LLaVA model and show what the engine would receive.

Builds a tiny LLaVA checkpoint offline (random weights: generation comes in a later release),
draws a picture, and prints the prompt tokens with the image placeholder ranges.

    python -m examples.process_image_prompt   # from the repository root
"""

from __future__ import annotations

import tempfile
from itertools import groupby
from pathlib import Path

from PIL import Image, ImageDraw

from tessera.multimodal import MULTIMODAL_REGISTRY
from testkit import build_tiny_llava


def draw_scene() -> Image.Image:
    image = Image.new("RGB", (96, 64), "white")
    draw = ImageDraw.Draw(image)
    draw.ellipse((8, 16, 40, 48), fill="red")
    draw.rectangle((56, 16, 88, 48), fill="blue")
    return image


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        show(build_tiny_llava(Path(tmp) / "tiny-llava"))


def show(folder: Path) -> None:
    processor = MULTIMODAL_REGISTRY.create_processor(folder)
    prompt = "USER: <image>\nWhat colour is the circle? ASSISTANT:"
    out = processor.apply(prompt, {"image": draw_scene()})

    tokenizer = processor.info.get_tokenizer()
    print(f"model:   {folder} ({processor.info.get_hf_config().architectures[0]})")
    print(f"prompt:  {prompt!r}")
    print(f"tokens:  {len(out['prompt_token_ids'])}")
    for modality, ranges in out["mm_placeholders"].items():
        for i, r in enumerate(ranges):
            print(
                f"{modality} {i}: placeholder tokens [{r.offset}, {r.offset + r.length}), "
                f"{r.get_num_embeds()} embeddings, hash {out['mm_hashes'][modality][i][:16]}"
            )
    print("prompt tokens (runs of a repeated token shown as token x count):")
    pieces = []
    for token_id, run in groupby(out["prompt_token_ids"]):
        count = len(list(run))
        pieces.append(f"{tokenizer.convert_ids_to_tokens(token_id)}" + (f" x{count}" if count > 1 else ""))
    print("  " + " | ".join(pieces))
    for key, value in out["mm_kwargs"].items():
        print(f"model input {key}: {tuple(value.shape)} {value.dtype}")


if __name__ == "__main__":
    main()
