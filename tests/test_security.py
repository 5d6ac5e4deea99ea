"""Safe on a LAN: keys, bind policy, Host guard, CORS, limits, transport, logs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import stat
import subprocess
import time
from datetime import datetime, timedelta, timezone

import httpx
import pytest

from tests.conftest import MLXD, MODEL_NAME, ROOT, Server, free_port, stop_process, wait_for
from tests.test_restarts import StreamReader

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
SECRET_PROMPT = "the-secret-prompt-text-zebra"


def serve(tiny_model, tmp_path, *args: str, env: dict | None = None, name: str = "serve") -> Server:
    server = Server(["serve", "--model", str(tiny_model), "--served-model-name", MODEL_NAME, *args],
                    tmp_path / f"{name}.log", env=env)
    server.wait_ready()
    return server


def assert_error(response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code:
        assert error["code"] == code
    return error


@pytest.fixture(scope="module")
def keyed(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keyed")
    key_file = tmp / "keys.txt"
    key_file.write_text("# one key per line\nfile-key-2\n")
    server = Server(
        ["serve", "--model", str(tiny_model), "--served-model-name", MODEL_NAME, "--api-key", "flag-key-1",
         "--api-key-file", str(key_file), "--max-inflight-per-key", "1", "--heartbeat-s", "0.05"],
        tmp / "serve.log",
        env={"MLXD_API_KEYS": "ignored-because-the-flag-wins"},
    )
    wait_for(lambda: _ready_with_key(server), 60, "the keyed server")
    server.key_file = key_file
    yield server
    server.stop()


def _ready_with_key(server) -> bool:
    try:
        return server.http.get("/health", headers={"x-api-key": "flag-key-1"}).json()["worker"]["ready"]
    except httpx.TransportError:
        return False


def test_keys_are_required_on_v1(keyed):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}, {"Authorization": "Basic flag-key-1"}):
        assert_error(keyed.http.get("/v1/models", headers=headers), 401, "invalid_api_key")
        assert_error(keyed.http.post("/v1/chat/completions", json=CHAT, headers=headers), 401, "invalid_api_key")
    assert keyed.http.get("/v1/models", headers={"Authorization": "Bearer flag-key-1"}).status_code == 200
    response = keyed.http.post("/v1/chat/completions", json=CHAT, headers={"x-api-key": "file-key-2"})
    assert response.status_code == 200
    assert keyed.http.get("/v1/models", headers={"x-api-key": "ignored-because-the-flag-wins"}).status_code == 401
    # Who guesses at keys shows in the log, a line a minute per address however many guesses; and the
    # keys, shorter than 16 characters, were warned of.
    log = keyed.log_path.read_text()
    assert log.count("refused a request from 127.0.0.1") == 1
    assert "2 of the API keys are shorter than 16 characters" in log


def test_health_is_open_but_details_need_a_key(keyed):
    assert keyed.http.get("/health").json() == {"status": "ok", "worker": {"ready": True}}
    assert keyed.http.get("/ready").status_code == 200
    detailed = keyed.http.get("/health", headers={"x-api-key": "flag-key-1"}).json()
    assert detailed["worker"]["pid"] > 0


def test_key_file_is_reread_on_sighup(keyed):
    keyed.key_file.write_text("file-key-3\n")
    os.kill(keyed.proc.pid, signal.SIGHUP)
    wait_for(lambda: keyed.http.get("/v1/models", headers={"x-api-key": "file-key-3"}).status_code == 200, 5,
             "the new key")
    assert keyed.http.get("/v1/models", headers={"x-api-key": "file-key-2"}).status_code == 401
    assert keyed.http.get("/v1/models", headers={"x-api-key": "flag-key-1"}).status_code == 200


def test_in_flight_per_key_gets_429(keyed):
    headers = {"x-api-key": "flag-key-1"}
    body = dict(StreamReader(keyed.url, max_tokens=1500).body)
    with httpx.stream("POST", keyed.url + "/v1/completions", json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept: a dropped iterator would close the stream
        next(lines)
        second = keyed.http.post("/v1/completions", json=dict(body, stream=False, max_tokens=2), headers=headers)
        assert_error(second, 429, "rate_limit_exceeded")
        assert second.headers["retry-after"]
        other_key = keyed.http.post("/v1/chat/completions", json=CHAT, headers={"x-api-key": "file-key-3"})
        assert other_key.status_code == 200


def test_a_key_file_without_a_key_refuses_to_start_on_loopback_too(tmp_path):
    """It served every client without a key: a proxy on loopback may bring the LAN."""
    key_file = tmp_path / "keys"
    key_file.write_text("# the team's keys go here\n")
    result = subprocess.run(
        [*MLXD, "gateway", "--port", str(free_port()), "--api-key-file", str(key_file),
         "--worker-endpoint", f"ipc://{tmp_path}/w.sock"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode != 0
    assert "holds no key" in result.stderr and "Traceback" not in result.stderr


def test_non_loopback_bind_without_key_refuses_to_start(tmp_path):
    result = subprocess.run(
        [*MLXD, "gateway", "--host", "0.0.0.0", "--port", str(free_port()),
         "--worker-endpoint", f"ipc://{tmp_path}/w.sock"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode != 0
    assert "--api-key" in result.stderr and "--insecure-no-auth" in result.stderr
    assert "Traceback" not in result.stderr


def test_insecure_no_auth_starts_with_a_loud_warning_and_guards_its_host(tmp_path):
    """Beyond loopback without keys, DNS rebinding reaches the server too (a page's
    name made to resolve to the Mac's address): its requests, under the page's own
    name, passed the cross-site check. Addresses and the machine's names pass."""
    server = Server(["gateway", "--host", "0.0.0.0", "--insecure-no-auth", "--allowed-host", "mlx.lan",
                     "--worker-endpoint", f"ipc://{tmp_path}/w.sock"], tmp_path / "gateway.log")
    try:
        wait_for(server.answers, 30, "the gateway")
        assert "NO API KEY" in server.log_path.read_text()
        port = server.port
        rebound = {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}",
                   "Sec-Fetch-Site": "same-origin"}
        assert_error(server.http.post("/admin/models/tiny/unload", headers=rebound), 403, "host_not_allowed")
        assert_error(server.http.get("/v1/models", headers={"Host": "evil.example"}), 403, "host_not_allowed")
        for host in (f"192.168.1.5:{port}", f"[fe80::1]:{port}", f"{socket.gethostname()}:{port}",
                     f"{socket.gethostname().removesuffix('.local')}.local", "mlx.lan", f"localhost:{port}"):
            assert server.http.get("/v1/models", headers={"Host": host}).status_code == 200, host
    finally:
        server.stop()


