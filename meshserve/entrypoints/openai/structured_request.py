"""The request fields that constrain the output: OpenAI's `response_format` (`text`, `json_object`,
`json_schema` with `strict`) and vLLM's `structured_outputs` extension (a JSON schema, any JSON object, a
regex, a choice list or a Lark grammar), turned into the engine's `StructuredOutputs` and checked by the
grammar engine before the request is queued: a constraint it cannot enforce is a 400 whose `param` names
the field (and, for a JSON schema, the path inside it).
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, model_validator

from meshserve.entrypoints.openai.errors import APIError, bad_request
from meshserve.structured_output.compiler import GrammarCompiler
from meshserve.structured_output.grammar import GrammarSpecError, check_grammar
from meshserve.wire.sampling_params import SamplingParamsError, StructuredOutputs

_SCHEMA_OBJECT = {"type": "object"}
MAX_CONSTRAINT_CHARS = 256 * 1024  # a schema, regex, grammar or choice list longer than this is refused


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    # `schema` would shadow BaseModel.schema
    json_schema: Annotated[dict[str, Any], WithJsonSchema(_SCHEMA_OBJECT)] = Field(
        default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    # the schema states the pairing too, so generic tools built on it send what the server takes
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"type": {"const": "json_schema"}}}, "then": {"required": ["json_schema"]},
        "else": {"properties": {"json_schema": {"type": "null"}}}})

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given exactly when type is 'json_schema'")
        return self


class StructuredOutputsRequest(_Strict):
    """vLLM's extra-body `structured_outputs`: exactly one of its fields."""

    json_: Annotated[dict[str, Any] | str | None, WithJsonSchema(
        {"anyOf": [_SCHEMA_OBJECT, {"type": "string"}, {"type": "null"}]})] = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


def structured_outputs_of(response_format: ResponseFormat | None,
                          extension: StructuredOutputsRequest | None) -> tuple[StructuredOutputs, str] | None:
    """The request's constraint and the field it came from; None for free text."""
    wants_format = response_format is not None and response_format.type != "text"
    if wants_format and extension is not None:
        raise bad_request("Give either response_format or structured_outputs, not both.",
                          param="structured_outputs")
    try:
        if wants_format:
            if response_format.type == "json_object":
                return StructuredOutputs(json_object=True), "response_format"
            schema = response_format.json_schema
            return (StructuredOutputs(json=json.dumps(schema.json_schema), lenient=not schema.strict),
                    "response_format.json_schema.schema")
        if extension is not None:
            return _from_extension(extension)
    except SamplingParamsError as exc:
        raise bad_request(str(exc), param=exc.param) from None
    return None


def _from_extension(extension: StructuredOutputsRequest) -> tuple[StructuredOutputs, str]:
    schema = extension.json_
    if isinstance(schema, str):  # a schema already serialized: it must still be JSON
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise bad_request(f"structured_outputs.json is not JSON: {exc}", param="structured_outputs.json") from None
    spec = StructuredOutputs(json=None if schema is None else json.dumps(schema),
                             json_object=bool(extension.json_object), regex=extension.regex,
                             choice=extension.choice, grammar=extension.grammar)
    return spec, f"structured_outputs.{spec.kind}"


def check_structured_outputs(spec: StructuredOutputs, param: str, compiler: GrammarCompiler | None = None) -> None:
    """APIError 400 unless the grammar engine can enforce `spec`; `param` plus the path inside a schema. With the
    model's `compiler` the grammar is also compiled and its first mask computed within the engine's limits,
    so a pathological one is refused here rather than failing in the engine (and cached: the next request of
    the same constraint skips the work)."""
    size = sum(len(text) for text in (spec.json, spec.regex, spec.grammar, *(spec.choice or ())) if text)
    if size > MAX_CONSTRAINT_CHARS:
        raise bad_request(f"The {param} is {size} characters; at most {MAX_CONSTRAINT_CHARS} are compiled.",
                          param=param)
    try:
        if compiler is not None:
            compiler.matcher(spec)
        else:
            check_grammar(spec)
    except GrammarSpecError as exc:
        raise _grammar_error(exc, param) from None


def _grammar_error(exc: GrammarSpecError, param: str) -> APIError:
    where = exc.where.removeprefix("$")
    return bad_request(f"The {param} cannot be enforced: {exc}", param=f"{param}{where}",
                       code="invalid_structured_output")
