"""Structured outputs on the bundled demo model (a tiny LLaVA that knows nothing about JSON): every
constraint's output obeys it and ends when the grammar is complete; invalid constraints are InputErrors
at admission; the grammar cache is bounded; unconstrained requests batched with constrained ones get
the same tokens as alone."""

from __future__ import annotations

import json
import re

import pytest

from tessera import LLM, TINY_DEMO_MODEL
from tessera.engine.core.structured_output import StructuredOutputManager, choice_grammar
from tessera.errors import InputError
from tessera.sampling_params import SamplingParams, StructuredOutputsParams

PROMPT = "Describe the image."
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "ok", "count", "color"],
    "additionalProperties": False,
}


def check_schema(value) -> None:
    """SCHEMA checked by hand (jsonschema is not a dependency)."""
    assert isinstance(value, dict) and list(value) == ["name", "ok", "count", "color"]  # in the schema's order
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert isinstance(value["ok"], bool)
    assert type(value["count"]) is int and 0 <= value["count"] <= 99
    assert value["color"] in ("red", "green", "blue")


@pytest.fixture(scope="module")
def llm():
    return LLM(str(TINY_DEMO_MODEL), device="cpu", kv_cache_memory="8MiB")


def run(llm, constraint, n=1, temperature=0.0, seed=None, max_tokens=60, prompt=PROMPT):
    params = SamplingParams(
        n=n, temperature=temperature, seed=seed, max_tokens=max_tokens, structured_outputs=constraint
    )
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 0), (1.0, 1), (1.3, 2)])
def test_a_json_schema_output_parses_and_validates(llm, temperature, seed):
    (out,) = run(llm, StructuredOutputsParams(json=SCHEMA), temperature=temperature, seed=seed)
    assert out.finish_reason == "stop", out.text
    check_schema(json.loads(out.text))


def test_a_schema_given_as_json_text_works_the_same(llm):
    as_dict = run(llm, StructuredOutputsParams(json=SCHEMA))[0].text
    assert run(llm, StructuredOutputsParams(json=json.dumps(SCHEMA)))[0].text == as_dict


def test_json_object_output_starts_an_object_and_parses_when_complete(llm):
    (out,) = run(llm, StructuredOutputsParams(json_object=True), temperature=1.0, seed=0, max_tokens=40)
    assert out.text.startswith("{")
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_choice_output_is_one_of_the_choices(llm, seed):
    choices = ["yes", "no", "a red circle", 'say "hi"\\n']
    (out,) = run(llm, StructuredOutputsParams(choice=choices), temperature=1.0, seed=seed)
    assert out.text in choices and out.finish_reason == "stop"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_regex_output_fully_matches(llm, seed):
    pattern = r"[a-c]{3}-\d{2}( ok)?"
    (out,) = run(llm, StructuredOutputsParams(regex=pattern), temperature=1.0, seed=seed)
    assert re.fullmatch(pattern, out.text) and out.finish_reason == "stop"


def test_a_grammar_output_is_a_sentence_of_it(llm):
    grammar = 'root ::= animal " " digit\nanimal ::= "cat" | "dog"\ndigit ::= [0-9]'
    (out,) = run(llm, StructuredOutputsParams(grammar=grammar), temperature=1.0, seed=0)
    assert re.fullmatch(r"(cat|dog) [0-9]", out.text) and out.finish_reason == "stop"


def test_each_of_n_outputs_walks_its_own_grammar(llm):
    outs = run(llm, StructuredOutputsParams(json=SCHEMA), n=3, temperature=1.0, seed=5)
    assert len(outs) == 3
    for out in outs:
        check_schema(json.loads(out.text))


def test_constrained_and_unconstrained_requests_in_one_batch(llm):
    prompts = [PROMPT, "What shapes are there?", "Colors?"]
    plain = [SamplingParams(temperature=0.0, max_tokens=12), SamplingParams(temperature=1.0, seed=3, max_tokens=12)]
    alone = [
        llm.generate([prompts[0]], plain[0], use_tqdm=False)[0],
        llm.generate([prompts[1]], plain[1], use_tqdm=False)[0],
    ]
    constrained = SamplingParams(
        temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    mixed = llm.generate(prompts, [plain[0], plain[1], constrained], use_tqdm=False)
    for a, b in zip(alone, mixed[:2]):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
    check_schema(json.loads(mixed[2].outputs[0].text))


@pytest.mark.parametrize(
    "constraint, message",
    [
        (StructuredOutputsParams(json={"type": "frobnicate"}), "json"),
        (StructuredOutputsParams(regex="a(b"), "regex"),
        (StructuredOutputsParams(grammar="root ::= undefined_rule"), "grammar"),
    ],
)
def test_an_invalid_constraint_is_an_input_error_at_admission(llm, constraint, message):
    engine = llm.engine
    with pytest.raises(InputError, match=rf"Invalid structured output constraint \({message}\)"):
        engine.add_request("bad", PROMPT, SamplingParams(structured_outputs=constraint))
    assert not engine.has_unfinished_requests() and "bad" not in engine.output_processor
    (out,) = run(llm, StructuredOutputsParams(choice=["fine"]))  # the engine serves on
    assert out.text == "fine"


def test_the_grammar_cache_is_bounded_and_hits_repeats(llm):
    engine = llm.engine
    manager = StructuredOutputManager(engine.tokenizer, 380, engine.core.eos_token_ids, cache_size=2)
    a, b, c = (StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+"))
    first = manager.compile(a)
    assert manager.compile(StructuredOutputsParams(regex="a+")) is first and manager.num_compiled == 1
    manager.compile(b)
    manager.compile(a)  # a is now the most recently used
    manager.compile(c)  # drops b
    assert len(manager) == 2 and manager.num_compiled == 3
    assert manager.compile(a) is first and manager.num_compiled == 3
    manager.compile(b)
    assert manager.num_compiled == 4


def test_the_cache_key_keeps_property_order():
    # the output writes properties in the schema's order, so two orders are two grammars
    from tessera.engine.core.structured_output import _key

    one = StructuredOutputsParams(json={"properties": {"a": {}, "b": {}}})
    two = StructuredOutputsParams(json={"properties": {"b": {}, "a": {}}})
    assert _key(one) != _key(two)
    assert _key(one) == _key(StructuredOutputsParams(json='{"properties": {"a": {}, "b": {}}}'))


def test_choice_grammar_escapes_quotes_and_backslashes():
    assert choice_grammar(['a"b', "c\\d"]) == r'root ::= "a\"b" | "c\\d"'


def test_preempted_constrained_requests_keep_their_grammar_state(llm):
    """With a KV cache too small for four at once the requests are preempted and recomputed; the
    matchers are not replayed, so the outputs are those of a roomy cache."""
    params = SamplingParams(
        temperature=1.0, seed=1, max_tokens=60, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    roomy = [o.outputs[0].text for o in llm.generate([PROMPT] * 4, params, use_tqdm=False)]
    small = LLM(str(TINY_DEMO_MODEL), device="cpu", kv_cache_memory="256KiB", block_size=4)
    outputs = small.generate([PROMPT] * 4, params, use_tqdm=False)
    assert small.engine.core.scheduler.num_preemptions > 0
    assert [o.outputs[0].text for o in outputs] == roomy
    for text in roomy:
        check_schema(json.loads(text))