def test_host_guard_on_loopback_without_keys(server):
    port = server.port
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.nip.io", "192.168.1.5", "internal.example",
                 "localhost.evil.example"):
        assert_error(server.http.get("/v1/models", headers={"Host": host}), 403, "host_not_allowed")
    # Reserved names no page can rebind; Docker Desktop's containers reach the Mac by host.docker.internal.
    for host in ("localhost", f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}",
                 f"host.docker.internal:{port}", "app.localhost"):
        assert server.http.get("/v1/models", headers={"Host": host}).status_code == 200


def test_allowed_host_and_cors(tiny_model, tmp_path):
    server = serve(tiny_model, tmp_path, "--allowed-host", "mlx.lan", "--cors-origin", "http://app.example")
    try:
        assert server.http.get("/v1/models", headers={"Host": "mlx.lan:80"}).status_code == 200
        assert server.http.get("/v1/models", headers={"Host": "other.lan"}).status_code == 403
        preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization,content-type"}
        allowed = server.http.options("/v1/chat/completions", headers=preflight)
        assert allowed.headers["access-control-allow-origin"] == "http://app.example"
        # The Anthropic SDK in a browser: its own headers pass the preflight too.
        sdk = dict(preflight, **{"Access-Control-Request-Headers": "anthropic-version,x-api-key,x-stainless-os,"
                                                                   "anthropic-dangerous-direct-browser-access"})
        assert server.http.options("/v1/messages", headers=sdk).status_code == 200
        other = server.http.options("/v1/chat/completions", headers=dict(preflight, Origin="http://evil.example"))
        assert "access-control-allow-origin" not in other.headers
    finally:
        server.stop()


