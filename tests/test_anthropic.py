"""The Anthropic Messages API through the whole stack, with the official anthropic SDK."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from tests.conftest import MODEL_NAME
from tests.test_stop_strings import spanning_stop

MESSAGES = [{"role": "user", "content": "Hello there"}]
SYSTEM = "You are terse."
GREEDY = {"temperature": 0}  # the current SDK has no temperature argument; the API still takes it


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def chat_of(system: str | None, messages: list[dict]) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + messages


def test_create_matches_mlx_lm(client, reference):
    prompt = reference.chat_prompt(chat_of(SYSTEM, MESSAGES))
    expected = reference.greedy(prompt, 24)
    message = client.messages.create(model=MODEL_NAME, max_tokens=24, system=SYSTEM, messages=MESSAGES,
                                     extra_body=GREEDY)
    assert message.role == "assistant" and message.type == "message" and message.id.startswith("msg_")
    assert message.content[0].type == "text"
    assert message.content[0].text == expected.text
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[expected.finish_reason]
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == len(prompt)
    assert message.usage.output_tokens == len(expected.token_ids)


def test_stream_matches_mlx_lm(client, reference):
    prompt = reference.chat_prompt(chat_of(None, MESSAGES))
    expected = reference.greedy(prompt, 24)
    with client.messages.stream(model=MODEL_NAME, max_tokens=24, messages=MESSAGES, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == expected.text
    assert final.content[0].text == expected.text
    assert final.usage.output_tokens == len(expected.token_ids)
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == len(prompt)


def test_stream_event_sequence(server):
    body = {"model": MODEL_NAME, "max_tokens": 8, "messages": MESSAGES, "stream": True, "temperature": 0}
    names = []
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                names.append(line[7:])
            elif line.startswith("data: "):
                assert json.loads(line[6:])["type"] == names[-1]
    assert_event_grammar(names)


def assert_event_grammar(names: list[str]) -> None:
    """message_start, then blocks (start, deltas, stop), then message_delta, message_stop; pings anywhere."""
    names = [n for n in names if n != "ping"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    blocks = names[1:-2]
    assert blocks and blocks[0] == "content_block_start" and blocks[-1] == "content_block_stop"
    state = "closed"
    for name in blocks:
        if name == "content_block_start":
            assert state == "closed"
            state = "open"
        elif name == "content_block_delta":
            assert state == "open"
        else:
            assert name == "content_block_stop" and state == "open"
            state = "closed"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences(client, reference, stream):
    prompt = reference.chat_prompt(chat_of(None, MESSAGES))
    expected = reference.greedy(prompt, 48)
    stop, at = spanning_stop(reference, expected.token_ids)
    kwargs = dict(model=MODEL_NAME, max_tokens=48, messages=MESSAGES, stop_sequences=["never-seen", stop],
                  extra_body=GREEDY)
    if stream:
        with client.messages.stream(**kwargs) as s:
            text = "".join(s.text_stream)
            message = s.get_final_message()
    else:
        message = client.messages.create(**kwargs)
        text = message.content[0].text
    assert text == expected.text[:at]
    assert message.stop_reason == "stop_sequence"
    assert message.stop_sequence == stop


def test_count_tokens(client, reference):
    count = client.messages.count_tokens(model=MODEL_NAME, system=SYSTEM, messages=MESSAGES)
    assert count.input_tokens == len(reference.chat_prompt(chat_of(SYSTEM, MESSAGES)))


def test_content_blocks_and_tool_results_are_rendered(client, reference):
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]},
    ]
    expected = reference.greedy(reference.chat_prompt(chat_of(None, MESSAGES)), 8)
    message = client.messages.create(model=MODEL_NAME, max_tokens=8, messages=messages, extra_body=GREEDY)
    assert message.content[0].text == expected.text


ANTHROPIC_BAD = [
    ({"max_tokens": 8, "messages": MESSAGES}, 400),  # no model
    ({"model": MODEL_NAME, "messages": MESSAGES}, 400),  # no max_tokens
    ({"model": MODEL_NAME, "max_tokens": 8, "messages": []}, 400),
    ({"model": MODEL_NAME, "max_tokens": 8, "messages": [{"role": "system", "content": "x"}]}, 400),
    ({"model": MODEL_NAME, "max_tokens": 8, "messages": MESSAGES, "temperature": 1.5}, 400),
    ({"model": MODEL_NAME, "max_tokens": 0, "messages": MESSAGES}, 400),
    ({"model": MODEL_NAME, "max_tokens": 8, "messages": MESSAGES, "stop_sequences": [""]}, 400),
    ({"model": MODEL_NAME, "max_tokens": 8, "messages": MESSAGES, "unknown": 1}, 400),
    ({"model": MODEL_NAME, "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, 400),
    ({"model": "claude-opus", "max_tokens": 8, "messages": MESSAGES}, 404),
]


@pytest.mark.parametrize("body, status", ANTHROPIC_BAD)
def test_bad_input_gets_anthropic_errors(server, body, status):
    response = server.http.post("/v1/messages", json=body)
    assert response.status_code == status, response.text
    payload = response.json()
    assert payload["type"] == "error"
    assert set(payload["error"]) == {"type", "message"}
    assert payload["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]


def test_sdk_raises_typed_errors(client):
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-opus", max_tokens=8, messages=MESSAGES)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL_NAME, max_tokens=8, messages=[])


def test_tool_choice_none_renders_no_tools(client, reference):
    """`none` has no disable_parallel_tool_use: it was read all the same, a 500 (found by mypy)."""
    tool = {"name": "get_weather", "description": "Weather", "input_schema": {"type": "object", "properties": {}}}
    expected = reference.greedy(reference.chat_prompt(MESSAGES), 12)
    message = client.messages.create(model=MODEL_NAME, max_tokens=12, messages=MESSAGES, tools=[tool],
                                     tool_choice={"type": "none"}, extra_body=GREEDY)
    assert message.content[0].text == expected.text and message.stop_reason != "tool_use"
