"""The gateway outlives the worker: kills, graceful restarts, freezes, double losses, gateway drain."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.conftest import MLXD, MODEL_NAME, ROOT, Server, stop_process, wait_for
from tests.tiny_model import make_tiny_model

PROMPT = "Once upon a time"
LONG = 900  # tokens: a few seconds of decoding, so that there is a middle to interrupt


class Prober(threading.Thread):
    """Polls /health every 50 ms and keeps every status code."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.statuses: list[int | str] = []
        self._halt = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=2) as client:
            while not self._halt.wait(0.05):
                try:
                    self.statuses.append(client.get(self.url + "/health").status_code)
                except httpx.HTTPError as e:
                    self.statuses.append(repr(e))

    def stop(self) -> list:
        self._halt.set()
        self.join()
        return self.statuses


class StreamReader(threading.Thread):
    """One streaming completion, read in the background."""

    def __init__(self, url: str, max_tokens: int = LONG) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                     "ignore_eos": True, "stream": True}
        self.pieces: list[str] = []
        self.times: list[float] = []
        self.errors: list[dict] = []
        self.done = False
        self.failure: Exception | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body, timeout=120) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            self.errors.append(event["error"])
                        elif event["choices"] and event["choices"][0]["text"]:
                            self.pieces.append(event["choices"][0]["text"])
                            self.times.append(time.monotonic())
        except Exception as e:  # recorded for the test's assertions
            self.failure = e

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def wait_for_pieces(self, n: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while len(self.pieces) < n:
            assert time.monotonic() < deadline and self.is_alive(), (len(self.pieces), self.failure)
            time.sleep(0.01)

    def longest_pause(self) -> float:
        return max(b - a for a, b in zip(self.times, self.times[1:]))


class Split:
    """A gateway and its workers as separate processes, the way launchd runs them."""

    def __init__(self, model, tmp_path, *gateway_args: str) -> None:
        self.model = model
        self.tmp_path = tmp_path
        self.endpoint = f"ipc://{tmp_path}/run/worker.sock"
        self.gateway_args = ["gateway", "--worker-endpoint", self.endpoint, "--served-model-name", MODEL_NAME,
                             *gateway_args]
        self.gateway = Server(self.gateway_args, tmp_path / "gateway.log")
        self.workers: list[subprocess.Popen] = []

    def restart_gateway(self) -> None:
        """As `launchctl kickstart -k` does: stop it, start it again; the workers stay."""
        self.gateway.stop()
        self.gateway = Server(self.gateway_args, self.tmp_path / "gateway-again.log")

    def start_worker(self, *args: str) -> subprocess.Popen:
        log = open(self.tmp_path / f"worker{len(self.workers)}.log", "wb")
        worker = subprocess.Popen(
            [*MLXD, "worker", "--model", str(self.model), "--worker-endpoint", self.endpoint,
             "--heartbeat-s", "0.1", *args],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        )
        self.workers.append(worker)
        return worker

    def close(self) -> None:
        for worker in self.workers:
            if worker.poll() is None:
                os.kill(worker.pid, signal.SIGCONT)
            stop_process(worker)
        self.gateway.stop()


@pytest.fixture()
def split(tiny_model, tmp_path):
    made = []

    def make(*gateway_args: str) -> Split:
        made.append(Split(tiny_model, tmp_path, *gateway_args))
        return made[-1]

    yield make
    for s in made:
        s.close()


@pytest.fixture(scope="module")
def expected(reference):
    return reference.greedy(reference.text_prompt(PROMPT), LONG, ignore_eos=True).text


def test_kill_9_mid_stream_then_a_new_worker(split, expected):
    s = split("--worker-timeout-s", "1")
    first = s.start_worker()
    s.gateway.wait_ready()
    gateway_pid = s.gateway.proc.pid
    prober = Prober(s.gateway.url)
    prober.start()
    reader = StreamReader(s.gateway.url)
    reader.start()
    reader.wait_for_pieces(20)
    os.kill(first.pid, signal.SIGKILL)
    s.start_worker()
    reader.join(60)
    statuses = prober.stop()

    assert reader.failure is None and reader.errors == [] and reader.done
    assert reader.text == expected
    assert statuses and all(status == 200 for status in statuses)
    assert s.gateway.proc.pid == gateway_pid and s.gateway.proc.poll() is None
    assert s.gateway.health()["worker"]["requests_resumed"] == 1
    print(f"\nkill -9, then a new worker: the client's longest pause was {reader.longest_pause():.2f}s")


def stream_on_a_worker(s: Split, *worker_args: str) -> tuple[subprocess.Popen, StreamReader]:
    """A first worker, and a stream under way on it."""
    worker = s.start_worker(*worker_args)
    s.gateway.wait_ready()
    reader = StreamReader(s.gateway.url)
    reader.start()
    reader.wait_for_pieces(20)
    return worker, reader


def sigterm_mid_stream(s: Split) -> StreamReader:
    """A stream under way on a first worker, which is then stopped (SIGTERM: it hands the stream back)."""
    first, reader = stream_on_a_worker(s, "--drain-s", "0.3")
    os.kill(first.pid, signal.SIGTERM)
    assert first.wait(10) == 0
    return reader


def test_sigterm_hands_requests_back(split, expected):
    s = split("--worker-timeout-s", "1")
    reader = sigterm_mid_stream(s)
    health = s.gateway.health()["worker"]
    assert health["state"] == "absent" and health["requests_waiting_for_a_worker"] == 1
    s.start_worker()
    reader.join(60)
    assert reader.failure is None and reader.errors == [] and reader.done
    assert reader.text == expected
    assert "handing 1 unfinished requests back" in (s.tmp_path / "worker0.log").read_text()


def test_supervised_worker_is_restarted_after_kill_9(tiny_model, tmp_path, expected):
    server = Server(["serve", "--model", str(tiny_model), "--served-model-name", MODEL_NAME,
                     "--heartbeat-s", "0.1"], tmp_path / "serve.log")
    try:
        server.wait_ready()
        reader = StreamReader(server.url)
        reader.start()
        reader.wait_for_pieces(20)
        os.kill(server.health()["worker"]["pid"], signal.SIGKILL)
        # A load balancer sends its clients elsewhere meanwhile.
        wait_for(lambda: server.http.get("/ready").status_code == 503, 5, "/ready to say 503 without a worker")
        reader.join(60)
        assert reader.failure is None and reader.errors == [] and reader.done
        assert reader.text == expected
        health = server.health()
        assert health["supervisor"]["restarts"] == 1
        assert health["supervisor"]["last_exit_status"] == -signal.SIGKILL
        assert health["worker"]["ready"] and server.http.get("/ready").status_code == 200
    finally:
        server.stop()


def test_an_admin_restart_of_a_stuck_worker_kills_it_past_its_drain(tiny_model, tmp_path):
    """An operator restarts a worker because it misbehaves: one that cannot
    act on SIGTERM (here stopped) is killed once its drain's time is up, and
    a new one serves."""
    server = Server(["serve", "--model", str(tiny_model), "--served-model-name", MODEL_NAME, "--drain-s", "0.5",
                     "--heartbeat-s", "0.1"], tmp_path / "serve.log")
    try:
        server.wait_ready()
        stuck = server.health()["worker"]["pid"]
        os.kill(stuck, signal.SIGSTOP)
        assert server.http.post(f"/admin/workers/{stuck}/restart").status_code == 202
        def replaced() -> bool:
            worker = server.health()["worker"]  # no pid while none is connected
            return worker.get("pid") not in (None, stuck) and worker["ready"]

        wait_for(replaced, 30, "a new worker")
        body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        assert server.http.post("/v1/completions", json=body).status_code == 200
    finally:
        server.stop()


def test_frozen_worker_is_not_ready_then_recovers(split, expected):
    s = split("--worker-timeout-s", "1", "--worker-wait-s", "1.5", "--hung-worker-s", "60")
    worker = s.start_worker()
    s.gateway.wait_ready()
    reader = StreamReader(s.gateway.url)
    reader.start()
    reader.wait_for_pieces(20)
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        waited = wait_for(lambda: s.gateway.http.get("/ready").status_code == 503, 5, "/ready to say 503")
        assert waited < 1 + 1.0
        started = time.monotonic()
        response = s.gateway.http.post(
            "/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "temperature": 0}
        )
        assert response.status_code == 503
        assert response.headers["retry-after"]
        assert 1.4 < time.monotonic() - started < 4
        assert s.gateway.health()["worker"]["state"] == "unresponsive"
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    wait_for(lambda: s.gateway.http.get("/ready").status_code == 200, 5, "/ready to say 200 again")
    reader.join(60)
    assert reader.failure is None and reader.errors == [] and reader.done
    assert reader.text == expected
    assert s.gateway.health()["worker"]["requests_resumed"] == 0  # nothing was lost


def test_a_frozen_gateway_does_not_find_its_worker_unresponsive(split, expected):
    """The worker beat on while the gateway stood still: on waking, the gateway took its own silence for the
    worker's, logged it unresponsive and made it not ready (and past --hung-worker-s would have killed it)."""
    s = split("--worker-timeout-s", "2")
    s.start_worker()
    s.gateway.wait_ready()
    reader = StreamReader(s.gateway.url)
    reader.start()
    reader.wait_for_pieces(20)
    os.kill(s.gateway.proc.pid, signal.SIGSTOP)
    time.sleep(4.5)
    os.kill(s.gateway.proc.pid, signal.SIGCONT)
    reader.join(60)
    assert reader.failure is None and reader.errors == [] and reader.text == expected
    events = [e["event"] for e in s.gateway.http.get("/admin/state").json()["events"]]
    assert events == ["ready"], events
    assert "the gateway's event loop stood still" in s.gateway.log_path.read_text()


def test_second_worker_loss_fails_cleanly(split):
    s = split("--worker-timeout-s", "0.5", "--hung-worker-s", "1", "--worker-wait-s", "30")
    first = s.start_worker()
    s.gateway.wait_ready()
    streaming = StreamReader(s.gateway.url, max_tokens=1500)
    streaming.start()
    blocking: dict = {}

    def post() -> None:
        body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
        blocking["response"] = httpx.post(s.gateway.url + "/v1/completions", json=body, timeout=120)

    poster = threading.Thread(target=post)
    poster.start()
    streaming.wait_for_pieces(10)
    wait_for(lambda: s.gateway.health()["worker"]["running"] == 2, 10, "both requests running")
    os.kill(first.pid, signal.SIGKILL)
    second = s.start_worker()
    wait_for(lambda: s.gateway.health()["worker"]["requests_resumed"] == 2, 30, "both requests resumed")
    resumed_at = len(streaming.pieces)
    streaming.wait_for_pieces(resumed_at + 5)
    os.kill(second.pid, signal.SIGKILL)
    streaming.join(30)
    poster.join(30)

    assert streaming.failure is None and streaming.done
    assert len(streaming.errors) == 1
    assert set(streaming.errors[0]) == {"message", "type", "param", "code"}
    response = blocking["response"]
    assert response.status_code == 503
    assert response.headers["retry-after"]
    assert "lost twice" in response.json()["error"]["message"]
    assert s.gateway.health()["worker"]["requests_failed_by_loss"] == 2


def test_gateway_sigterm_ends_open_streams_within_drain(split):
    s = split("--drain-s", "1")
    s.start_worker()
    s.gateway.wait_ready()
    reader = StreamReader(s.gateway.url, max_tokens=2000)
    reader.start()
    reader.wait_for_pieces(10)
    started = time.monotonic()
    os.kill(s.gateway.proc.pid, signal.SIGTERM)
    s.gateway.proc.wait(10)
    took = time.monotonic() - started
    reader.join(10)
    assert took < 1 + 2.5, took
    assert reader.failure is None and reader.done  # ended cleanly: an error event, then [DONE]
    assert [e["message"] for e in reader.errors] == ["the server is shutting down"]
    assert 0 < len(reader.pieces)


def test_a_worker_serves_the_gateway_started_after_its_own(split, expected):
    """The upgrade's last step restarts the gateway and leaves the worker (a
    launchd job of its own): the worker says Hello to the new gateway, which
    serves through it."""
    s = split()
    worker = s.start_worker()
    for _ in range(2):
        s.gateway.wait_ready(30)
        reader = StreamReader(s.gateway.url)
        reader.start()
        reader.join(60)
        assert reader.failure is None and reader.done and reader.text == expected
        assert s.gateway.health()["worker"]["pid"] == worker.pid
        s.restart_gateway()
    assert worker.poll() is None


PTRACE_SEIZE, PTRACE_INTERRUPT, WALL = 0x4206, 0x4207, 0x40000000


def freeze_main_thread(pid: int) -> None:
    """Stop only the worker's main thread (its thread id is its pid), the way a
    hang inside one MLX call would: PTRACE_INTERRUPT stops one thread and
    leaves the others, the heartbeat thread among them, running."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    for request in (PTRACE_SEIZE, PTRACE_INTERRUPT):
        if libc.ptrace(request, pid, None, None) != 0:
            pytest.skip(f"ptrace not permitted here (errno {ctypes.get_errno()})")


def killed_tracee(pid: int) -> bool:
    """Reap one report of the traced thread; True once it is its death (the
    interrupt's stop is reported first and must not be taken for it)."""
    reported, status = os.waitpid(pid, WALL | os.WNOHANG)
    return reported == pid and os.WIFSIGNALED(status)


@pytest.mark.skipif(sys.platform != "linux", reason="PTRACE_INTERRUPT is Linux's")
def test_hung_worker_is_detected_killed_and_replaced(tiny_model, tmp_path, expected):
    server = Server(["serve", "--model", str(tiny_model), "--served-model-name", MODEL_NAME,
                     "--heartbeat-s", "0.1", "--hung-worker-s", "1.5"], tmp_path / "serve.log")
    try:
        server.wait_ready()
        reader = StreamReader(server.url)
        reader.start()
        reader.wait_for_pieces(20)
        pid = server.health()["worker"]["pid"]
        freeze_main_thread(pid)
        # Heartbeats keep coming, the step counter does not move: hung, never
        # unresponsive (and killed by the supervisor right away, so the state
        # lasts too short a time to be polled from /health: the log has it).
        wait_for(lambda: f"worker pid {pid}: ready -> hung" in server.log_path.read_text(), 10,
                 lambda: f"the worker to be called hung; the log ends:\n{server.log_path.read_text()[-3000:]}")
        assert "unresponsive" not in server.log_path.read_text()
        # The supervisor kills it; as its tracer, the test must reap that
        # death before the supervisor can see it.
        wait_for(lambda: killed_tracee(pid), 10, "the hung worker to be killed")
        reader.join(60)
        assert reader.failure is None and reader.errors == [] and reader.done
        assert reader.text == expected
        assert server.health()["supervisor"]["last_exit_status"] == -signal.SIGKILL
        assert "is hung" in server.log_path.read_text()
    finally:
        server.stop()


def test_a_long_step_that_keeps_the_cpu_busy_is_not_hung(tmp_path):
    """One prompt chunk of 8,000 tokens: seconds on MLX's CPU backend (7 here,
    past --hung-worker-s 3), with the step counter still all along. The
    worker's CPU time climbs meanwhile, so it is not taken for hung (it was
    killed at every try, its request with it). A busy worker's counter may
    stand still ten times that long: room for a slower, loaded machine."""
    model = make_tiny_model(tmp_path / "long", context=8192)
    server = Server(["serve", "--model", str(model), "--served-model-name", MODEL_NAME, "--heartbeat-s", "0.05",
                     "--hung-worker-s", "3", "--prefill-chunk", "8192"], tmp_path / "serve.log")
    try:
        server.wait_ready()
        pid = server.health()["worker"]["pid"]
        started = time.monotonic()
        r = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"model": MODEL_NAME, "prompt": [5] * 8000, "max_tokens": 4, "ignore_eos": True})
        took = time.monotonic() - started
        print(f"\n8,000-token prompt in one chunk: answered in {took:.1f} s")
        assert took > 3, "the step was shorter than --hung-worker-s: nothing was tested"
        assert r.status_code == 200
        assert (r.json()["usage"]["prompt_tokens"], r.json()["usage"]["completion_tokens"]) == (8000, 4)
        assert server.health()["worker"]["pid"] == pid
        assert "hung" not in server.log_path.read_text()
    finally:
        server.stop()