def test_cors_is_off_by_default_but_for_local_apps(server):
    """Ollama's desktop apps (Obsidian's plugins, Tauri apps, VS Code's webviews, pages served on this
    machine) send their page's origin, as Ollama lets them by default; no web page elsewhere has one."""
    response = server.http.get("/v1/models", headers={"Origin": "http://app.example"})
    assert "access-control-allow-origin" not in response.headers
    for origin in ("app://obsidian.md", "vscode-webview://1f2e3d", "tauri://localhost", "http://localhost:3000"):
        preflight = {"Origin": origin, "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "content-type"}
        answer = server.http.options("/api/chat", headers=preflight)
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == origin
    for origin in ("http://localhost.evil.example", "null", "https://evil.example"):
        preflight = {"Origin": origin, "Access-Control-Request-Method": "POST"}
        assert "access-control-allow-origin" not in server.http.options("/api/chat", headers=preflight).headers
    # The APIs only: never the operator's pages and numbers.
    local = {"Origin": "http://localhost:3000"}
    for path in ("/admin/state", "/admin", "/metrics", "/health"):
        assert "access-control-allow-origin" not in server.http.get(path, headers=local).headers, path
    preflight = {**local, "Access-Control-Request-Method": "POST"}
    assert "access-control-allow-origin" not in server.http.options(f"/admin/models/{MODEL_NAME}/unload",
                                                                    headers=preflight).headers


def test_limits(tiny_model, tmp_path):
    server = serve(tiny_model, tmp_path, "--max-body-bytes", "2000", "--max-tokens-limit", "1500",
                   "--request-timeout-s", "0.5", "--body-timeout-s", "0.5", "--max-inflight", "1",
                   "--heartbeat-s", "0.05")
    try:
        big = dict(CHAT, messages=[{"role": "user", "content": "x" * 3000}])
        assert_error(server.http.post("/v1/chat/completions", json=big), 413, "request_too_large")

        def chunked():
            yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
            yield b"y" * 3000
            yield b'"}]}'

        assert_error(server.http.post("/v1/chat/completions", content=chunked()), 413, "request_too_large")
        assert_error(server.http.post("/v1/chat/completions", json=dict(CHAT, max_tokens=1501)), 400)

        # A client that announces a body and then stalls.
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\"")
            sock.settimeout(5)
            assert sock.recv(100).startswith(b"HTTP/1.1 408")

        # A body that never ends after its answer (the app never read it): closed at twice the body timeout.
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1000000000000\r\n\r\n")
            sock.settimeout(5)
            assert sock.recv(100).startswith(b"HTTP/1.1 200")
            started = time.monotonic()
            sock.sendall(b"x")
            while sock.recv(65536):
                pass
            assert time.monotonic() - started < 3
        # Headers past 64 KiB (and the read they began in): a 431, not a request line copied as it grows
        # on the event loop.
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Padding: ")
            with contextlib.suppress(OSError):  # the server closes while this still sends
                for _ in range(256):
                    sock.sendall(b"a" * 8192)
                    time.sleep(0.001)
            sock.settimeout(5)
            try:
                assert sock.recv(100).startswith(b"HTTP/1.1 431")
            except ConnectionResetError:
                pass  # closed while bytes still came: the kernel may drop the 431 before it is read

        # A body still on its way is in flight too: slow bodies cannot pile up past the limits.
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
            time.sleep(0.1)
            quick = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}
            assert_error(server.http.post("/v1/completions", json=quick), 503, "overloaded")
        # Refused before routing, it is still counted as its endpoint's.
        assert 'mlxd_requests_total{endpoint="/v1/completions",status="503"}' in server.http.get("/metrics").text

        # Connections that never finish their headers (or never start them) are closed: each holds a descriptor,
        # and without a key (read from the headers) nothing else stops a host on the network from opening them.
        for opening in (b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"):
            with socket.create_connection(("127.0.0.1", server.port)) as sock:
                sock.sendall(opening)
                sock.settimeout(5)
                started = time.monotonic()
                assert sock.recv(100) == b"" and time.monotonic() - started < 3, opening
        # After an answer: a blank line (no request begins) stopped uvicorn's keep-alive timer, and nothing
        # closed the connection any more; a request pipelined behind another had no time limit on its body.
        health = b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n"
        for first, then in ((health, b"\r\n"), (health + b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                                                   b"Content-Length: 1000\r\n\r\n{", b"")):
            with socket.create_connection(("127.0.0.1", server.port)) as sock:
                sock.settimeout(10)
                sock.sendall(first)
                assert sock.recv(65536).startswith(b"HTTP/1.1 200")
                sock.sendall(then)
                started = time.monotonic()
                while sock.recv(65536):
                    pass
                assert time.monotonic() - started < 3, first + then

        # Over the total request time: aborted, in the worker too.
        long = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True}
        assert_error(server.http.post("/v1/completions", json=long), 504, "timeout")
        server.wait_running(lambda n: n == 0, timeout=2)
        # Greedy: this model's greedy answer runs past 1500 tokens, where a sampled one may end sooner.
        message = {"model": MODEL_NAME, "max_tokens": 1500, "temperature": 0,
                   "messages": [{"role": "user", "content": "Hi"}]}
        timed_out = server.http.post("/v1/messages", json=message)  # in Anthropic's own shape: its timeout_error
        assert timed_out.status_code == 504 and timed_out.json()["error"]["type"] == "timeout_error"
        server.wait_running(lambda n: n == 0, timeout=2)

        # Total in flight: the second request is refused while the first runs.
        with httpx.stream("POST", server.url + "/v1/completions", json=dict(long, stream=True), timeout=30) as r:
            lines = r.iter_lines()
            events = [next(lines)]
            assert_error(server.http.post("/v1/chat/completions", json=CHAT), 503, "overloaded")
            # Anthropic's clients know "overloaded" by its 529 (the SDKs' OverloadedError).
            refused = server.http.post("/v1/messages", json=dict(message, max_tokens=1))
            assert refused.status_code == 529 and refused.json()["error"]["type"] == "overloaded_error"
            events += [line for line in lines if line.startswith("data: ")]
        assert '"code":"timeout"' in events[-2] and events[-1] == "data: [DONE]"
        server.wait_running(lambda n: n == 0, timeout=2)
    finally:
        server.stop()


