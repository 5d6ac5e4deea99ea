"""Stop strings match across token boundaries, are never emitted, and abort the request."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import MODEL_NAME

PROMPT = "Once upon a time"
MAX_TOKENS = 48


def spanning_stop(reference, token_ids: list[int]) -> tuple[str, int]:
    """A 3-character stop string that straddles two tokens, and where it starts."""
    offsets = [len(reference.decode(token_ids[:i])) for i in range(len(token_ids) + 1)]
    text = reference.decode(token_ids)
    for i in range(2, len(token_ids) - 1):
        boundary = offsets[i]
        candidate = text[boundary - 2 : boundary + 1]
        if (
            offsets[i - 1] < boundary - 1  # the token before has 2+ characters
            and len(candidate) == 3
            and "\ufffd" not in candidate
            and text.find(candidate) == boundary - 2
        ):
            return candidate, boundary - 2
    raise AssertionError("no usable stop string in the reference output")


@pytest.fixture(scope="module")
def case(reference):
    prompt = reference.text_prompt(PROMPT)
    expected = reference.greedy(prompt, MAX_TOKENS)
    stop, at = spanning_stop(reference, expected.token_ids)
    return stop, expected.text[:at]


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_are_those_of_the_text_before_the_stop_string(server, reference, case, stream):
    """The tokens whose text is whole before the stop string: a stop string's tokens were given too."""
    stop, expected_text = case
    expected = reference.greedy(reference.text_prompt(PROMPT), MAX_TOKENS)
    whole = [t for i, t in enumerate(expected.token_ids)
             if len(reference.decode(expected.token_ids[:i + 1])) <= len(expected_text)]
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stop": stop,
            "logprobs": 1, "stream": stream}
    if stream:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
            choices = [json.loads(line[6:])["choices"] for line in r.iter_lines()
                       if line.startswith("data: ") and line != "data: [DONE]"]
        parts = [c[0] for c in choices if c]
    else:
        parts = server.http.post("/v1/completions", json=body).json()["choices"]
    text = "".join(p["text"] for p in parts)
    tokens = [t for p in parts if p["logprobs"] for t in p["logprobs"]["tokens"]]
    offsets = [o for p in parts if p["logprobs"] for o in p["logprobs"]["text_offset"]]
    assert text == expected_text
    assert tokens == [reference.decode([t]) for t in whole]
    assert offsets == sorted(offsets) and all(offset < len(text) for offset in offsets)


def test_stop_string_non_streaming(server, case):
    stop, expected_text = case
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stop": stop}
    choice = server.http.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["text"] == expected_text
    assert choice["finish_reason"] == "stop"


def test_stop_string_streaming_aborts_the_worker(server, case):
    stop, expected_text = case
    server.wait_idle()
    body = {
        "model": MODEL_NAME, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
        "stop": ["never-appears", stop], "stream": True, "ignore_eos": True,
    }
    pieces, finish = [], []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                pieces.append(choice["text"])
                if choice["finish_reason"]:
                    finish.append(choice["finish_reason"])
    assert "".join(pieces) == expected_text
    assert finish == ["stop"]
    server.wait_running(lambda n: n == 0, timeout=1.0)
    server.assert_steps_stopped()
