"""Gateway and worker as two processes, the way launchd runs them."""

from __future__ import annotations

import subprocess
import time

import msgspec
import pytest
import zmq

from protocol import PROTOCOL_VERSION, Hello, Refused, decode_to_worker, encode
from tests.conftest import MLXD, MODEL_NAME, ROOT, Server, stop_process, wait_for
from worker.blas import openblas_path


@pytest.fixture()
def gateway(tmp_path):
    endpoint = f"ipc://{tmp_path}/run/worker.sock"
    srv = Server(
        ["gateway", "--worker-endpoint", endpoint, "--worker-wait-s", "1", "--served-model-name", MODEL_NAME],
        tmp_path / "gateway.log",
    )
    srv.endpoint = endpoint
    wait_for(srv.answers, 30, lambda: f"the gateway:\n{srv.log_path.read_text()}")
    yield srv
    srv.stop()


def test_no_worker_means_503_with_retry_after(gateway):
    health = gateway.health()
    assert health["status"] == "ok"
    assert health["worker"]["ready"] is False and health["worker"]["state"] == "absent"
    assert gateway.http.get("/ready").status_code == 503
    started = time.monotonic()
    response = gateway.http.post(
        "/v1/chat/completions", json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert response.status_code == 503
    assert response.headers["retry-after"]
    assert response.json()["error"]["type"] == "service_unavailable"
    assert 0.9 < time.monotonic() - started < 5


def test_worker_of_another_protocol_version_is_refused(gateway, tmp_path):
    context = zmq.Context()
    rogue = context.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(gateway.endpoint)
    try:
        rogue.send(msgspec.msgpack.encode(["hello", PROTOCOL_VERSION + 98, 1, 2, "m", {"future": True}]))
        assert rogue.poll(10_000), "the gateway did not answer"
        refused, _ = decode_to_worker([rogue.recv()])
        assert isinstance(refused, Refused)
        assert f"version {PROTOCOL_VERSION}" in refused.reason
        assert f"version {PROTOCOL_VERSION + 98}" in refused.reason
        assert gateway.health()["worker"]["state"] == "absent"
    finally:
        rogue.close()
        context.term()


def test_a_worker_whose_tokenizer_cannot_load_is_refused_and_the_gateway_serves_on(gateway):
    context = zmq.Context()
    rogue = context.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(gateway.endpoint)
    try:
        rogue.send(encode(Hello(PROTOCOL_VERSION, 1, 2, "m", 2048, 384, 32, [2], {"tokenizer.json": b"{not json"})))
        assert rogue.poll(10_000), "the gateway did not answer"
        refused, _ = decode_to_worker([rogue.recv()])
        assert isinstance(refused, Refused) and "tokenizer" in refused.reason
        assert gateway.health()["worker"]["state"] == "absent"
    finally:
        rogue.close()
        context.term()


def test_separate_worker_process_serves_and_leaves(gateway, tiny_model, reference, tmp_path):
    gateway_pid = gateway.proc.pid
    with open(tmp_path / "worker.log", "wb") as log:
        worker = subprocess.Popen(
            [*MLXD, "worker", "--model", str(tiny_model), "--worker-endpoint", gateway.endpoint],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        )
        try:
            gateway.wait_ready()
            assert gateway.health()["worker"]["pid"] == worker.pid
            prompt = reference.text_prompt("Once upon a time")
            expected = reference.greedy(prompt, 16)
            response = gateway.http.post(
                "/v1/completions",
                json={"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0},
            )
            assert response.json()["choices"][0]["text"] == expected.text
        finally:
            stop_process(worker)
    assert worker.returncode == 0
    wait_for(lambda: not gateway.health()["worker"]["ready"], 5, "the gateway to see the worker leave")
    assert gateway.proc.poll() is None and gateway.proc.pid == gateway_pid
    path = openblas_path()
    expected_blas = f"BLAS: OpenBLAS ({path})" if path else "BLAS: reference BLAS bundled with mlx"
    assert expected_blas in (tmp_path / "worker.log").read_text()
