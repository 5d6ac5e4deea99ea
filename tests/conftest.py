"""Fixtures: a tiny generated model, real mlxd processes serving it, and OpenAI's response schemas."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import pytest
import referencing
import referencing.jsonschema
import yaml

# The in-process mlx-lm reference must run on the same BLAS as the worker, or
# the two would round differently. This must happen before mlx is imported.
from worker.blas import load_fast_blas

load_fast_blas()

from tests.tiny_model import make_tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MLXD = [str(Path(sys.executable).parent / "mlxd")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(count: int) -> int:
    """The first of `count` consecutive ports free now (a distributed group's
    ranks bind the port given and the ones after it). Below the kernel's range
    of ephemeral ports (32768 up on Linux, 49152 up on macOS): there, any
    connection of another test may take the one after a free_port() meanwhile."""
    while True:
        first = random.randrange(20000, 32768 - count)
        with contextlib.ExitStack() as held:
            try:
                for port in range(first, first + count):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    raise
                continue
        return first


def wait_for(predicate, timeout: float, what, interval: float = 0.02) -> float:
    """Seconds until predicate() holds; fails the test after `timeout`.

    what: a description for the failure message, or a function returning one.
    """
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")
        time.sleep(interval)
    return time.monotonic() - started


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """Stop a process we started, by its PID: SIGTERM, then SIGKILL."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


class Server:
    """A running mlxd (gateway + worker) on 127.0.0.1."""

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None, new_session: bool = False) -> None:
        """new_session: a process group of its own, to be signalled as a terminal's Ctrl-C would."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [*MLXD, *args, "--port", str(self.port)],
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            # Models load at start, as with --preload, unless a test says otherwise: a
            # test's first request then finds its model ready, as most tests expect.
            env={**os.environ, "MLXD_PRELOAD": "true", **(env or {})},
            start_new_session=new_session,
        )
        self.http = httpx.Client(base_url=self.url, timeout=60)

    def health(self) -> dict:
        return self.http.get("/health").json()

    def answers(self) -> bool:
        """The gateway is up (whether or not a worker is)."""
        try:
            return self.http.get("/health").status_code == 200
        except httpx.TransportError:
            return False

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlxd exited early:\n{self.log_path.read_text()}")
            try:
                if self.health()["worker"]["ready"]:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"mlxd not ready after {timeout}s:\n{self.log_path.read_text()}")

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """Wait until the worker has nothing running or waiting; return its state."""
        deadline = time.monotonic() + timeout
        while True:
            worker = self.health()["worker"]
            if worker["running"] == 0 and worker["waiting"] == 0:
                return worker
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker still busy: {worker}")
            time.sleep(0.02)

    def wait_running(self, predicate, timeout: float) -> float:
        """Seconds until predicate(worker.running) holds."""
        return wait_for(lambda: predicate(self.health()["worker"]["running"]), timeout,
                        lambda: f"worker.running; worker state: {self.health()['worker']}", interval=0.01)

    def assert_steps_stopped(self) -> None:
        """The worker's step counter no longer rises: nothing is left decoding."""
        time.sleep(0.2)  # past any heartbeat that left before the last step
        first = self.health()["worker"]["steps"]
        time.sleep(0.3)
        assert self.health()["worker"]["steps"] == first

    def stop(self) -> None:
        self.http.close()
        stop_process(self.proc)
        self._log.close()


def stop_all(servers: list[Server]) -> None:
    """Stop servers together: each has its SIGTERM before any is waited for, so that their exits overlap."""
    for server in servers:
        if server.proc.poll() is None:
            os.kill(server.proc.pid, signal.SIGTERM)
    for server in servers:
        server.stop()  # a second SIGTERM, to one still stopping, ends its open requests at once


@contextlib.contextmanager
def running(args: list[str], log_path: Path, env: dict | None = None):
    """A Server that is ready, stopped when the block ends."""
    srv = Server(args, log_path, env)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


MODEL_NAME = "tiny"


@pytest.fixture(scope="session")
def server(tiny_model, tmp_path_factory):
    """`mlxd serve` with the affinity audit on and a fast heartbeat. Its model
    stays loaded: a test process's other files can keep it idle past the
    default keep-alive, and tests read its worker's state."""
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    with running(["serve", "--model", str(tiny_model), "--served-model-name", MODEL_NAME, "--heartbeat-s", "0.05",
                  "--keep-alive", "-1"], log, env={"MLXD_AFFINITY_AUDIT": "1"}) as srv:
        yield srv


@pytest.fixture(scope="session")
def reference(tiny_model):
    """mlx-lm in-process: the output every request through HTTP must equal."""
    from tests.reference import Reference

    return Reference(tiny_model)


SPEC = Path(__file__).resolve().parents[2] / "shared" / "specs" / "openai-openapi.yaml"


def json_schema_nulls(node):
    """The spec mixes JSON Schema with OpenAPI 3.0's `nullable: true`, which a
    JSON Schema validator ignores; spell it as JSON Schema."""
    if isinstance(node, list):
        return [json_schema_nulls(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: json_schema_nulls(v) for k, v in node.items()}
    if node.pop("nullable", False) is True:
        if "enum" in node:
            node["enum"] = [*node["enum"], None]
        if isinstance(node.get("type"), str):
            node["type"] = [node["type"], "null"]
        elif "type" not in node:
            return {"anyOf": [node, {"type": "null"}]}
    return node


@pytest.fixture(scope="session")
def validate():
    """validate(instance, component): the instance matches the OpenAPI description's schema of that name."""
    if not SPEC.exists():
        pytest.fail(f"{SPEC} is missing: the OpenAPI description is needed to check response shapes")
    spec = json_schema_nulls(yaml.load(SPEC.read_text(), Loader=yaml.CSafeLoader))
    resource = referencing.Resource.from_contents(spec, default_specification=referencing.jsonschema.DRAFT202012)
    registry = referencing.Registry().with_resource("urn:openai", resource)

    def check(instance, component: str) -> None:
        validator = jsonschema.Draft202012Validator({"$ref": f"urn:openai#/components/schemas/{component}"},
                                                    registry=registry)
        errors = sorted(validator.iter_errors(instance), key=lambda e: e.path)
        assert not errors, f"{component}: {errors[0].message} at {list(errors[0].path)}\n{json.dumps(instance)[:500]}"

    return check
