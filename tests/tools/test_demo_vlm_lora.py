"""The demo VLM's LoRA (a no-op at start, off for the teacher, shipped as what it computes) and the text-only
self-distillation (answer positions, a loss that is zero until the LoRA moves)."""

from __future__ import annotations

import pytest
import torch

from tools import demo_vlm_lora as lora


def test_the_lora_starts_as_the_base_layer_and_ships_as_what_it_computes():
    from tessera.models.demo_vlm import merge_lora

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    x = torch.randn(4, 6)
    expected = model(x)
    wrapped = lora.add_lora(model, rank=2, alpha=4.0)
    assert set(wrapped) == {"0", "2"} and isinstance(model[0], lora.LoRALinear)
    assert torch.equal(model(x), expected)  # B starts at zero
    for layer in wrapped.values():
        torch.nn.init.normal_(layer.lora_B)
    trained = model(x)
    assert not torch.allclose(trained, expected)
    lora.LoRALinear.enabled = False
    try:
        assert torch.equal(model(x), expected)  # the distillation's teacher
    finally:
        lora.LoRALinear.enabled = True
    tensors = {
        f"language_model.model.{n}.{p}": getattr(wrapped[n].base, p).detach()
        for n in wrapped
        for p in ("weight", "bias")
    }
    merge_lora(tensors, lora.lora_state(wrapped))
    merged = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    merged.load_state_dict({k.removeprefix("language_model.model."): v for k, v in tensors.items()})
    torch.testing.assert_close(merged(x), trained)


def test_a_saved_lora_loads_back_into_fresh_wrappers():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    x = torch.randn(4, 6)
    wrapped = lora.add_lora(model, rank=2, alpha=4.0)
    for layer in wrapped.values():
        torch.nn.init.normal_(layer.lora_B)
    trained, state = model(x), lora.lora_state(wrapped)
    rebuilt = torch.nn.Sequential(model[0].base, torch.nn.ReLU(), model[2].base)
    fresh = lora.add_lora(rebuilt, rank=2, alpha=4.0)
    assert not torch.allclose(rebuilt(x), trained)  # fresh wrappers start as the base layers
    lora.load_lora_state(fresh, state)
    torch.testing.assert_close(rebuilt(x), trained)


def test_text_batches_mark_the_positions_that_predict_the_answer():
    class Tokenizer:  # a stand-in: the chat template is the prompt's characters as ids
        pad_token_id = 0

        def apply_chat_template(self, messages, add_generation_prompt):
            return [ord(c) for c in messages[0]["content"]]

    batch = lora.text_batch(Tokenizer(), ["ab", "abcd"], [[7, 8, 9], [5]])
    assert batch["input_ids"].tolist() == [[97, 98, 7, 8, 9], [97, 98, 99, 100, 5]]
    assert batch["attention_mask"].tolist() == [[1] * 5, [1] * 5]
    # position i predicts token i + 1: the last prompt token predicts the first answer token
    assert batch["input_ids"][:, 1:][batch["answer"][:, :-1]].tolist() == [7, 8, 9, 5]


def test_the_distillation_loss_is_zero_until_the_lora_moves():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from testkit.demo_vlm import TINY_VISION

    text = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    torch.manual_seed(0)
    config = LlavaConfig(vision_config=CLIPVisionConfig(**TINY_VISION), text_config=text)
    model = LlavaForConditionalGeneration(config).eval()
    wrapped = lora.add_lora(model.model.language_model, rank=2, alpha=4.0)
    batch = {"input_ids": torch.randint(1, 64, (2, 7)), "attention_mask": torch.ones(2, 7, dtype=torch.long),
             "answer": torch.tensor([[0, 0, 1, 1, 1, 1, 0]] * 2, dtype=torch.bool)}  # fmt: skip
    assert lora.distillation_loss(model, batch).item() == pytest.approx(0.0, abs=1e-6)
    for layer in wrapped.values():
        torch.nn.init.normal_(layer.lora_B)
    loss = lora.distillation_loss(model, batch)
    assert loss.item() > 1e-3
    loss.backward()
    assert all(layer.lora_B.grad is not None for layer in wrapped.values())


def _state(generator: torch.Generator, rank: int) -> dict[str, torch.Tensor]:
    name = "language_model.model.layers.0.mlp.up_proj"
    return {f"{name}.lora_A": torch.randn(rank, 12, generator=generator),
            f"{name}.lora_B": torch.randn(20, rank, generator=generator)}  # fmt: skip


def _update(state: dict[str, torch.Tensor]) -> torch.Tensor:
    ((a_key, a),) = [(k, v) for k, v in state.items() if k.endswith(".lora_A")]
    return state[a_key.removesuffix(".lora_A") + ".lora_B"] @ a


def test_a_blend_mixes_the_updates_and_keeps_the_rank():
    g = torch.Generator().manual_seed(0)
    first, second = _state(g, 2), _state(g, 2)
    blended = lora.blend_lora_states(first, second, 0.25, rank=4)  # two rank-2 updates: exact at rank 4
    assert torch.allclose(_update(blended), 0.25 * _update(first) + 0.75 * _update(second), atol=1e-5)
    assert lora.blend_lora_states(first, first, 0.5, rank=2).keys() == first.keys()
    same = lora.blend_lora_states(first, second, 1.0)  # all of the first, at its own rank
    assert same[next(k for k in same if k.endswith("lora_A"))].shape == (2, 12)
    assert torch.allclose(_update(same), _update(first), atol=1e-5)
