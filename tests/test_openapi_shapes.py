"""Every response body and stream chunk validates against OpenAI's own OpenAPI
description (../shared/specs/openai-openapi.yaml), and the openai SDK accepts
them with strict response validation."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.conftest import MODEL_NAME

MESSAGES = [{"role": "user", "content": "Hello there"}]


def post(server, path: str, body: dict):
    response = server.http.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def stream(server, path: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", server.url + path, json=dict(body, stream=True), timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


CHAT_BODIES = [
    {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 8, "temperature": 0},
    {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 8, "n": 2, "temperature": 1, "seed": 1},
    {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 8, "logprobs": True, "top_logprobs": 2},
    {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 60, "temperature": 0,
     "tools": [{"type": "function", "function": {"name": "f", "parameters": {
         "type": "object", "properties": {"x": {"enum": ["a", "b"]}}, "required": ["x"]}}}],
     "tool_choice": "required"},
    {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 8, "stop": ["e"]},
]


@pytest.mark.parametrize("body", CHAT_BODIES)
def test_chat_shapes(server, validate, body):
    validate(post(server, "/v1/chat/completions", body), "CreateChatCompletionResponse")
    for chunk in stream(server, "/v1/chat/completions", dict(body, stream_options={"include_usage": True})):
        validate(chunk, "CreateChatCompletionStreamResponse")


@pytest.mark.parametrize("body", [
    {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 8},
    {"model": MODEL_NAME, "prompt": [1, 2, 3], "max_tokens": 8, "logprobs": 2, "n": 2},
])
def test_completion_shapes(server, validate, body):
    validate(post(server, "/v1/completions", body), "CreateCompletionResponse")
    # The spec has no schema for legacy completion stream chunks; the ones that
    # end a choice have the full response's shape.
    final = [c for c in stream(server, "/v1/completions", body) if c["choices"] and c["choices"][0]["finish_reason"]]
    assert final
    for chunk in final:
        validate(chunk, "CreateCompletionResponse")


def test_models_and_error_shapes(server, validate):
    validate(server.http.get("/v1/models").json(), "ListModelsResponse")
    validate(server.http.post("/v1/chat/completions", json={"model": "nope", "messages": MESSAGES}).json(),
             "ErrorResponse")


def test_sdk_with_strict_response_validation(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                           _strict_response_validation=True)
    def ask():
        return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, n=2,
                                              logprobs=True, top_logprobs=1)

    ask()
    response = ask()  # its prompt is in the prefix cache now
    assert len(response.choices) == 2
    assert 0 < response.usage.prompt_tokens_details.cached_tokens < response.usage.prompt_tokens
    assert list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, stream=True))
    assert client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=4, logprobs=1).choices[0].logprobs
    assert client.models.list().data[0].id == MODEL_NAME
