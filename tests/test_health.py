"""The event loop never waits on the model: /health stays fast while 8 streams decode."""

from __future__ import annotations

import statistics
import threading
import time

import httpx

from tests.conftest import MODEL_NAME


def test_health_is_fast_while_eight_streams_decode(server):
    server.wait_idle()
    stop = threading.Event()

    def stream(i: int) -> None:
        body = {"model": MODEL_NAME, "prompt": f"Story {i}:", "max_tokens": 1500, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    try:
        server.wait_running(lambda n: n >= 8, timeout=10)
        latencies = []
        with httpx.Client(base_url=server.url) as client:
            for _ in range(100):
                start = time.perf_counter()
                response = client.get("/health")
                latencies.append(time.perf_counter() - start)
                assert response.status_code == 200
                time.sleep(0.01)
        assert server.health()["worker"]["running"] == 8, "the streams ended before the measurement did"
    finally:
        stop.set()
        for t in threads:
            t.join()
    p95 = statistics.quantiles(latencies, n=20)[-1]
    print(f"\n/health with 8 streams decoding: p50 {statistics.median(latencies) * 1000:.1f} ms, p95 {p95 * 1000:.1f} ms")
    assert p95 < 0.050, f"/health p95 {p95 * 1000:.1f} ms"


def test_health_shape(server):
    body = server.health()
    assert body["status"] == "ok"
    worker = body["worker"]
    for key, kind in [("ready", bool), ("pid", int), ("epoch", int), ("running", int), ("waiting", int), ("steps", int)]:
        assert isinstance(worker[key], kind), key
