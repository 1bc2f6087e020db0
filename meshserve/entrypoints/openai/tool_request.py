"""A chat request's tools and `tool_choice`, as OpenAI defines them, turned into what the server does:

- `none`: the model sees the tools and answers in text; nothing is parsed.
- `auto` (the default with tools): the model decides; its calls are read from its own format by the
  tool-call parser (`--tool-call-parser`, by default the one the chat template's format needs).
- `required`: the grammar engine makes the model write a JSON array of calls
  `[{"name": ..., "parameters": {...}}]`, each naming one of the tools with arguments its schema accepts
  (one call when `parallel_tool_calls` is false).
- a named function: the grammar makes the model write that function's arguments, a JSON value its
  parameters' schema accepts.

So under `required` and a named choice every call parses and validates against its tool's schema. Each tool's
parameters are checked as a JSON schema when the request arrives (400 naming `tools[i].function.parameters`
and the path inside it).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from meshserve.entrypoints.openai.errors import bad_request
from meshserve.entrypoints.openai.structured_request import check_structured_outputs
from meshserve.structured_output.compiler import GrammarCompiler
from meshserve.structured_output.grammar import GrammarSpecError, check_json_schema
from meshserve.wire.sampling_params import StructuredOutputs

_FUNCTION_NAME = r"^[A-Za-z0-9_.\-]{1,64}$"
_OBJECT = {"type": "object"}
NONE, AUTO, REQUIRED, NAMED = "none", "auto", "required", "named"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class FunctionDefinition(_Strict):
    name: str = Field(pattern=_FUNCTION_NAME)
    description: str | None = None
    parameters: Annotated[dict[str, Any] | None, WithJsonSchema({"anyOf": [_OBJECT, {"type": "null"}]})] = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Strict):
    name: str = Field(pattern=_FUNCTION_NAME)
    arguments: str


class ToolCallInMessage(_Strict):
    """A call an earlier assistant message made (sent back with the conversation)."""

    id: str = Field(min_length=1, max_length=128)
    type: Literal["function"]
    function: CalledFunction


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools and tool_choice make the server do (see the module docstring)."""

    mode: str
    tools: list[dict[str, Any]]  # as the chat template takes them (OpenAI's shape)
    parser: str | None = None  # AUTO: the tool-call parser
    constraint: StructuredOutputs | None = None  # REQUIRED and NAMED: what the grammar engine enforces
    function: str | None = None  # NAMED: the function
    parallel: bool = True


def plan_tools(tools: list[Tool] | None, tool_choice: Any, parallel_tool_calls: bool | None,
               parser: str | None, has_constraint: bool,
               compiler: Callable[[], GrammarCompiler] | None = None) -> ToolPlan | None:
    """The request's ToolPlan (None without tools); APIError 400 naming the field for anything it cannot do.
    `compiler`: gives the model's grammar compiler, which checks the calls' grammar as the engine will."""
    if not tools:
        if tool_choice not in (None, NONE):
            raise bad_request("tool_choice needs tools.", param="tool_choice")
        return None
    for index, tool in enumerate(tools):
        _check_parameters(tool, index)
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        raise bad_request("Each tool needs a name of its own.", param="tools")
    as_template = [tool.model_dump(exclude_none=True) for tool in tools]
    parallel = parallel_tool_calls is not False
    mode = tool_choice if isinstance(tool_choice, str) else NAMED if tool_choice is not None else AUTO
    if mode in (REQUIRED, NAMED) and has_constraint:
        raise bad_request(f"tool_choice {mode!r} already constrains the output; it cannot be combined with "
                          "response_format or structured_outputs.", param="response_format")
    if mode == NONE:
        return ToolPlan(NONE, as_template, parallel=parallel)
    if mode == AUTO:
        if parser is None:
            raise bad_request("tool_choice 'auto' needs a tool-call parser, and this model's chat template has no "
                              "tool-call format the server knows; start the server with --tool-call-parser.",
                              param="tool_choice")
        return ToolPlan(AUTO, as_template, parser=parser, parallel=parallel)
    if mode == REQUIRED:
        constraint = StructuredOutputs(json=json.dumps(_calls_schema(tools, parallel)), lenient=True)
        check_structured_outputs(constraint, "tools", compiler() if compiler is not None else None)
        return ToolPlan(REQUIRED, as_template, constraint=constraint, parallel=parallel)
    name = tool_choice.function.name
    if name not in names:
        raise bad_request(f"tool_choice names the function {name!r}, which is not among the tools "
                          f"({', '.join(names)}).", param="tool_choice")
    schema = tools[names.index(name)].function.parameters or _OBJECT
    constraint = StructuredOutputs(json=json.dumps(schema), lenient=True)
    check_structured_outputs(constraint, f"tools[{names.index(name)}].function.parameters",
                             compiler() if compiler is not None else None)
    return ToolPlan(NAMED, as_template, constraint=constraint, function=name, parallel=parallel)


def _check_parameters(tool: Tool, index: int) -> None:
    if tool.function.parameters is None:
        return
    try:
        check_json_schema(tool.function.parameters)
    except GrammarSpecError as exc:
        raise bad_request(f"tools[{index}].function.parameters is not a valid JSON schema: {exc}",
                          param=f"tools[{index}].function.parameters{exc.where.removeprefix('$')}") from None


def _calls_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    """A JSON array of calls, each one of the tools with arguments its schema accepts."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"const": tool.function.name},
                             "parameters": tool.function.parameters or _OBJECT}} for tool in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema
