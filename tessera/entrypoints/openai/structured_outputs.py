"""The OpenAI API's ways of asking for structured output, mapped onto StructuredOutputsParams:
`response_format` ({"type": "text"} is off, {"type": "json_object"}, {"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}), vLLM's `structured_outputs: {...}` and its older
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`. At most one of them may ask for a
constraint."""

from __future__ import annotations

from typing import Any, Optional

from ...sampling_params import StructuredOutputsParams

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class StructuredOutputError(ValueError):
    """A structured-output parameter is malformed (reported with `param` set to its name)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def from_response_format(response_format: Optional[dict[str, Any]]) -> Optional[StructuredOutputsParams]:
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError(
                'response_format of type "json_schema" needs "json_schema": {"name": ..., "schema": {...}}'
            )
        schema = spec.get("schema")
        if schema is None:
            raise ValueError('response_format.json_schema needs a "schema" (the JSON schema of the output)')
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema must be a JSON schema object")
        return StructuredOutputsParams(json=schema)
    raise ValueError(f"response_format type {kind!r} is not supported; use 'text', 'json_object' or 'json_schema'")


def structured_outputs_of(
    response_format: Optional[dict[str, Any]],
    structured_outputs: Optional[dict[str, Any]],
    guided: dict[str, Any],
) -> Optional[StructuredOutputsParams]:
    """The request's constraint, or None; a malformed or ambiguous one raises StructuredOutputError."""
    found: dict[str, StructuredOutputsParams] = {}
    try:
        param = "response_format"
        if (params := from_response_format(response_format)) is not None:
            found[param] = params
        param = "structured_outputs"
        if structured_outputs is not None:
            found[param] = StructuredOutputsParams.from_dict(structured_outputs)
        for param, value in guided.items():
            if value is not None:
                found[param] = StructuredOutputsParams(**{GUIDED[param]: value})
    except (ValueError, TypeError) as e:
        raise StructuredOutputError(param, str(e)) from None
    if len(found) > 1:
        names = ", ".join(found)
        raise StructuredOutputError(next(iter(found)), f"Send only one structured output constraint; got {names}")
    return next(iter(found.values()), None)
