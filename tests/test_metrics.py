"""GET /metrics in Prometheus' text format, counting what really happened."""

from __future__ import annotations

import re
import subprocess
import time

from tests.conftest import MLXD, MODEL_NAME, ROOT

LINE = re.compile(r'^[a-z_]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? -?[0-9.e+-]+$|^# (HELP|TYPE) .+$')


def scrape(server) -> dict[str, float]:
    text = server.http.get("/metrics").text
    samples = {}
    for line in text.strip().splitlines():
        assert LINE.match(line), line
        if not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_metrics_count_requests_tokens_and_latencies(server):
    before = scrape(server)
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    for n in (1, 1, 2):  # a request's first token is timed once, whatever its choices
        assert server.http.post("/v1/completions", json=dict(body, n=n)).status_code == 200
    assert server.http.post("/v1/completions", json=dict(body, model="nope")).status_code == 404
    after = scrape(server)

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert grew('mlxd_requests_total{endpoint="/v1/completions",status="200"}') == 3
    assert grew('mlxd_requests_total{endpoint="/v1/completions",status="404"}') == 1
    assert grew("mlxd_generation_tokens_total") == 24
    assert grew("mlxd_time_to_first_token_seconds_count") == 3
    assert grew("mlxd_inter_token_latency_seconds_count") >= 3
    assert after['mlxd_time_to_first_token_seconds_bucket{le="+Inf"}'] == after["mlxd_time_to_first_token_seconds_count"]
    assert after["mlxd_worker_ready"] == 1
    worker = server.health()["worker"]
    labels = f'{{model="{worker["names"][0]}",pid="{worker["pid"]}"}}'
    assert after[f"mlxd_worker_epoch{labels}"] == float(worker["epoch"])
    assert after[f"mlxd_worker_up{labels}"] == 1
    # A worker's own numbers come with its heartbeats: the four prompts' look-ups show within a few.
    lookups = f"mlxd_prefix_cache_lookups_total{labels}"
    deadline = time.monotonic() + 10
    while grew(lookups) < 4 and time.monotonic() < deadline:  # (none before the worker's first heartbeat)
        time.sleep(0.1)
        after = scrape(server)
    assert grew(lookups) == 4  # n=2 is two prompts
    assert grew(f"mlxd_worker_steps_total{labels}") >= 6


def test_requests_are_counted_by_route_never_by_the_path_sent(server):
    """A path is the client's to write: counted by the route it matched (or
    as "other"), it neither writes into the metrics nor adds a counter."""
    before = scrape(server)
    assert server.http.get("/v1/x%22%7D%201%0Amlxd_forged%7Ba%3D%22").status_code == 404
    for response_id in ("resp_a", "resp_b"):
        assert server.http.get(f"/v1/responses/{response_id}").status_code == 404
    after = scrape(server)  # every line still parses
    assert not any("forged" in name or "resp_" in name for name in after)
    key = 'mlxd_requests_total{endpoint="/v1/responses/{response_id}",status="404"}'
    assert after.get(key, 0) - before.get(key, 0) == 2


def test_mlxd_ps_names_a_model_as_clients_call_it(server):
    """With --served-model-name, a worker's model is its source path: ps showed the path."""
    result = subprocess.run([*MLXD, "ps", "--url", server.url], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    _, row = result.stdout.splitlines()
    assert row.split()[0] == MODEL_NAME and server.health()["workers"][0]["names"] == [MODEL_NAME]
