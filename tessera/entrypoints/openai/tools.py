"""Tool calling in chat requests: the `tools` and `tool_choice` OpenAI accepts, checked, and the
tools as chat templates take them.

`tool_choice` "none" keeps the tools out of the prompt; "auto" (the default when tools are given)
renders them through the chat template and parses the answer with the server's tool-call parser.
"required" and a named function constrain the answer to a call with structured outputs
(`tool_choice_schema`), so its arguments always parse."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from .tool_parsers import ToolParser
from .tool_parsers.constrained import NamedFunctionToolParser, RequiredToolParser


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")  # OpenAI's: letters, digits, _ and -, up to 64
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema object
    strict: Optional[bool] = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


def check_tools(tools: Optional[list[ChatTool]], tool_choice: Optional[ToolChoice]) -> None:
    """ValueError (a 400) for a tool_choice that does not fit the tools."""
    names = [tool.function.name for tool in tools or []]
    duplicated = sorted({name for name in names if names.count(name) > 1})
    if duplicated:
        raise ValueError(f"tools: the function name(s) {', '.join(map(repr, duplicated))} appear more than once.")
    if isinstance(tool_choice, NamedToolChoice):
        if tool_choice.function.name not in names:
            known = ", ".join(map(repr, names)) or "none"
            raise ValueError(
                f"tool_choice names the function {tool_choice.function.name!r}, which is not in tools (tools: {known})."
            )
    elif tool_choice == "required" and not names:
        raise ValueError('tool_choice "required" needs at least one tool in tools.')


def effective_tool_choice(tools: Optional[list[ChatTool]], tool_choice: Optional[ToolChoice]) -> ToolChoice:
    """OpenAI's default: "auto" when tools are given, "none" when not."""
    if tool_choice is not None:
        return tool_choice
    return "auto" if tools else "none"


def template_tools(tools: Optional[list[ChatTool]], tool_choice: Optional[ToolChoice]) -> Optional[list[dict]]:
    """The tools for the chat template's `tools` argument (OpenAI's shape, as HF templates take
    them), or None when none is offered (no tools, or tool_choice "none")."""
    if not tools or effective_tool_choice(tools, tool_choice) == "none":
        return None
    return [tool.model_dump(exclude_none=True) for tool in tools]


def tool_choice_schema(tools: list[ChatTool], tool_choice: ToolChoice, parallel: bool = True) -> Optional[dict]:
    """The JSON schema an answer must follow for "required" (a list of one or more calls, vLLM's
    `[{"name": ..., "parameters": {...}}]`, exactly one without `parallel` tool calls) or a named function
    (its arguments object); None for "auto" and "none". Structured outputs enforce it."""
    any_object: dict = {"type": "object"}
    if isinstance(tool_choice, NamedToolChoice):
        tool = next(t for t in tools if t.function.name == tool_choice.function.name)
        return tool.function.parameters or any_object
    if tool_choice != "required":
        return None
    one_of = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": tool.function.parameters or any_object,
            },
            "required": ["name", "parameters"],
        }
        for tool in tools
    ]
    return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": one_of}}


def constrained_tool_parser(tool_choice: ToolChoice) -> Optional[ToolParser]:
    """The parser for an answer constrained by `tool_choice_schema`, None for "auto" and "none"."""
    if isinstance(tool_choice, NamedToolChoice):
        return NamedFunctionToolParser(tool_choice.function.name)
    return RequiredToolParser() if tool_choice == "required" else None