def running_by_worker(s: Split) -> dict[int, int]:
    return {w["pid"]: w["running"] for w in s.gateway.health()["workers"] if w["ready"]}


def two_replicas(s: Split) -> tuple[subprocess.Popen, subprocess.Popen]:
    """Two workers of the model on the gateway's endpoint, both ready."""
    first, second = s.start_worker(), s.start_worker()
    s.gateway.wait_ready()
    wait_for(lambda: len(running_by_worker(s)) == 2, 60, "both workers ready")
    return first, second


def streams_on_both(s: Split, replicas: tuple[subprocess.Popen, ...], each: int, pieces: int) -> list[StreamReader]:
    """`each` long streams running on every replica: the least loaded takes
    each next one (the workers' heartbeats say so within moments)."""
    readers = [StreamReader(s.gateway.url) for _ in range(each * len(replicas))]
    for reader in readers:
        reader.start()
        reader.wait_for_pieces(pieces)
    wait_for(lambda: running_by_worker(s) == {r.pid: each for r in replicas}, 2, lambda: running_by_worker(s))
    return readers


def assert_read_whole(readers: list[StreamReader], expected: str) -> None:
    for reader in readers:
        reader.join(120)
        assert reader.failure is None and reader.errors == [] and reader.done
        assert reader.text == expected


