"""The real worker process, driven by a test that plays the gateway over real ZeroMQ."""

from __future__ import annotations

import subprocess
import sys
import time

import msgspec
import pytest
import zmq

from protocol import (
    PROTOCOL_VERSION,
    Abort,
    AddRequest,
    Embed,
    Error,
    Heartbeat,
    Hello,
    Refused,
    Sampling,
    StepOutput,
    Welcome,
    decode_from_worker,
    encode,
)
from tests.conftest import ROOT, stop_process


class FakeGateway:
    """A ROUTER socket in the test, and a real worker process connected to it."""

    def __init__(self, model_path, tmp_path) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        endpoint = f"ipc://{tmp_path}/worker.sock"
        self.socket.bind(endpoint)
        self.log_path = tmp_path / "worker.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "worker", "--model", str(model_path), "--worker-endpoint", endpoint,
             "--heartbeat-s", "0.05"],
            cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
        )
        # Steps received while waiting for another message (a request's first token may come before
        # another's Error, when the worker reads the two in turns of their own).
        self.steps_passed: list[StepOutput] = []
        self.identity, self.hello = self.receive_until(Hello, timeout=60)

    def send(self, message) -> None:
        self.socket.send_multipart([self.identity, encode(message)])

    def send_raw(self, frame: bytes) -> None:
        self.socket.send_multipart([self.identity, frame])

    def receive(self, timeout: float):
        if not self.socket.poll(int(timeout * 1000)):
            raise TimeoutError(f"nothing from the worker in {timeout}s:\n{self.log_path.read_text()}")
        identity, frame = self.socket.recv_multipart()
        return identity, decode_from_worker(frame)

    def receive_until(self, kind, timeout: float = 10.0, where=lambda m: True):
        deadline = time.monotonic() + timeout
        while True:
            identity, message = self.receive(max(deadline - time.monotonic(), 0.01))
            if isinstance(message, kind) and where(message):
                return identity, message
            if isinstance(message, StepOutput):  # a running request's tokens, kept for collect()
                self.steps_passed.append(message)

    def collect(self, request_id: str, timeout: float = 30.0) -> tuple[list[int], str]:
        tokens = []
        deadline = time.monotonic() + timeout
        while True:
            if self.steps_passed:
                message = self.steps_passed.pop(0)
            else:
                _, message = self.receive_until(StepOutput, max(deadline - time.monotonic(), 0.01))
            for output in message.outputs:
                if output.request_id == request_id:
                    tokens += output.token_ids
                    if output.finish_reason:
                        return tokens, output.finish_reason

    def close(self) -> None:
        stop_process(self.proc)
        self._log.close()
        self.socket.close()
        self.context.term()


@pytest.fixture(scope="module")
def gateway(tiny_model, tmp_path_factory):
    fake = FakeGateway(tiny_model, tmp_path_factory.mktemp("worker"))
    fake.send(Welcome(fake.hello.epoch))
    yield fake
    fake.close()


def test_hello_announces_the_worker(gateway, tiny_model):
    hello = gateway.hello
    assert hello.protocol_version == PROTOCOL_VERSION
    assert hello.pid == gateway.proc.pid
    assert hello.model == str(tiny_model)
    assert hello.context_length == 2048
    assert hello.capacity == 32
    assert hello.eos_token_ids == [2]
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(hello.tokenizer_files)
    assert "model.safetensors" not in hello.tokenizer_files


def test_greedy_tokens_equal_mlx_lm(gateway, reference):
    prompt = reference.text_prompt("Once upon a time")
    expected = reference.greedy(prompt, 32)
    gateway.send(AddRequest("r1", prompt, Sampling(max_tokens=32)))
    assert gateway.collect("r1") == (expected.token_ids, expected.finish_reason)


