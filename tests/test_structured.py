"""Structured output and forced tool calls, enforced by the grammar engine in the worker.

The tiny model has random weights, so whatever parses and validates here does
so because decoding was constrained, not because the model knew better.
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from tests.conftest import MODEL_NAME, running
from tests.tiny_model import make_tiny_model

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "temperature": {"type": "integer", "minimum": -50, "maximum": 60},
        "sunny": {"type": "boolean"},
        "wind": {"enum": ["none", "light", "strong"]},
    },
    "required": ["city", "temperature", "sunny", "wind"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
    "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema, "strict": True}}


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_output_validates(client, seed):
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, max_tokens=120, temperature=1.0, seed=seed,
        response_format=json_schema_format(SCHEMA),
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_schema_streamed(client):
    chunks = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, max_tokens=120, temperature=0, stream=True,
        response_format=json_schema_format(SCHEMA),
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_output_parses(client):
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, max_tokens=200, temperature=0, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(response.choices[0].message.content), dict)


def test_a_schema_not_strict_leaves_what_the_grammar_cannot_enforce_unenforced(client):
    """Pydantic writes uniqueItems for a set: a 400 only where the request asks for strict."""
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                        "uniqueItems": True, "maxItems": 3}},
              "required": ["tags"], "additionalProperties": False}
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, max_tokens=120, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "tags", "schema": schema}})
    tags = json.loads(response.choices[0].message.content)["tags"]
    assert isinstance(tags, list) and len(tags) <= 3 and all(isinstance(t, str) and len(t) <= 8 for t in tags)
    with pytest.raises(openai.BadRequestError, match="uniqueItems"):
        client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=8,
                                       response_format=json_schema_format(schema))


def deeply_nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("schema", [{"$ref": "#/definitions/nowhere"}, {"type": "integer", "minimum": "low"},
                                    {"type": "object", "properties": {"a": {"type": "strange"}}},
                                    # Past the bounds: its grammar would take seconds to build, or recurse too deep.
                                    {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(6000)}},
                                    deeply_nested(900)])
def test_unsupported_schema_is_a_400(server, schema):
    response = server.http.post("/v1/chat/completions", json={
        "model": MODEL_NAME, "messages": ASK, "response_format": json_schema_format(schema)})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "unsupported_schema"


def test_tool_choice_required_forces_a_valid_call(client):
    response = client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=120, temperature=0,
                                              tools=[WEATHER, TIME], tool_choice="required")
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    tool = {t["function"]["name"]: t for t in (WEATHER, TIME)}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_named_tool_choice_forces_that_tool(client):
    for stream in (False, True):
        kwargs = dict(model=MODEL_NAME, messages=ASK, max_tokens=120, temperature=0, tools=[WEATHER, TIME],
                      tool_choice={"type": "function", "function": {"name": "get_time"}})
        if stream:
            deltas = [d for c in client.chat.completions.create(stream=True, **kwargs) if c.choices
                      for d in c.choices[0].delta.tool_calls or []]
            name, arguments = deltas[0].function.name, deltas[0].function.arguments
        else:
            call = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
            name, arguments = call.function.name, call.function.arguments
        assert name == "get_time"
        assert json.loads(arguments)["zone"] in ("UTC", "CET")


def test_anthropic_tool_choice_any_forces_tool_use(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    tools = [{"name": "get_time", "input_schema": TIME["function"]["parameters"]}]
    message = client.messages.create(model=MODEL_NAME, max_tokens=120, messages=ASK, tools=tools,
                                     tool_choice={"type": "any"}, extra_body={"temperature": 0})
    assert message.stop_reason == "tool_use"
    (block,) = [b for b in message.content if b.type == "tool_use"]
    assert block.name == "get_time" and block.input["zone"] in ("UTC", "CET")


@pytest.mark.parametrize("call", [True, False])
def test_tools_beside_a_json_response_format_may_be_called(client, reference, call):
    """An agent asked for a typed final answer (the OpenAI Agents SDK's output_type, Vercel's `output`) sends its
    tools with a response_format: the format's grammar held the model to JSON, and no tool was ever called. Now
    the answer is that JSON or a call; which one, the model picks (here a bias on the call's first byte does)."""
    answer = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20}},
              "required": ["answer"], "additionalProperties": False}
    opening = reference.tokenizer.convert_tokens_to_ids("<")
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, max_tokens=120, temperature=0, tools=[WEATHER],
        logit_bias={str(opening): 100 if call else -100},
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": answer}})
    choice = response.choices[0]
    if call:
        assert choice.finish_reason == "tool_calls"
        (tool_call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(tool_call.function.arguments), WEATHER["function"]["parameters"])
    else:
        assert choice.finish_reason == "stop" and not choice.message.tool_calls
        jsonschema.validate(json.loads(choice.message.content), answer)


def test_a_forced_call_wins_over_a_json_response_format(client):
    """The answer is the call (OpenAI takes both; this was a 400)."""
    response = client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=120, temperature=0,
                                              tools=[WEATHER], tool_choice="required",
                                              response_format={"type": "json_object"})
    (call,) = response.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_a_tokenizer_the_grammar_engine_cannot_take_refuses_grammars_and_keeps_serving(tmp_path):
    """llguidance refuses some tokenizers (a slow one; more tokens than the model's vocabulary, as here):
    that escaped the worker's request handling, and the worker died with every stream on it."""
    from tokenizers import Tokenizer

    model = make_tiny_model(tmp_path / "wide")
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(8)])
    tokenizer.save(str(model / "tokenizer.json"))
    with running(["serve", "--model", str(model), "--served-model-name", MODEL_NAME], tmp_path / "serve.log") as srv:
        pid = srv.health()["worker"]["pid"]
        body = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 8, "response_format": {"type": "json_object"}}
        for _ in range(2):  # refused again, not retried into the same failure
            refused = srv.http.post("/v1/chat/completions", json=body)
            assert refused.status_code == 500 and "cannot be held to a grammar" in refused.text, refused.text
        plain = srv.http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": ASK, "max_tokens": 4})
        assert plain.status_code == 200 and srv.health()["worker"]["pid"] == pid