def test_replicas_of_one_model_share_the_streams(split, expected):
    """Two workers on one endpoint: each takes requests, and every answer is the model's."""
    s = split()
    replicas = two_replicas(s)
    assert_read_whole(streams_on_both(s, replicas, each=2, pieces=1), expected)


def test_a_lost_replicas_streams_resume_on_the_other(split, expected):
    s = split("--worker-wait-s", "30")
    first, second = replicas = two_replicas(s)
    readers = streams_on_both(s, replicas, each=1, pieces=20)
    first.kill()
    assert_read_whole(readers, expected)  # the lost one's stream went on, on the other worker
    health = s.gateway.health()
    assert health["worker"]["requests_resumed"] == 1
    assert [w["pid"] for w in health["workers"]] == [second.pid]


def test_a_draining_replica_keeps_its_streams_when_another_connects(split, expected):
    """A replica stopped by its operator finishes its streams (--drain-s): one
    that connects meanwhile was taken to replace it ("not answering"), and its
    streams moved, each counted as a worker loss."""
    s = split("--worker-timeout-s", "30")
    first, reader = stream_on_a_worker(s, "--drain-s", "60")
    os.kill(first.pid, signal.SIGTERM)
    wait_for(lambda: [w["state"] for w in s.gateway.health()["workers"]] == ["draining"], 10, "the first to drain")
    os.kill(first.pid, signal.SIGSTOP)  # its stream still under way when the other says Hello
    try:
        second = s.start_worker()
        wait_for(lambda: second.pid in running_by_worker(s), 60, "the second worker")
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert_read_whole([reader], expected)
    assert first.wait(30) == 0
    assert s.gateway.health()["worker"]["requests_resumed"] == 0
    assert "replaced by a newer worker" not in s.gateway.log_path.read_text()


