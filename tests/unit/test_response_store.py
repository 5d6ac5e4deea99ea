"""Stored responses: one client storing many, or large ones, pushes out its own, not the others'."""

import time

from gateway.images import ImageSource
from gateway.openai_responses import ResponseStore, StoredResponse
from gateway.openai_responses_schema import ResponseObject


def stored(client: str, n: int, image_bytes: int = 0) -> StoredResponse:
    response = ResponseObject(f"resp_{client}{n}", 0, "completed", "m", [], None, [], "auto", True, None, None, {},
                              None)
    images = [ImageSource("input", data="A" * image_bytes)] if image_bytes else []
    return StoredResponse(client, response, [{"role": "user", "content": "hi"}], images, time.monotonic())


def test_a_client_storing_many_evicts_its_own_oldest():
    store = ResponseStore(max_count=10, max_age_s=60, max_bytes=1 << 30)
    for n in range(3):
        store.put(stored("quiet", n))
    for n in range(100):
        store.put(stored("busy", n))
    assert all(store.get("quiet", f"resp_quiet{n}") for n in range(3))
    assert store.get("busy", "resp_busy99") and store.get("busy", "resp_busy0") is None


def test_a_client_storing_large_responses_evicts_its_own_by_bytes():
    store = ResponseStore(max_count=1000, max_age_s=60, max_bytes=1 << 20)
    store.put(stored("quiet", 0, image_bytes=100_000))
    for n in range(20):
        store.put(stored("busy", n, image_bytes=300_000))
    assert store.nbytes <= 1 << 20
    assert store.get("quiet", "resp_quiet0") and store.get("busy", "resp_busy19")
    assert store.get("busy", "resp_busy0") is None
    store.delete("quiet", "resp_quiet0")
    assert store.nbytes == sum(s.nbytes for s in store._responses.values())


def test_instructions_and_tools_count_toward_the_bytes():
    """A coding agent resends long instructions and tool lists every turn: each response kept them, uncounted."""
    long = stored("agent", 0)
    long.response.instructions = "Follow the rules. " * 50_000
    long.response.tools = [{"type": "function", "name": "f", "description": "d" * 100_000, "parameters": {}}]
    assert long.nbytes > 1_000_000
    store = ResponseStore(max_count=1000, max_age_s=60, max_bytes=2_500_000)
    for n in range(5):
        turn = stored("agent", n)
        turn.response.instructions = long.response.instructions
        store.put(turn)
    assert store.nbytes <= 2_500_000 and len(store._responses) == 2
