"""A stream that has nothing to send (its request waits behind another, or
prefills a long prompt) sends keep-alives in its API's own form, and its
answer is the one it has without them."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from tests.conftest import MODEL_NAME, running
from tests.test_responses_api import event_schema

KEEPALIVE_S = 0.2
WAIT_S = 1.0  # how long the stream waits: about five keep-alives
QUESTION = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def one_slot(tiny_model, tmp_path_factory):
    """One request decodes at a time: the next one waits in the worker, its stream open."""
    log = tmp_path_factory.mktemp("keepalive") / "serve.log"
    with running(["serve", "--model", str(tiny_model), "--served-model-name", MODEL_NAME, "--max-batch", "1",
                  "--stream-keepalive-s", str(KEEPALIVE_S)], log) as srv:
        yield srv


@contextmanager
def worker_taken(server) -> Iterator[threading.Event]:
    """A stream holds the worker's one slot until the Event yielded is set (its client leaves then)."""
    body = {"model": MODEL_NAME, "messages": QUESTION, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    decoding, let_go = threading.Event(), threading.Event()

    def hold() -> None:
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if '"content"' in line:
                    decoding.set()
                if let_go.is_set():
                    return

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert decoding.wait(30), "the holding stream never decoded"
        yield let_go
    finally:
        let_go.set()
        holder.join(60)


def stream_behind_another(server, path: str, body: dict) -> tuple[list[str], list[str]]:
    """The stream's lines while another request holds the worker for WAIT_S,
    and the lines after it lets go (the answer)."""
    before, after = [], []
    with worker_taken(server) as let_go, httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        started = time.monotonic()
        for line in r.iter_lines():
            if time.monotonic() - started > WAIT_S:
                let_go.set()
            (after if let_go.is_set() else before).append(line)
    return [line for line in before if line], [line for line in after if line]


def data(lines: list[str]) -> list[dict]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]


def test_a_waiting_responses_stream_repeats_in_progress(one_slot, reference, validate):
    """Codex's idle timer counts events (an SSE comment let it time out and resend): in_progress it reads past."""
    expected = reference.greedy(reference.chat_prompt(QUESTION), 8)
    body = {"model": MODEL_NAME, "input": "Hello there", "temperature": 0, "max_output_tokens": 8, "stream": True}
    before, after = stream_behind_another(one_slot, "/v1/responses", body)
    waiting, answering = data(before), data(after)
    assert [e["type"] for e in waiting[:2]] == ["response.created", "response.in_progress"]
    assert len(waiting) >= 4 and {e["type"] for e in waiting[2:]} == {"response.in_progress"}, before
    events = waiting + answering
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        validate(event, event_schema(event))
    assert "".join(e["delta"] for e in answering if e["type"] == "response.output_text.delta") == expected.text


def test_a_waiting_chat_stream_sends_comments(one_slot, reference):
    expected = reference.greedy(reference.chat_prompt(QUESTION), 8)
    body = {"model": MODEL_NAME, "messages": QUESTION, "temperature": 0, "max_tokens": 8, "stream": True}
    before, after = stream_behind_another(one_slot, "/v1/chat/completions", body)
    assert before.count(": keepalive") >= 2
    assert all(line == ": keepalive" or '"role":"assistant"' in line for line in before), before
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in data(after) if c["choices"]) == expected.text


def test_a_waiting_anthropic_stream_pings(one_slot, reference):
    expected = reference.greedy(reference.chat_prompt(QUESTION), 8)
    body = {"model": MODEL_NAME, "messages": QUESTION, "temperature": 0, "max_tokens": 8, "stream": True}
    before, after = stream_behind_another(one_slot, "/v1/messages", body)
    waiting = [e["type"] for e in data(before)]
    assert waiting[0] == "message_start" and waiting.count("ping") >= 3 and set(waiting[1:]) == {"ping"}, before
    text = "".join(e["delta"].get("text", "") for e in data(after) if e["type"] == "content_block_delta")
    assert text == expected.text
