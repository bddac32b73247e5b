"""SamplingParams: bad values are rejected on construction, naming the field; shorthands are normalised."""

from __future__ import annotations

import re

import pytest
import torch

from tessera.layers.sampler import sample
from tessera.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("max_tokens", 0),
        ("temperature", -0.1),
        ("top_k", -2),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("logprobs", -1),
        ("truncate_prompt_tokens", 0),
    ],
)
def test_an_out_of_range_field_is_a_value_error_naming_it(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must .*{value}"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("stop", ["", ["ok", ""]])
def test_an_empty_stop_string_is_rejected(stop):
    with pytest.raises(ValueError, match="stop strings must not be empty"):
        SamplingParams(stop=stop)


@pytest.mark.parametrize("stop, expected", [(None, []), ("END", ["END"]), (["a", "b"], ["a", "b"]), (("x",), ["x"])])
def test_stop_is_normalised_to_a_list(stop, expected):
    assert SamplingParams(stop=stop).stop == expected


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": None},
        {"temperature": 0.0, "top_p": 1.0, "min_p": 1.0},
        {"top_k": 1, "logprobs": 0, "truncate_prompt_tokens": 1, "n": 4},
    ],
)
def test_boundary_values_are_accepted(kwargs):
    params = SamplingParams(**kwargs)
    assert all(getattr(params, k) == v for k, v in kwargs.items())


@pytest.mark.parametrize("temperature, greedy", [(0.0, True), (1e-7, True), (0.01, False), (1.0, False)])
def test_greedy_means_temperature_zero(temperature, greedy):
    assert SamplingParams(temperature=temperature).greedy is greedy


def test_top_k_minus_one_means_all_tokens():
    params = SamplingParams(top_k=-1)
    assert params.top_k == 0
    # and samples like "no top-k": the same seeded draws over the whole of a uniform vocabulary
    logits = torch.zeros(400, 8)
    draws = {
        k: sample(logits, [SamplingParams(top_k=k)] * 400, [torch.Generator().manual_seed(0)] * 400).token_ids
        for k in (-1, 0)
    }
    assert draws[-1] == draws[0]
    assert set(draws[-1]) == set(range(8))


# ---- structured outputs --------------------------------------------------------------------------------------------


def test_structured_outputs_take_exactly_one_constraint():
    from tessera.sampling_params import StructuredOutputsParams

    with pytest.raises(ValueError, match="exactly one of json, json_object, regex, choice, grammar; got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
        ({"json": "[1, 2]"}, "must be a JSON schema"),
        ({"json": 5}, "must be a JSON schema"),
        ({"json_object": "yes"}, "json_object must be true"),
        ({"regex": 7}, "regex must be a non-empty string"),
        ({"grammar": ["root"]}, "grammar must be a non-empty string"),
        ({"choice": []}, "choice must be a non-empty list"),
        ({"choice": ["a", 3]}, "choice must be a non-empty list of non-empty strings"),
        ({"choice": "ab"}, "choice must be a non-empty list"),
    ],
)
def test_a_malformed_constraint_is_a_value_error_naming_it(kwargs, message):
    from tessera.sampling_params import StructuredOutputsParams

    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_take_structured_outputs_as_a_dict():
    from tessera.sampling_params import StructuredOutputsParams

    params = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert params.structured_outputs == StructuredOutputsParams(choice=["a", "b"])
    assert params.structured_outputs.kind == "choice"
    with pytest.raises(ValueError, match="Unknown structured_outputs field"):
        SamplingParams(structured_outputs={"schema": {}})
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="json")
