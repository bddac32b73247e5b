"""The demo VLM's LoRA on SmolLM2 and the text-only self-distillation that keeps SmolLM2's answers.

``add_lora`` wraps every linear layer of the decoder in a ``LoRALinear`` (B starts at zero: training starts
from SmolLM2 exactly); ``lora_state`` is the shipped form that ``tessera.models.demo_vlm.merge_lora`` merges.
``base_answers`` are SmolLM2's own greedy answers (LoRA off); ``distillation_loss`` is the KL of the LoRA'd
model to SmolLM2 along them, and ``text_agreement`` counts the answers that stayed the same. ``blend_lora_states``
mixes two shipped LoRAs' updates (``python -m tools.demo_vlm_lora blend A B --weight W --out F``): a phase that
read better but forgot some of SmolLM2's text, blended with the one before it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F


class LoRALinear(torch.nn.Module):
    """A frozen linear layer plus a trainable low-rank update, W x + scale * B A x (float32 factors; B starts
    at zero, so training starts from SmolLM2 exactly). `enabled = False` gives the base layer (the teacher of
    the text-only distillation)."""

    enabled = True

    def __init__(self, base: torch.nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base, self.scale = base, alpha / rank
        device = base.weight.device
        self.lora_A = torch.nn.Parameter(torch.randn(rank, base.in_features, device=device) / base.in_features**0.5)
        self.lora_B = torch.nn.Parameter(torch.zeros(base.out_features, rank, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if LoRALinear.enabled:
            out = out + (x @ self.lora_A.to(x.dtype).T) @ (self.scale * self.lora_B).to(x.dtype).T
        return out


def add_lora(language_model, rank: int, alpha: float) -> dict[str, LoRALinear]:
    """Wrap every linear layer of the decoder (attention and MLP) in a LoRALinear -> {module name: wrapper}."""
    wrapped = {}
    for name, module in list(language_model.named_modules()):
        for child, layer in list(module.named_children()):
            if isinstance(layer, torch.nn.Linear):
                wrapper = LoRALinear(layer, rank, alpha)
                setattr(module, child, wrapper)
                wrapped[f"{name}.{child}" if name else child] = wrapper
    return wrapped


def lora_state(wrapped: dict[str, LoRALinear]) -> dict[str, torch.Tensor]:
    """The shipped form, named after the assembled checkpoint's weights (`language_model.model.{name}.weight`
    for the decoder's module `name`): `.lora_A` and `.lora_B` (scale folded into B), so W' = W + B @ A."""
    state = {}
    for name, layer in wrapped.items():
        state[f"language_model.model.{name}.lora_A"] = layer.lora_A.detach().cpu()
        state[f"language_model.model.{name}.lora_B"] = (layer.scale * layer.lora_B).detach().cpu()
    return state


@torch.no_grad()
def load_lora_state(wrapped: dict[str, LoRALinear], state: dict[str, torch.Tensor]) -> None:
    """The inverse of ``lora_state``: set the wrappers' factors from a saved state (to continue training)."""
    for name, layer in wrapped.items():
        layer.lora_A.copy_(state[f"language_model.model.{name}.lora_A"])
        layer.lora_B.copy_(state[f"language_model.model.{name}.lora_B"] / layer.scale)


