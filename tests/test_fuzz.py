"""Fuzzing the HTTP surface: whatever a client sends, never a 5xx, nothing goes down,
and a well-formed request afterwards still gets its correct answer."""

from __future__ import annotations

import json
import socket
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import MODEL_NAME, Server

PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/api/chat", "/api/generate"]
# The parameters the endpoints know (unknown ones are a 400 at once, which
# test_any_json covers), so that generated bodies reach the deeper checks.
FIELDS = ["max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "n",
          "stream", "stream_options", "ignore_eos", "user"]
STATUSES: Counter = Counter()

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=300),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=15,
)
# Mostly plausible values (valid or just out of range), sometimes anything at all.
PLAUSIBLE = {
    "max_tokens": st.integers(-2, 20),
    "max_completion_tokens": st.integers(-2, 20),
    "temperature": st.floats(-0.5, 2.5),
    "top_p": st.floats(-0.1, 1.1),
    "top_k": st.integers(-3, 50),
    "min_p": st.floats(-0.1, 1.1),
    "seed": st.integers(-(2**64), 2**64),
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=20),
    "n": st.integers(0, 3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "user": st.text(max_size=20),
}


def field_values(name: str):
    return st.one_of(PLAUSIBLE[name], PLAUSIBLE[name], PLAUSIBLE[name], json_values)

message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer", "tool"]),
     "content": st.text(max_size=200) | st.text(max_size=200) | json_values},
    optional={"name": st.text(max_size=10)},
)
chat_bodies = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL_NAME, MODEL_NAME, MODEL_NAME, "gpt-4", ""]),
     "messages": st.lists(message, min_size=1, max_size=3) | json_values},
    optional={name: field_values(name) for name in FIELDS},
)
completion_bodies = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL_NAME, MODEL_NAME, MODEL_NAME, "other"]),
     "prompt": st.text(min_size=1, max_size=300) | st.lists(st.integers(-10, 600), max_size=40) | json_values},
    optional={name: field_values(name) for name in FIELDS},
)

input_item = st.one_of(
    message,
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.text(max_size=8),
                           "name": st.text(max_size=8), "arguments": st.text(max_size=40) | json_values}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.text(max_size=8),
                           "output": st.text(max_size=40) | json_values}),
    st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "web_search_call", "message"]),
                           "summary": json_values}),
)
responses_bodies = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL_NAME, MODEL_NAME, MODEL_NAME, "gpt-4"]),
     "input": st.text(max_size=200) | st.lists(input_item, min_size=1, max_size=3) | json_values},
    optional={"max_output_tokens": st.integers(-2, 20) | json_values, "temperature": field_values("temperature"),
              "top_p": field_values("top_p"), "stream": field_values("stream"), "instructions": json_values,
              "previous_response_id": st.text(max_size=10), "store": json_values,
              "tools": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search"]),
                                                      "name": st.text(max_size=8)}), max_size=2) | json_values,
              "tool_choice": st.sampled_from(["auto", "none", "required"]) | json_values,
              "text": st.fixed_dictionaries({"format": st.fixed_dictionaries(
                  {"type": st.sampled_from(["text", "json_object", "json_schema"])})}) | json_values,
              "reasoning": st.fixed_dictionaries({"effort": st.sampled_from(["low", "high", "max"])}) | json_values},
)

ollama_options = st.fixed_dictionaries({}, optional={
    "temperature": field_values("temperature"), "top_p": field_values("top_p"), "top_k": field_values("top_k"),
    "seed": field_values("seed"), "num_predict": st.integers(-3, 20) | json_values,
    "stop": st.lists(st.text(max_size=4), max_size=4) | json_values, "repeat_penalty": st.floats(-1, 3),
    "num_ctx": st.integers(0, 9000), "mirostat": json_values,
}) | json_values
ollama_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "wizard"]),
     "content": st.text(max_size=200) | json_values},
    optional={"images": st.lists(st.text(max_size=40), max_size=2) | json_values, "tool_name": st.text(max_size=8),
              "tool_calls": st.lists(st.fixed_dictionaries({"function": st.fixed_dictionaries(
                  {"name": st.text(max_size=8), "arguments": st.dictionaries(st.text(max_size=4), json_values,
                                                                              max_size=2) | json_values})}),
                  max_size=2) | json_values},
)
OLLAMA_FIELDS = {
    "options": ollama_options,
    "stream": field_values("stream"),
    "format": st.sampled_from(["json", "", "yaml"]) | json_values,
    # Never 0: with an empty prompt that unloads the model (test_ollama.py tests it).
    "keep_alive": st.sampled_from(["5m", -1, "soon", "-3s", "1e400", [1]]),
    "think": st.sampled_from([True, False, "low", "max"]) | json_values,
}
ollama_chat_bodies = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL_NAME, MODEL_NAME + ":latest", "llama3:8b"]),
     "messages": st.lists(ollama_message, max_size=3) | json_values},
    optional={**OLLAMA_FIELDS, "tools": st.lists(st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.text(max_size=8)})}),
        max_size=2) | json_values},
)
ollama_generate_bodies = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL_NAME, MODEL_NAME + ":latest", "llama3:8b"]),
     "prompt": st.text(max_size=200) | json_values},
    optional={**OLLAMA_FIELDS, "system": st.text(max_size=40) | json_values, "raw": field_values("stream"),
              "suffix": st.text(max_size=4), "context": st.lists(st.integers(0, 10), max_size=3),
              "images": st.lists(st.text(max_size=40), max_size=2) | json_values},
)