@pytest.mark.parametrize(
    "frame",
    [b"", b"\xc1", msgspec.msgpack.encode(["launch_missiles"]), encode(Abort(["x"]))[:-2], encode(Heartbeat(1, 1, 0, 0))],
    ids=["empty", "invalid msgpack", "unknown type", "truncated", "wrong direction"],
)
def test_unreadable_message_is_answered_and_survived(gateway, reference, frame):
    gateway.send_raw(frame)
    _, error = gateway.receive_until(Error)
    assert error.request_id is None
    assert gateway.proc.poll() is None
    prompt = reference.text_prompt("The quick brown fox")
    gateway.send(AddRequest("after-garbage", prompt, Sampling(max_tokens=8)))
    assert gateway.collect("after-garbage") == (reference.greedy(prompt, 8).token_ids, "length")


@pytest.mark.parametrize(
    "request_, fragment",
    [
        (AddRequest("bad-vocab", [1, 100_000], Sampling(max_tokens=4)), "outside the vocabulary"),
        (AddRequest("bad-empty", [], Sampling(max_tokens=4)), "empty prompt"),
        (AddRequest("bad-max", [1, 2], Sampling(max_tokens=0)), "max_tokens"),
        (AddRequest("bad-temp", [1, 2], Sampling(max_tokens=4, temperature=-1)), "out of range"),
        (AddRequest("bad-context", [5] * 2048, Sampling(max_tokens=4)), "context"),
        # The gateway checks an embedding's ids too; past the embedding table, MLX would end the process.
        (Embed("bad-embed-vocab", [[1, 2], [3, 100_000]]), "outside the vocabulary"),
        (Embed("bad-embed-empty", [[1, 2], []]), "empty"),
    ],
    ids=lambda x: getattr(x, "request_id", ""),
)
def test_invalid_request_gets_an_error_for_itself_only(gateway, reference, request_, fragment):
    prompt = reference.text_prompt("Numbers 0 1 2")
    gateway.send(AddRequest("good-neighbour", prompt, Sampling(max_tokens=12)))
    gateway.send(request_)
    _, error = gateway.receive_until(Error, where=lambda e: e.request_id == request_.request_id)
    assert fragment in error.message
    assert gateway.collect("good-neighbour") == (reference.greedy(prompt, 12).token_ids, "length")


def test_duplicate_request_id_is_refused(gateway):
    gateway.send(AddRequest("dup", [1, 2, 3], Sampling(max_tokens=200, ignore_eos=True)))
    gateway.send(AddRequest("dup", [4, 5, 6], Sampling(max_tokens=4)))
    _, error = gateway.receive_until(Error, where=lambda e: e.request_id == "dup")
    assert "already running" in error.message
    gateway.send(Abort(["dup"]))
    gateway.receive_until(Heartbeat, where=lambda h: h.running == 0 and h.waiting == 0)


def test_abort_stops_output_for_good(gateway):
    gateway.send(AddRequest("long", [1, 2, 3], Sampling(max_tokens=1500, ignore_eos=True)))
    _, first = gateway.receive_until(StepOutput, where=lambda s: any(o.request_id == "long" for o in s.outputs))
    gateway.send(Abort(["long", "never-existed"]))
    gateway.send(Abort(["long"]))  # idempotent
    steps_with_output = [first.step]

    def note(message) -> None:
        if isinstance(message, StepOutput):
            steps_with_output.extend(message.step for o in message.outputs if o.request_id == "long")

    while True:
        _, message = gateway.receive(5)
        note(message)
        if isinstance(message, Heartbeat) and message.running == 0:
            idle_at = message.step
            break
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:
        note(gateway.receive(1)[1])
    # Nothing for the aborted request from any step after the worker dropped it.
    assert max(steps_with_output) <= idle_at


def test_refused_worker_exits(tiny_model, tmp_path):
    fake = FakeGateway(tiny_model, tmp_path)
    try:
        fake.send(Refused("protocol version mismatch: the gateway speaks version 0, the worker speaks version 1"))
        assert fake.proc.wait(30) == 2
        assert "protocol version mismatch" in fake.log_path.read_text()
    finally:
        fake.close()