@torch.no_grad()
def base_answers(model, tokenizer, prompts: list[str], max_new_tokens: int, batch: int = 32) -> list[list[int]]:
    """The model's greedy answer (token ids, through <|im_end|> when it finished) to each prompt, as a one-turn
    chat: SmolLM2's own before the LoRA is added (or with ``LoRALinear.enabled = False``)."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    side, tokenizer.padding_side = tokenizer.padding_side, "left"  # generation pads on the left
    try:
        answers = []
        for i in range(0, len(prompts), batch):
            chats = [[{"role": "user", "content": p}] for p in prompts[i : i + batch]]
            texts = tokenizer.apply_chat_template(chats, tokenize=False, add_generation_prompt=True)
            inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=end)
            for row in out[:, inputs["input_ids"].shape[1] :].tolist():
                answers.append(row[: row.index(end) + 1] if end in row else row)
    finally:
        tokenizer.padding_side = side
    return answers


def text_batch(tokenizer, prompts: list[str], answers: list[list[int]]) -> dict[str, torch.Tensor]:
    """Text-only chats (prompt + SmolLM2's answer), right-padded, with a mask of the answer positions."""
    rows = []
    for prompt, answer in zip(prompts, answers):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        rows.append((ids + answer, len(ids)))
    width = max(len(ids) for ids, _ in rows)
    batch = {"input_ids": torch.full((len(rows), width), tokenizer.pad_token_id),
             "attention_mask": torch.zeros(len(rows), width, dtype=torch.long),
             "answer": torch.zeros(len(rows), width, dtype=torch.bool)}  # fmt: skip
    for i, (ids, start) in enumerate(rows):
        batch["input_ids"][i, : len(ids)] = torch.tensor(ids)
        batch["attention_mask"][i, : len(ids)] = 1
        batch["answer"][i, start - 1 : len(ids) - 1] = True  # positions whose next token is the answer's
    return batch


def distillation_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """KL(SmolLM2 || SmolLM2 + LoRA) of the next-token distributions along SmolLM2's own answers."""
    lm = model.model.language_model
    batch = {key: value.to(model.device) for key, value in batch.items()}

    def logits() -> torch.Tensor:
        hidden = lm(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        return model.lm_head(hidden[batch["answer"]]).float()

    with torch.no_grad():
        LoRALinear.enabled = False
        try:
            teacher = F.log_softmax(logits(), dim=-1)
        finally:
            LoRALinear.enabled = True
    student = F.log_softmax(logits(), dim=-1)
    return F.kl_div(student, teacher, log_target=True, reduction="batchmean")


@torch.no_grad()
def text_agreement(model, tokenizer, prompts: list[str], expected: list[list[int]]) -> int:
    """How many of the prompts get SmolLM2's own greedy answer (`expected`, as many tokens) from the model."""
    got = base_answers(model, tokenizer, prompts, max(len(e) for e in expected))
    return sum(g[: len(e)] == e for g, e in zip(got, expected))


@torch.no_grad()
def blend_lora_states(first: dict, second: dict, weight: float, rank: int | None = None) -> dict[str, torch.Tensor]:
    """The shipped LoRA whose updates are weight * first's + (1 - weight) * second's (B @ A, per layer), factored
    again at `rank` (default: first's) by a truncated SVD, B and A sharing the singular values' square roots."""
    out = {}
    for key in first:
        if not key.endswith(".lora_A"):
            continue
        name = key.removesuffix(".lora_A")
        r = rank or first[key].shape[0]
        update = weight * first[f"{name}.lora_B"].float() @ first[key].float()
        update += (1 - weight) * second[f"{name}.lora_B"].float() @ second[key].float()
        u, s, vh = torch.linalg.svd(update, full_matrices=False)
        out[f"{name}.lora_B"] = (u[:, :r] * s[:r].sqrt()).contiguous()
        out[f"{name}.lora_A"] = (s[:r].sqrt()[:, None] * vh[:r]).contiguous()
    return out


def main() -> None:
    from safetensors.torch import load_file, save_file

    parser = argparse.ArgumentParser(description="Blend two shipped demo-VLM LoRAs (lora.safetensors files).")
    parser.add_argument("command", choices=("blend",))
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    parser.add_argument("--weight", type=float, required=True, help="the first one's share of the update")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    state = blend_lora_states(load_file(args.first), load_file(args.second), args.weight)
    save_file({k: v.half() for k, v in state.items()}, args.out, metadata={"format": "pt"})


if __name__ == "__main__":
    main()