@pytest.fixture(scope="module")
def fuzzed(tiny_model, tmp_path_factory):
    server = Server(
        ["serve", "--model", str(tiny_model), "--served-model-name", MODEL_NAME, "--context-length", "128",
         "--max-tokens-limit", "16", "--max-body-bytes", "65536", "--body-timeout-s", "1"],
        tmp_path_factory.mktemp("fuzz") / "serve.log",
    )
    server.wait_ready()
    server.worker_pid = server.health()["worker"]["pid"]
    yield server
    server.stop()
    print(f"\nfuzz: {sum(STATUSES.values())} requests, statuses {dict(sorted(STATUSES.items()))}")


def send(server: Server, path: str, content: bytes) -> None:
    with server.http.stream("POST", path, content=content, headers={"content-type": "application/json"}) as r:
        body = r.read()
    STATUSES[r.status_code] += 1
    assert r.status_code < 500, (content[:300], body[:300])
    if r.status_code >= 400:
        assert "error" in json.loads(body)
    elif r.headers["content-type"].startswith("application/x-ndjson"):
        last = json.loads(body.rstrip().rsplit(b"\n", 1)[-1])
        assert last.get("done") is True or "error" in last
    elif r.headers["content-type"].startswith("text/event-stream"):
        if path == "/v1/responses":
            last = json.loads(body.rstrip().rsplit(b"\ndata: ", 1)[1])
            assert last["type"] in ("response.completed", "response.incomplete", "response.failed")
        else:
            assert body.rstrip().endswith(b"data: [DONE]")


FUZZ = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@FUZZ
@given(body=chat_bodies)
def test_chat_bodies(fuzzed, body):
    send(fuzzed, PATHS[0], json.dumps(body).encode())


@FUZZ
@given(body=completion_bodies)
def test_completion_bodies(fuzzed, body):
    send(fuzzed, PATHS[1], json.dumps(body).encode())


@FUZZ
@given(body=responses_bodies)
def test_responses_bodies(fuzzed, body):
    send(fuzzed, PATHS[2], json.dumps(body).encode())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=ollama_chat_bodies)
def test_ollama_chat_bodies(fuzzed, body):
    send(fuzzed, PATHS[3], json.dumps(body).encode())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=ollama_generate_bodies)
def test_ollama_generate_bodies(fuzzed, body):
    send(fuzzed, PATHS[4], json.dumps(body).encode())


@settings(max_examples=150, deadline=None)
@given(path=st.sampled_from(PATHS), body=json_values)
def test_any_json(fuzzed, path, body):
    send(fuzzed, path, json.dumps(body).encode())


@settings(max_examples=150, deadline=None)
@given(path=st.sampled_from(PATHS), body=st.binary(max_size=400))
def test_any_bytes(fuzzed, path, body):
    send(fuzzed, path, body)


@settings(max_examples=100, deadline=None)
@given(body=chat_bodies, cut=st.floats(0, 1))
def test_truncated_json(fuzzed, body, cut):
    raw = json.dumps(body).encode()
    send(fuzzed, PATHS[0], raw[: int(len(raw) * cut)])


def test_oversized_body(fuzzed):
    body = json.dumps({"model": MODEL_NAME, "prompt": "x" * 70_000}).encode()
    send(fuzzed, PATHS[1], body)
    assert STATUSES[413] >= 1


def test_slow_clients_do_not_stall_others(fuzzed, reference):
    stalled = []
    for request in (b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n",
                    b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 500\r\n\r\n{\"mo"):
        sock = socket.create_connection(("127.0.0.1", fuzzed.port))
        sock.sendall(request)
        stalled.append(sock)
    try:
        assert_correct_answer(fuzzed, reference)
        stalled[2].settimeout(5)
        assert stalled[2].recv(100).startswith(b"HTTP/1.1 408")
    finally:
        for sock in stalled:
            sock.close()


def assert_correct_answer(server: Server, reference) -> None:
    expected = reference.greedy(reference.text_prompt("Once upon a time"), 16).text
    response = httpx.post(server.url + "/v1/completions", timeout=30,
                          json={"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0})
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == expected


def test_still_up_and_correct_after_the_fuzz(fuzzed, reference):
    assert fuzzed.proc.poll() is None
    assert fuzzed.health()["worker"]["pid"] == fuzzed.worker_pid
    assert fuzzed.health()["worker"]["ready"]
    assert_correct_answer(fuzzed, reference)
    assert not [s for s in STATUSES if s >= 500]
