"""Structured outputs through `meshserve serve` with the official `openai` client, on the random tiny model:
the grammar alone makes every answer valid. `beta.chat.completions.parse` with a Pydantic model and
`response_format` `json_schema` (nested objects, arrays, enums, `$ref`) give 100 valid objects of 100
sampled answers, streamed and not; regexes, choices and Lark grammars through vLLM's `structured_outputs`;
`logit_bias`; `tool_choice` `required` and a named function give 100 of 100 calls whose arguments validate
against their tool's schema, streamed and not; and a constraint the engine cannot enforce is a 400 naming
the field."""
from __future__ import annotations

import enum
import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from transformers import AutoTokenizer

from tests.e2e.server_process import running_server

STARTUP_TIMEOUT_S = 60
NUM_REQUESTS = 100
CHAT = [{"role": "user", "content": "Describe a person."}]


class Colour(enum.StrEnum):
    RED = "red"
    GREEN = "green"


class Address(BaseModel):
    city: str = Field(max_length=10)
    number: int = Field(ge=1, le=999)


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    colour: Colour
    tags: list[Literal["tall", "short", "kind"]] = Field(max_length=3)
    home: Address
    work: Address | None


SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["id", "items", "status"],
    "$defs": {"Item": {"type": "object", "additionalProperties": False, "required": ["sku", "qty"],
                       "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                                      "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}},
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                   "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "minItems": 1, "maxItems": 3},
                   "status": {"enum": ["open", "closed"]},
                   "meta": {"type": "object", "additionalProperties": False,
                            "properties": {"urgent": {"type": "boolean"}}}},
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city", "unit"],
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "kelvin"]}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}, "seconds": {"type": "boolean"}}}}},
]
TOOL_SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def client(tiny_model, tmp_path_factory) -> openai.OpenAI:
    model_dir = tiny_model("deepseek_v3", name="tiny-dsv3")
    log = tmp_path_factory.mktemp("server") / "server.log"
    with running_server(["--model", str(model_dir), "--served-model-name", "tiny"], log, STARTUP_TIMEOUT_S) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def _each(fn, count: int = NUM_REQUESTS) -> list:
    with ThreadPoolExecutor(max_workers=16) as pool:
        return list(pool.map(fn, range(count)))


def test_parse_with_a_pydantic_model_gives_a_valid_object_every_time(client):
    def one(seed: int):
        completion = client.beta.chat.completions.parse(model="tiny", messages=CHAT, response_format=Person,
                                                        max_tokens=200, temperature=1.0, seed=seed)
        return completion.choices[0].message.parsed

    parsed = _each(one)
    assert all(isinstance(person, Person) for person in parsed)
    assert len({person.model_dump_json() for person in parsed}) > NUM_REQUESTS // 2  # sampled, not one answer


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_json_schema_with_refs_arrays_and_enums_is_satisfied_every_time(client, stream):
    def one(seed: int) -> str:
        settings = dict(model="tiny", messages=CHAT, response_format=JSON_SCHEMA_FORMAT, max_tokens=200,
                        temperature=1.0, seed=seed)
        if not stream:
            return client.chat.completions.create(**settings).choices[0].message.content
        chunks = client.chat.completions.create(**settings, stream=True)
        return "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)

    for text in _each(one):
        jsonschema.validate(json.loads(text), SCHEMA)


def _calls(client, seed: int, stream: bool, tool_choice) -> tuple[list[tuple[str, str]], str]:
    """(name, arguments) of each call, and the finish reason, as a client reads them."""
    settings = dict(model="tiny", messages=CHAT, tools=TOOLS, tool_choice=tool_choice, max_tokens=200,
                    temperature=1.0, seed=seed)
    if not stream:
        choice = client.chat.completions.create(**settings).choices[0]
        return [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []], choice.finish_reason
    calls, finish = {}, None
    for chunk in client.chat.completions.create(**settings, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or []:
            name, arguments = calls.get(delta.index, ("", ""))
            calls[delta.index] = (name + (delta.function.name or ""), arguments + (delta.function.arguments or ""))
        finish = chunk.choices[0].finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_required_and_named_tool_calls_always_parse_and_validate(client, stream, tool_choice):
    for calls, finish in _each(lambda seed: _calls(client, seed, stream, tool_choice)):
        assert finish == "tool_calls" and calls
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), TOOL_SCHEMAS[name])
            if isinstance(tool_choice, dict):
                assert name == "get_time"


def test_auto_tools_render_for_the_model_and_its_text_stays_content(client):
    """The random model writes no call: the answer is content, with the tools in the prompt (more prompt tokens)."""
    with_tools = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, max_tokens=4, seed=1)
    without = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, seed=1)
    assert with_tools.choices[0].message.tool_calls is None and with_tools.choices[0].message.content
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens + 50


@pytest.mark.parametrize("constraint, check", [
    ({"regex": r"[A-Z][a-z]{2,5} [0-9]{1,3}"}, lambda text: re.fullmatch(r"[A-Z][a-z]{2,5} [0-9]{1,3}", text)),
    ({"choice": ["north", "south", "east west"]}, lambda text: text in ("north", "south", "east west")),
    ({"grammar": 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,2}/'},
     lambda text: re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{1,2})*\)", text)),
])
def test_structured_outputs_on_completions_and_chat(client, constraint, check):
    completion = client.completions.create(model="tiny", prompt="Answer:", max_tokens=120, temperature=1.0,
                                           n=4, seed=7, extra_body={"structured_outputs": constraint})
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=120, temperature=1.0, seed=7,
                                          extra_body={"structured_outputs": constraint})
    texts = [choice.text for choice in completion.choices] + [chat.choices[0].message.content]
    assert all(check(text) for text in texts), texts


def test_any_json_object_is_an_object_from_its_first_token(client):
    """Free-form JSON has no length bound a random model would meet: whatever ends is an object, and every
    answer cut at max_tokens is the start of one."""
    completion = client.completions.create(model="tiny", prompt="Answer:", max_tokens=40, temperature=1.0,
                                           n=8, seed=3, extra_body={"structured_outputs": {"json_object": True}})
    for choice in completion.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.text), dict)
        else:
            assert choice.text.startswith("{")
            with pytest.raises(json.JSONDecodeError):
                json.loads(choice.text)


def test_logit_bias_moves_the_greedy_choice(client, tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model("deepseek_v3", name="tiny-dsv3"))
    favoured, banned = 1000, 1001
    settings = dict(model="tiny", prompt="Answer:", max_tokens=4, temperature=0.0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**settings).choices[0].text
    assert plain != tokenizer.decode([favoured] * 4)
    biased = client.completions.create(**settings, logit_bias={str(favoured): 100}).choices[0].text
    assert biased == tokenizer.decode([favoured] * 4)
    first = tokenizer.encode(plain, add_special_tokens=False)[0]
    avoided = client.completions.create(**settings, logit_bias={str(first): -100, str(banned): -100})
    assert tokenizer.encode(avoided.choices[0].text, add_special_tokens=False)[0] != first


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"age": {"type": "intger"}}}}}},
     "response_format.json_schema.schema.properties.age.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "object", "properties": {"a": {"not": {}}}}}}},
     "response_format.json_schema.schema.properties.a.not"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a" * 300_000}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"logit_bias": {str(token): 1 for token in range(1025)}}, "logit_bias"),
])
def test_a_constraint_the_engine_cannot_enforce_is_a_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, extra_body=body)
    error = caught.value.body
    assert caught.value.status_code == 400
    assert error["param"] == param, error
