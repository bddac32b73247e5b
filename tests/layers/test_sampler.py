"""The sampler against sets and distributions built by hand from small logit vectors."""

from __future__ import annotations

import math

import pytest
import torch

from tessera.layers.sampler import TokenMask, sample
from tessera.sampling_params import SamplingParams

# Token probabilities chosen so that every filter below keeps a set that is easy to see by hand.
PROBS = [0.05, 0.40, 0.10, 0.30, 0.15]
LOGITS = torch.tensor([math.log(p) for p in PROBS]) + 3.0  # softmax ignores the shift


def draw(logits, params, count=600, seed=0):
    """`count` samples of one logits row, all drawn from one seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    out = sample(logits.repeat(count, 1), [params] * count, [generator] * count)
    return out.token_ids


def top_p_set(probs, top_p):
    """The smallest set of most likely tokens whose probabilities sum to at least top_p."""
    kept, mass = set(), 0.0
    for token in sorted(range(len(probs)), key=lambda t: -probs[t]):
        if mass >= top_p:
            break
        kept.add(token)
        mass += probs[token]
    return kept


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    out = sample(logits, [SamplingParams(temperature=0.0)] * 6, [None] * 6)
    assert out.token_ids == [int(row.argmax()) for row in logits]
    assert out.logprobs == [None] * 6


def test_seeded_sampling_is_reproducible_and_depends_on_the_seed():
    params = SamplingParams(temperature=1.0)
    logits = torch.zeros(1, 1000)  # uniform: any two seeds almost surely differ somewhere
    assert draw(logits[0], params, 20, seed=1) == draw(logits[0], params, 20, seed=1)
    assert draw(logits[0], params, 20, seed=1) != draw(logits[0], params, 20, seed=2)


def test_a_seeded_row_is_unaffected_by_the_other_rows_of_the_batch():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0)
    alone = sample(logits[1:2], [params], [torch.Generator().manual_seed(7)]).token_ids[0]
    others = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(7), None]
    batched = sample(logits, [params, params, SamplingParams(temperature=0.0)], others).token_ids
    assert batched[1] == alone


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_sampling_follows_the_scaled_softmax(temperature):
    expected = torch.softmax(LOGITS / temperature, dim=-1)
    tokens = draw(LOGITS, SamplingParams(temperature=temperature), count=4000)
    frequencies = torch.bincount(torch.tensor(tokens), minlength=len(PROBS)) / len(tokens)
    assert torch.allclose(frequencies, expected, atol=0.03)


@pytest.mark.parametrize("top_k", [1, 2, 3, 4])
def test_top_k_keeps_exactly_the_k_most_likely_tokens(top_k):
    allowed = set(sorted(range(len(PROBS)), key=lambda t: -PROBS[t])[:top_k])
    assert set(draw(LOGITS, SamplingParams(top_k=top_k))) == allowed


@pytest.mark.parametrize("top_k", [0, -1, len(PROBS), 100])
def test_top_k_zero_minus_one_or_at_least_the_vocab_keeps_everything(top_k):
    assert set(draw(LOGITS, SamplingParams(top_k=top_k))) == set(range(len(PROBS)))


@pytest.mark.parametrize("top_p", [0.3, 0.45, 0.75, 0.8, 0.9, 0.99])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p):
    assert set(draw(LOGITS, SamplingParams(top_p=top_p))) == top_p_set(PROBS, top_p)


def test_top_p_applies_to_the_temperature_scaled_distribution():
    temperature, top_p = 0.5, 0.8
    scaled = torch.softmax(LOGITS / temperature, dim=-1).tolist()
    allowed = top_p_set(scaled, top_p)
    assert allowed != top_p_set(PROBS, top_p)  # the test can tell the two apart
    assert set(draw(LOGITS, SamplingParams(temperature=temperature, top_p=top_p))) == allowed


@pytest.mark.parametrize("min_p", [0.1, 0.3, 0.5, 0.9])
def test_min_p_drops_tokens_below_min_p_times_the_most_likely(min_p):
    allowed = {t for t, p in enumerate(PROBS) if p >= min_p * max(PROBS)}
    assert set(draw(LOGITS, SamplingParams(min_p=min_p))) == allowed


def test_top_k_top_p_and_min_p_combine():
    # Applied in order: top_k=4 drops token 0, top_p=0.9 over the renormalised rest keeps all four
    # (the mass before token 2 is 0.85 / 0.95 < 0.9), then min_p=0.3 drops token 2 (0.10 < 0.3 * 0.40).
    top4 = sorted(range(len(PROBS)), key=lambda t: -PROBS[t])[:4]
    renormalised = [PROBS[t] / sum(PROBS[u] for u in top4) if t in top4 else 0.0 for t in range(len(PROBS))]
    allowed = top_p_set(renormalised, 0.9)
    allowed = {t for t in allowed if renormalised[t] >= 0.3 * max(renormalised)}
    assert allowed != top_p_set(renormalised, 0.9)  # min_p changes the set
    params = SamplingParams(top_k=4, top_p=0.9, min_p=0.3)
    assert set(draw(LOGITS, params)) == allowed


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_hold_the_sampled_and_top_tokens_with_log_softmax_values(temperature):
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=temperature, logprobs=n) for n in (0, 1, 3, 5)]
    out = sample(logits, params, [torch.Generator().manual_seed(i) for i in range(4)])
    expected = torch.log_softmax(logits, dim=-1)  # the model's distribution, before temperature
    for row, (p, token, entry) in enumerate(zip(params, out.token_ids, out.logprobs)):
        top = set(expected[row].topk(p.logprobs).indices.tolist())
        assert set(entry) == top | {token}
        for t, value in entry.items():
            assert value == pytest.approx(float(expected[row, t]), abs=1e-5)


def test_logprobs_only_for_the_rows_that_ask():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=2), SamplingParams()]
    out = sample(logits, params, [None, None, torch.Generator().manual_seed(0)])
    assert out.logprobs[0] is None and out.logprobs[2] is None
    assert set(out.logprobs[1]) == set(logits[1].topk(2).indices.tolist())


# ---- token masks (structured outputs) -------------------------------------------------------------------------------


def bitmask_of(allowed_rows: list[set[int]], vocab: int) -> torch.Tensor:
    """xgrammar's layout built by hand: bit j of int32 word w allows token 32 * w + j."""
    words = torch.zeros(len(allowed_rows), (vocab + 31) // 32, dtype=torch.int64)
    for k, allowed in enumerate(allowed_rows):
        for token in allowed:
            words[k, token // 32] |= 1 << (token % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # bit 31 is the sign bit


def test_a_token_mask_unpacks_to_the_allowed_tokens_including_bit_31():
    allowed = [{0, 31, 32, 63, 69}, set(range(70))]
    mask = TokenMask([0, 1], bitmask_of(allowed, 70))
    unpacked = mask.allowed(70, torch.device("cpu"))
    assert unpacked.shape == (2, 70)
    assert [set(torch.nonzero(row).flatten().tolist()) for row in unpacked] == allowed
    assert mask.allowed(100, torch.device("cpu"))[:, 70:].any().item() is False  # past the bitmask: not allowed


def test_masked_rows_take_their_best_allowed_token_and_the_others_are_untouched():
    logits = torch.randn(4, 70, generator=torch.Generator().manual_seed(0))
    allowed = {5, 40, 66}
    params = [SamplingParams(temperature=0.0)] * 4
    alone = sample(logits, params, [None] * 4).token_ids
    out = sample(logits, params, [None] * 4, TokenMask([1, 3], bitmask_of([allowed, {7}], 70)))
    assert out.token_ids[1] == max(allowed, key=lambda t: float(logits[1, t]))
    assert out.token_ids[3] == 7
    assert [out.token_ids[0], out.token_ids[2]] == [alone[0], alone[2]]


def test_sampled_masked_rows_draw_only_allowed_tokens_and_seeded_others_are_unchanged():
    logits = torch.zeros(2, 64)
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)
    mask = TokenMask([0], bitmask_of([{3, 33, 60}], 64))
    drawn = set()
    for seed in range(40):
        generators = [torch.Generator().manual_seed(seed), torch.Generator().manual_seed(1000 + seed)]
        out = sample(logits, [params, params], generators, mask)
        drawn.add(out.token_ids[0])
        alone = sample(logits[1:], [params], [torch.Generator().manual_seed(1000 + seed)]).token_ids[0]
        assert out.token_ids[1] == alone
    assert drawn == {3, 33, 60}


def test_logprobs_of_a_masked_row_are_the_model_distribution():
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(2))
    out = sample(logits, [SamplingParams(temperature=0.0, logprobs=2)], [None], TokenMask([0], bitmask_of([{9}], 40)))
    expected = torch.log_softmax(logits[0], dim=-1)
    assert out.token_ids == [9]
    assert out.logprobs[0][9] == pytest.approx(float(expected[9]), abs=1e-5)