def test_worker_socket_directory_is_private(tmp_path):
    run = tmp_path / "run"
    server = Server(["gateway", "--worker-endpoint", f"ipc://{run}/worker.sock"], tmp_path / "gateway.log")
    try:
        wait_for(server.answers, 30, "the gateway")
        assert stat.S_IMODE(os.lstat(run).st_mode) == 0o700
    finally:
        server.stop()


def test_pre_planted_symlink_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "run").symlink_to(target)
    result = subprocess.run(
        [*MLXD, "gateway", "--port", str(free_port()), "--worker-endpoint", f"ipc://{tmp_path}/run/worker.sock"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode != 0
    assert "refusing to put the worker socket there" in result.stderr and "symbolic link" in result.stderr
    assert not (target / "worker.sock").exists()


def test_tcp_endpoint_without_curve_is_refused(tmp_path):
    result = subprocess.run(
        [*MLXD, "gateway", "--port", str(free_port()), "--worker-endpoint", f"tcp://127.0.0.1:{free_port()}"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode != 0
    assert "--curve-secret-key" in result.stderr


class CurveGateway:
    """A gateway on a tcp:// endpoint with CURVE, and workers with key pairs of their own."""

    def __init__(self, tmp_path, model, allowed_names: list[str], names: list[str], *gateway_args: str) -> None:
        self.keys, self.tmp_path, self.model = tmp_path / "keys", tmp_path, model
        allowed = tmp_path / "allowed"
        allowed.mkdir()
        for name in ("gateway", *names):
            subprocess.run([*MLXD, "keys", "generate", str(self.keys), "--name", name], check=True,
                           capture_output=True)
        for name in allowed_names:
            (allowed / f"{name}.key").write_bytes((self.keys / f"{name}.key").read_bytes())
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.gateway = Server(["gateway", "--worker-endpoint", self.endpoint, "--served-model-name", MODEL_NAME,
                               "--curve-secret-key", str(self.keys / "gateway.key_secret"),
                               "--curve-authorized-keys", str(allowed), *gateway_args], tmp_path / "gateway.log")
        self.workers: list[subprocess.Popen] = []

    def worker(self, name: str) -> subprocess.Popen:
        self.workers.append(subprocess.Popen(
            [*MLXD, "worker", "--model", str(self.model), "--worker-endpoint", self.endpoint, "--heartbeat-s", "0.1",
             "--curve-secret-key", str(self.keys / f"{name}.key_secret"),
             "--curve-server-key", str(self.keys / "gateway.key")],
            cwd=ROOT, stdout=open(self.tmp_path / f"{name}.log", "wb"), stderr=subprocess.STDOUT,
        ))
        return self.workers[-1]

    def close(self) -> None:
        for worker in self.workers:
            stop_process(worker)
        self.gateway.stop()


def test_curve_admits_listed_workers_only(tiny_model, tmp_path, reference):
    curve = CurveGateway(tmp_path, tiny_model, ["good"], ["good", "rogue"])
    try:
        curve.worker("rogue")
        wait_for(lambda: "not authorized" in curve.gateway.log_path.read_text(), 30, "the rogue worker to be refused")
        assert curve.gateway.health()["worker"]["ready"] is False
        good = curve.worker("good")
        curve.gateway.wait_ready()
        assert curve.gateway.health()["worker"]["pid"] == good.pid
        expected = reference.greedy(reference.text_prompt("Once upon a time"), 8).text
        response = curve.gateway.http.post("/v1/completions", json={
            "model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
        assert response.json()["choices"][0]["text"] == expected
    finally:
        curve.close()


def test_a_tcp_replica_takes_over_a_lost_workers_stream(tiny_model, tmp_path, reference):
    """A second worker over tcp + CURVE (as from another Mac) joins as a replica;
    when the first is killed mid-stream, the stream goes on there, unchanged.
    (Over tcp a dropped connection may be a blip: the worker is given up on
    after --hung-worker-s, then its streams move.)"""
    curve = CurveGateway(tmp_path, tiny_model, ["one", "two"], ["one", "two"], "--hung-worker-s", "1")
    try:
        one = curve.worker("one")
        curve.gateway.wait_ready()
        two = curve.worker("two")
        wait_for(lambda: [w["ready"] for w in curve.gateway.health()["workers"]] == [True, True], 60,
                 "the replica to join")
        reader = StreamReader(curve.gateway.url)
        reader.start()
        reader.wait_for_pieces(20)
        one.kill()
        reader.join(120)
        assert reader.failure is None and reader.errors == [] and reader.done
        assert reader.text == reference.greedy(reference.text_prompt(reader.body["prompt"]), reader.body["max_tokens"],
                                               ignore_eos=True).text
        assert [w["pid"] for w in curve.gateway.health()["workers"]] == [two.pid]
    finally:
        curve.close()


def test_request_model_never_loads_anything(server):
    pid = server.health()["worker"]["pid"]
    for name in ("/etc", "../../etc/passwd", "mlx-community/some-model", "~/.ssh/id_rsa"):
        assert_error(server.http.post("/v1/chat/completions", json=dict(CHAT, model=name)), 404, "model_not_found")
    assert server.health()["worker"]["pid"] == pid
    assert server.health()["worker"]["model"] != "/etc"


@pytest.mark.parametrize("log_prompts", [False, True])
def test_logs_hold_no_prompts_or_keys_unless_asked(tiny_model, tmp_path, log_prompts):
    args = ["--api-key", "the-secret-key-walrus", "--log-level", "debug"] + (["--log-prompts"] if log_prompts else [])
    server = Server(["serve", "--model", str(tiny_model), "--served-model-name", MODEL_NAME, *args],
                    tmp_path / "serve.log")
    try:
        wait_for(lambda: server.answers() and server.http.get("/ready").status_code == 200, 60, "the server")
        headers = {"Authorization": "Bearer the-secret-key-walrus"}
        body = dict(CHAT, messages=[{"role": "user", "content": SECRET_PROMPT}])
        assert server.http.post("/v1/chat/completions", json=body, headers=headers).status_code == 200
        assert server.http.post("/v1/chat/completions", json=dict(body, bad=1), headers=headers).status_code == 400
        assert server.http.get("/v1/models", headers={"x-api-key": "wrong-key-narwhal"}).status_code == 401
        # Without an admin key every API key reads the ops page's log tail: never another client's prompts.
        tail = server.http.get("/admin/state", headers=headers).json()["log"]
        assert tail and SECRET_PROMPT not in str(tail)
    finally:
        server.stop()
    log = server.log_path.read_text()
    assert "the-secret-key-walrus" not in log and "wrong-key-narwhal" not in log
    assert (SECRET_PROMPT in log) == log_prompts


def test_anthropic_routes_take_x_api_key_and_answer_in_anthropic_shape(keyed):
    body = {"model": MODEL_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    refused = keyed.http.post("/v1/messages", json=body, headers={"x-api-key": "wrong"})
    assert refused.status_code == 401
    assert refused.json() == {"type": "error", "error": {"type": "authentication_error", "message": refused.json()["error"]["message"]}}
    assert keyed.http.post("/v1/messages", json=body, headers={"x-api-key": "flag-key-1"}).status_code == 200


def test_without_keys_a_client_is_its_address_whatever_x_forwarded_for_says(server):
    """Who may read a stored response (or cancel a request, or hold the per-client limit) is, without
    keys, the connection's address: a header sent from loopback must not pick another."""
    stored = server.http.post("/v1/responses", json={"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 2},
                              headers={"X-Forwarded-For": "10.0.0.7"})
    assert stored.status_code == 200
    path = f"/v1/responses/{stored.json()['id']}"
    assert server.http.get(path).status_code == 200
    assert server.http.get(path, headers={"X-Forwarded-For": "10.0.0.8"}).status_code == 200


def test_without_keys_a_page_elsewhere_cannot_act_through_a_browser(server):
    """A form posted from another origin needs no preflight: it would generate, or unload models via keep_alive."""
    body = json.dumps({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1})
    for headers in ({"Origin": "https://evil.example"}, {"Sec-Fetch-Site": "cross-site"}):
        for path in ("/v1/completions", "/api/generate"):
            response = server.http.post(path, content=body, headers={**headers, "content-type": "text/plain"})
            assert response.status_code == 403, path
            error = response.json()["error"]  # each API's own shape: Ollama's is the message
            assert "a client that is not a browser" in (error if isinstance(error, str) else error["message"])
    assert server.http.post("/v1/completions", content=body).status_code == 200  # curl, SDKs: no such headers
    same_origin = {"Origin": server.url, "Sec-Fetch-Site": "same-origin"}
    assert server.http.post("/v1/completions", content=body, headers=same_origin).status_code == 200
    # A local app's page acts, as with Ollama; never on /admin/*, the operator's.
    local_app = {"Origin": "app://obsidian.md", "Sec-Fetch-Site": "cross-site"}
    answer = server.http.post("/api/generate", content=body, headers=local_app)
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "app://obsidian.md"
    assert server.http.post(f"/admin/models/{MODEL_NAME}/pin", headers=local_app).status_code == 403


def test_with_admin_keys_no_api_key_unloads_or_pins_through_keep_alive(tiny_model, tmp_path):
    """keep_alive 0 unloads a model and a negative one keeps it loaded for good: an operator's acts,
    which --admin-key keeps to its holders (on /admin/*), through every API's keep_alive too. An
    API key's longer keep_alive (clients send one with every request) is taken as the server's."""
    server = serve(tiny_model, tmp_path, "--api-key", "user-key", "--admin-key", "admin-key")
    user, admin = {"Authorization": "Bearer user-key"}, {"Authorization": "Bearer admin-key"}
    try:
        unload = {"model": MODEL_NAME, "keep_alive": 0}
        refused = server.http.post("/api/generate", json=unload, headers=user)
        assert refused.status_code == 403 and "admin key" in refused.json()["error"]
        forever = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1, "keep_alive": -1}
        for keep_alive in (-1, "100000h", 1800):
            assert server.http.post("/v1/completions", json=dict(forever, keep_alive=keep_alive),
                                    headers=user).status_code == 200
            (loaded,) = server.http.get("/api/ps", headers=user).json()["models"]
            expires = datetime.fromisoformat(loaded["expires_at"].replace("Z", "+00:00"))
            assert expires < datetime.now(timezone.utc) + timedelta(minutes=6), keep_alive  # the server's 5m
        # A millisecond would unload it as soon as 0 does: it is kept for the server's keep-alive instead.
        assert server.http.post("/api/generate", json=dict(forever, keep_alive="1ms"), headers=user).status_code == 200
        time.sleep(0.6)  # past the pool's idle check (every 0.25 s)
        assert [m["name"] for m in server.http.get("/api/ps", headers=user).json()["models"]] == [MODEL_NAME + ":latest"]
        assert server.http.post(f"/admin/models/{MODEL_NAME}/unload", headers=admin).status_code == 200
    finally:
        server.stop()