def test_a_shared_prefix_goes_to_the_replica_that_holds_it(split):
    s = split()
    first, second = two_replicas(s)
    shared = "The lighthouse keeper wrote down every ship that passed the rocks at night. " * 8

    def complete(prompt: str) -> dict:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0}
        return s.gateway.http.post("/v1/completions", json=body).json()

    oldest = s.gateway.health()["workers"][0]["pid"]  # the one balance picks between idle workers
    other = second.pid if oldest == first.pid else first.pid
    reader = StreamReader(s.gateway.url, max_tokens=300)  # keeps the oldest busy ...
    reader.start()
    reader.wait_for_pieces(1)
    assert complete(shared)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # ... so this goes to the other
    reader.join(60)
    wait_for(lambda: running_by_worker(s) == {first.pid: 0, second.pid: 0}, 5, lambda: running_by_worker(s))
    # Both idle: balance alone would pick the oldest; the other holds the prefix.
    usage = complete(shared + "Then the storm came.")["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > usage["prompt_tokens"] // 2, usage

    def hits() -> dict[int, int]:
        return {w["pid"]: w["prefix_cache"]["hits"] for w in s.gateway.health()["workers"]}
    wait_for(lambda: hits() == {oldest: 0, other: 1}, 2, hits)  # as the next heartbeats say
