"""A client that goes away aborts its request in the worker at once."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.conftest import MODEL_NAME

LONG = {"model": MODEL_NAME, "max_tokens": 1500, "temperature": 0, "ignore_eos": True}


def wait_running(server, predicate, timeout: float) -> float:
    """Seconds until predicate(worker.running) holds."""
    start = time.monotonic()
    while not predicate(server.health()["worker"]["running"]):
        if time.monotonic() - start > timeout:
            raise AssertionError(f"worker state: {server.health()['worker']}")
        time.sleep(0.01)
    return time.monotonic() - start


def assert_steps_stopped(server) -> None:
    first = server.health()["worker"]["steps"]
    time.sleep(0.3)
    assert server.health()["worker"]["steps"] == first


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_streaming_client_disconnect_aborts(server, endpoint):
    server.wait_idle()
    body = dict(LONG, stream=True)
    body.update({"prompt": "Once upon a time"} if "chat" not in endpoint else {"messages": [{"role": "user", "content": "Hi"}]})
    with httpx.stream("POST", server.url + endpoint, json=body, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(10):
            next(lines)
        wait_running(server, lambda n: n == 1, timeout=5.0)
        # Leaving the block closes the connection mid-stream.
    assert wait_running(server, lambda n: n == 0, timeout=1.0) < 1.0
    assert_steps_stopped(server)


def test_non_streaming_client_disconnect_aborts(server):
    server.wait_idle()
    body = dict(LONG, prompt="Once upon a time")
    with pytest.raises(httpx.ReadTimeout):
        # The client gives up after 0.5 s and closes its connection.
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    assert wait_running(server, lambda n: n == 0, timeout=1.0) < 1.0
    assert_steps_stopped(server)
