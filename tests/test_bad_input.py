"""Bad input gets a 4xx in OpenAI's error shape, and the server keeps serving."""

from __future__ import annotations

import re

import pytest

from tests.conftest import MODEL_NAME

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "Hi"}]
# Deep enough for transformers' and the chat template's recursive walks, within the JSON decoder's bound.
DEEP = b"[" * 900 + b"]" * 900


CASES = [
    # (id, path, raw body or JSON, status, param)
    ("malformed JSON", CHAT, b'{"model": ', 400, None),
    ("not an object", CHAT, b"[1, 2]", 400, None),
    ("empty body", CHAT, b"", 400, None),
    ("missing model", CHAT, {"messages": USER}, 400, None),
    ("missing messages", CHAT, {"model": MODEL_NAME}, 400, None),
    ("empty messages", CHAT, {"model": MODEL_NAME, "messages": []}, 400, "messages"),
    ("bad role", CHAT, {"model": MODEL_NAME, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("null user content", CHAT, {"model": MODEL_NAME, "messages": [{"role": "user", "content": None}]}, 400, "messages[0].content"),
    ("image part", CHAT, {"model": MODEL_NAME, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content[0]"),
    ("temperature as string", CHAT, {"model": MODEL_NAME, "messages": USER, "temperature": "hot"}, 400, "temperature"),
    ("temperature too high", CHAT, {"model": MODEL_NAME, "messages": USER, "temperature": 5}, 400, "temperature"),
    ("top_p negative", CHAT, {"model": MODEL_NAME, "messages": USER, "top_p": -0.1}, 400, "top_p"),
    ("min_p above one", CHAT, {"model": MODEL_NAME, "messages": USER, "min_p": 1.5}, 400, "min_p"),
    ("top_k below -1", CHAT, {"model": MODEL_NAME, "messages": USER, "top_k": -5}, 400, "top_k"),
    ("max_tokens zero", CHAT, {"model": MODEL_NAME, "messages": USER, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens float", CHAT, {"model": MODEL_NAME, "messages": USER, "max_tokens": 1.5}, 400, "max_tokens"),
    ("seed as string", CHAT, {"model": MODEL_NAME, "messages": USER, "seed": "x"}, 400, "seed"),
    ("seed too large", CHAT, {"model": MODEL_NAME, "messages": USER, "seed": 2**70}, 400, "seed"),
    ("max_tokens too large", CHAT, {"model": MODEL_NAME, "messages": USER, "max_tokens": 2**64}, 400, "max_tokens"),
    ("top_k too large", CHAT, {"model": MODEL_NAME, "messages": USER, "top_k": 2**64}, 400, "top_k"),
    ("n zero", CHAT, {"model": MODEL_NAME, "messages": USER, "n": 0}, 400, "n"),
    ("n above the maximum", CHAT, {"model": MODEL_NAME, "messages": USER, "n": 17}, 400, "n"),
    ("presence_penalty too high", CHAT, {"model": MODEL_NAME, "messages": USER, "presence_penalty": 3}, 400, "presence_penalty"),
    ("repetition_penalty zero", CHAT, {"model": MODEL_NAME, "messages": USER, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("logit_bias key not a token", CHAT, {"model": MODEL_NAME, "messages": USER, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("logit_bias key outside vocabulary", CHAT, {"model": MODEL_NAME, "messages": USER, "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ("logit_bias value too large", CHAT, {"model": MODEL_NAME, "messages": USER, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("top_logprobs without logprobs", CHAT, {"model": MODEL_NAME, "messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    ("top_logprobs too many", CHAT, {"model": MODEL_NAME, "messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("completion logprobs too many", COMPLETIONS, {"model": MODEL_NAME, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("empty stop", CHAT, {"model": MODEL_NAME, "messages": USER, "stop": [""]}, 400, "stop"),
    ("stop string too long", CHAT, {"model": MODEL_NAME, "messages": USER, "stop": "x" * 1025}, 400, "stop"),
    ("a stop string of a list too long", CHAT, {"model": MODEL_NAME, "messages": USER, "stop": ["x" * 1025]}, 400, "stop[0]"),
    ("logit_bias key a superscript digit", CHAT, {"model": MODEL_NAME, "messages": USER, "logit_bias": {"\u00b2": 1}}, 400, "logit_bias"),
    ("chat_template_kwargs with a template", CHAT, {"model": MODEL_NAME, "messages": USER,
                                                    "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}, 400, "messages"),
    ("chat_template_kwargs tokenizing", CHAT, {"model": MODEL_NAME, "messages": USER, "chat_template_kwargs": {"tokenize": True}}, 400, "messages"),
    ("chat_template_kwargs with messages", CHAT, {"model": MODEL_NAME, "messages": USER, "chat_template_kwargs": {"messages": []}}, 400, "messages"),
    ("JSON nested too deeply", CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"a": '
                                     + b"[" * 100_000 + b"]" * 100_000 + b"}}", 400, None),
    ("body not UTF-8", CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "caf\xe9"}]}', 400, None),
    ("values nested too deeply for the chat template", CHAT,
     b'{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"a": ' + DEEP + b"}}",
     400, "messages"),
    ("a tool's schema nested too deeply for the chat template", CHAT,
     b'{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function", "function": '
     b'{"name": "f", "parameters": {"type": "object", "default": ' + DEEP + b"}}}]}", 400, "messages"),
    ("stop as number", CHAT, {"model": MODEL_NAME, "messages": USER, "stop": 3}, 400, "stop"),
    ("stream as string", CHAT, {"model": MODEL_NAME, "messages": USER, "stream": "yes"}, 400, "stream"),
    ("unknown field", CHAT, {"model": MODEL_NAME, "messages": USER, "functions": []}, 400, "functions"),
    ("tool_choice required without tools", CHAT, {"model": MODEL_NAME, "messages": USER, "tool_choice": "required"}, 400, "tool_choice"),
    ("tool_choice names an unknown tool", CHAT, {"model": MODEL_NAME, "messages": USER, "tools": [{"type": "function", "function": {"name": "a"}}],
                                                 "tool_choice": {"type": "function", "function": {"name": "b"}}}, 400, "tool_choice"),
    ("tool without a name", CHAT, {"model": MODEL_NAME, "messages": USER, "tools": [{"type": "function", "function": {}}]}, 400, "tools[0].function"),
    ("tool of another type", CHAT, {"model": MODEL_NAME, "messages": USER, "tools": [{"type": "code", "function": {"name": "a"}}]}, 400, "tools[0].type"),
    ("unknown stream option", CHAT, {"model": MODEL_NAME, "messages": USER, "stream_options": {"x": 1}}, 400, "stream_options.x"),
    ("stream options with stream null", CHAT, {"model": MODEL_NAME, "messages": USER, "stream": None,
                                               "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("stream options with stream false", COMPLETIONS, {"model": MODEL_NAME, "prompt": "x", "stream": False,
                                                       "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("unknown model", CHAT, {"model": "gpt-4", "messages": USER}, 404, "model"),
    ("missing prompt", COMPLETIONS, {"model": MODEL_NAME}, 400, None),
    ("several token prompts", COMPLETIONS, {"model": MODEL_NAME, "prompt": [[1, 2], [3]]}, 400, "prompt"),
    ("several prompts", COMPLETIONS, {"model": MODEL_NAME, "prompt": ["a", "b"]}, 400, "prompt"),
    ("token id outside vocabulary", COMPLETIONS, {"model": MODEL_NAME, "prompt": [1, 10**6]}, 400, "prompt"),
    ("negative token id", COMPLETIONS, {"model": MODEL_NAME, "prompt": [-1]}, 400, "prompt"),
    ("empty prompt string", COMPLETIONS, {"model": MODEL_NAME, "prompt": ""}, 400, "prompt"),
    ("prompt longer than the context", COMPLETIONS, {"model": MODEL_NAME, "prompt": [5] * 2100}, 400, "prompt"),
    ("unknown model (completions)", COMPLETIONS, {"model": "nope", "prompt": "x"}, 404, "model"),
]


def assert_openai_error(response, status: int, param) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param
    return error


@pytest.mark.parametrize("path, body, status, param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_input_gets_its_4xx(server, path, body, status, param, stream):
    if isinstance(body, dict) and stream and "stream" not in body:
        body = dict(body, stream=True)
    if isinstance(body, dict):
        response = server.http.post(path, json=body)
    else:
        response = server.http.post(path, content=body, headers={"content-type": "application/json"})
    assert_openai_error(response, status, param)


def test_context_length_error_code(server):
    response = server.http.post(COMPLETIONS, json={"model": MODEL_NAME, "prompt": [5] * 2100})
    error = assert_openai_error(response, 400, "prompt")
    assert error["code"] == "context_length_exceeded" and "This model's maximum context length is 2048 tokens" in error["message"]
    # In Anthropic's words, which Claude Code reads to compact its conversation.
    anthropic = server.http.post("/v1/messages", json={"model": MODEL_NAME, "max_tokens": 8,
                                                       "messages": [{"role": "user", "content": "sea " * 2100}]})
    assert anthropic.status_code == 400
    assert re.match(r"prompt is too long: \d+ tokens > 2047 maximum", anthropic.json()["error"]["message"])


def test_unknown_route_and_method(server):
    assert_openai_error(server.http.get("/v1/nothing-here"), 404, None)
    wrong_method = server.http.get(CHAT)
    assert_openai_error(wrong_method, 405, None)
    assert wrong_method.headers["allow"] == "POST"  # as HTTP asks of a 405


def test_server_keeps_serving_after_bad_input(server, reference):
    for _, path, body, _, _ in CASES:
        server.http.post(path, json=body) if isinstance(body, dict) else server.http.post(path, content=body)
    prompt = reference.text_prompt("Once upon a time")
    expected = reference.greedy(prompt, 16)
    response = server.http.post(
        COMPLETIONS, json={"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
    )
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == expected.text
    assert server.wait_idle()["ready"]
