"""A request's `StructuredOutputs` as an llguidance grammar, and the checks behind the API's 400s.

JSON schemas are checked twice: against their own metaschema (jsonschema names the path of the bad part), then
by llguidance, which refuses what it cannot enforce (an unknown type, an unsatisfiable pattern). `strict`
schemas (OpenAI's `strict: true`) must be enforceable whole; `lenient` ones (not strict) let llguidance skip
keywords it does not implement, as OpenAI's non-strict mode promises no more.
"""
from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import llguidance

from meshserve.wire.sampling_params import StructuredOutputs

# JSON without whitespace between tokens: compact, and no token is spent on (or can loop in) indentation
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}


class GrammarSpecError(ValueError):
    """A constraint the grammar engine cannot enforce; `where` names the part (a JSON-schema path such as
    `$.properties.age.type`), or is empty when the whole constraint is at fault."""

    def __init__(self, message: str, where: str = "") -> None:
        super().__init__(message)
        self.where = where


def grammar_text(spec: StructuredOutputs) -> str:
    """llguidance's grammar for `spec` (not yet checked: `check_grammar`)."""
    kind = spec.kind
    if kind == "json":
        options = dict(_JSON_OPTIONS, lenient=spec.lenient)
        return llguidance.LLMatcher.grammar_from_json_schema(spec.json, defaults=options)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_regex("|".join(f"(?:{re.escape(c)})" for c in spec.choice))
    return llguidance.LLMatcher.grammar_from_lark(spec.grammar)


def check_json_schema(schema: Any) -> None:
    """Raise GrammarSpecError naming the path of the first part of `schema` its metaschema refuses."""
    if not isinstance(schema, dict):
        raise GrammarSpecError(f"a JSON schema must be an object, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise GrammarSpecError(f"invalid JSON schema at {exc.json_path}: {exc.message}", exc.json_path) from None
    except (jsonschema.exceptions.RefResolutionError, jsonschema.exceptions.UnknownType) as exc:
        raise GrammarSpecError(f"invalid JSON schema: {exc}") from None


def check_grammar(spec: StructuredOutputs, tokenizer: llguidance.LLTokenizer | None = None) -> str:
    """The checked grammar of `spec`; GrammarSpecError for anything the engine cannot enforce."""
    if spec.kind == "json":
        try:
            schema = json.loads(spec.json)
        except ValueError as exc:
            raise GrammarSpecError(f"the JSON schema is not JSON: {exc}") from None
        check_json_schema(schema)
    try:
        grammar = grammar_text(spec)
    except ValueError as exc:
        raise GrammarSpecError(str(exc)) from None
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        where = _locate_unimplemented(json.loads(spec.json), error) if spec.kind == "json" else ""
        raise GrammarSpecError(first_lines(error) + (f" (at {where})" if where else ""), where)
    return grammar


_UNIMPLEMENTED = re.compile(r'Unimplemented keys: \[(.*?)\]')


def _locate_unimplemented(schema: Any, error: str) -> str:
    """The JSON path of the first schema object holding a keyword llguidance named as unimplemented; ""."""
    found = _UNIMPLEMENTED.search(error)
    if found is None:
        return ""
    keys = {key.strip().strip('"') for key in found.group(1).split(",")}
    pending = [("$", schema)]
    while pending:  # breadth first: the shallowest use is the one to name
        path, node = pending.pop(0)
        if isinstance(node, dict):
            hit = next((key for key in node if key in keys), None)
            if hit is not None:
                return f"{path}.{hit}"
            pending.extend((f"{path}.{key}", value) for key, value in node.items())
        elif isinstance(node, list):
            pending.extend((f"{path}[{index}]", value) for index, value in enumerate(node))
    return ""


def first_lines(error: str, limit: int = 6) -> str:
    """llguidance's message without its long tail (a caret diagram of the grammar at most)."""
    lines = error.strip().splitlines()
    return "\n".join(lines[:limit])
