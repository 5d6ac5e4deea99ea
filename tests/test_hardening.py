"""What a new operator hit (issue 13): keys on reload, resumes across models,
stopping, start-up failures, a second gateway, /metrics, the small things."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.conftest import MLXD, MODEL_NAME, ROOT, Server, free_port, wait_for
from tests.test_restarts import PROMPT, StreamReader, split  # noqa: F401 (split is a fixture)
from tests.tiny_model import make_tiny_model


def mlxd(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*MLXD, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def log_count(server: Server, text: str) -> int:
    return server.log_path.read_text().count(text)


# ---- 1 and 7: keys on reload, /metrics ------------------------------------------


@pytest.fixture(scope="module")
def lan(tiny_model, tmp_path_factory):
    """Listening beyond loopback, keys from a file, and a metrics-only key."""
    tmp = tmp_path_factory.mktemp("lan")
    key_file = tmp / "keys.txt"
    key_file.write_text("key-a\n")
    server = Server(["serve", "--model", str(tiny_model), "--served-model-name", MODEL_NAME, "--host", "0.0.0.0",
                     "--api-key-file", str(key_file), "--metrics-key", "scrape-only"], tmp / "serve.log")
    server.key_file = key_file
    server.wait_ready()
    yield server
    server.stop()


def reload_keys(server: Server, text: str, refused: bool) -> None:
    before = log_count(server, "could not reload the API keys")
    loaded = log_count(server, "API keys loaded")
    server.key_file.write_text(text)
    os.kill(server.proc.pid, signal.SIGHUP)
    if refused:
        wait_for(lambda: log_count(server, "could not reload the API keys") > before, 10, "the refused reload")
    else:
        wait_for(lambda: log_count(server, "API keys loaded") > loaded, 10, "the reload")


@pytest.mark.parametrize("emptied", ["", "# only a comment\n\n"])
def test_a_reload_never_opens_a_lan_bind(lan, emptied):
    reload_keys(lan, emptied, refused=True)
    assert "holds no key" in lan.log_path.read_text()
    assert lan.http.get("/v1/models").status_code == 401
    assert lan.http.get("/v1/models", headers={"Host": "evil.example"}).status_code == 401
    assert lan.http.get("/v1/models", headers={"x-api-key": "key-a"}).status_code == 200
    assert lan.http.get("/health").json() == {"status": "ok", "worker": {"ready": True}}
    # A file with a key is still taken.
    reload_keys(lan, "key-b\n", refused=False)
    assert lan.http.get("/v1/models", headers={"x-api-key": "key-b"}).status_code == 200
    assert lan.http.get("/v1/models", headers={"x-api-key": "key-a"}).status_code == 401
    reload_keys(lan, "key-a\n", refused=False)


def test_metrics_need_a_key(lan):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = lan.http.get("/metrics", headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    for key in ("key-a", "scrape-only"):
        response = lan.http.get("/metrics", headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 200 and "mlxd_worker_ready 1" in response.text
    # The scrape key opens /metrics only.
    assert lan.http.get("/v1/models", headers={"Authorization": "Bearer scrape-only"}).status_code == 401
    assert "pid" not in lan.http.get("/health", headers={"Authorization": "Bearer scrape-only"}).json()["worker"]


# ---- 2: resume only on the same weights ------------------------------------------


@pytest.fixture(scope="module")
def sibling_model(tmp_path_factory) -> Path:
    """The tiny model's architecture and tokenizer, other weights: a fine-tune, as far as mlxd can tell."""
    return make_tiny_model(tmp_path_factory.mktemp("models") / "sibling", seed=7)


def test_a_stream_does_not_resume_on_other_weights(split, tiny_model, sibling_model):  # noqa: F811
    assert (tiny_model / "tokenizer.json").read_bytes() == (sibling_model / "tokenizer.json").read_bytes()
    s = split("--worker-timeout-s", "1")
    first = s.start_worker("--drain-s", "0.2")
    s.gateway.wait_ready()
    reader = StreamReader(s.gateway.url)
    reader.start()
    reader.wait_for_pieces(20)
    os.kill(first.pid, signal.SIGTERM)
    assert first.wait(10) == 0
    pieces = len(reader.pieces)
    s.start_worker("--model", str(sibling_model))
    reader.join(60)
    assert reader.failure is None and reader.done
    assert len(reader.pieces) == pieces  # nothing generated by the other weights reached the client
    assert len(reader.errors) == 1 and "other weights" in reader.errors[0]["message"]
    health = s.gateway.health()["worker"]
    assert health["requests_resumed"] == 0 and health["requests_failed_by_loss"] == 1
    assert (s.tmp_path / "worker0.log").read_text().count("welcomed by the gateway") == 1


# ---- 3 and 4: stopping -------------------------------------------------------------


def runtime_dir(server: Server) -> Path:
    found = re.search(r"waiting for a worker on ipc://(\S+)/worker\.sock", server.log_path.read_text())
    assert found, server.log_path.read_text()
    return Path(found.group(1))


@pytest.fixture()
def grouped(tiny_model, tmp_path):
    """`mlxd serve` in a process group of its own, as in a terminal."""
    server = Server(["serve", "--model", str(tiny_model), "--served-model-name", MODEL_NAME, "--drain-s", "2"],
                    tmp_path / "serve.log", new_session=True)
    server.wait_ready()
    yield server
    server.stop()


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_with_a_stream_running(grouped, presses):
    reader = StreamReader(grouped.url, max_tokens=1800)
    reader.start()
    reader.wait_for_pieces(10)
    directory = runtime_dir(grouped)
    started = time.monotonic()
    os.killpg(grouped.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
    if presses == 2:
        time.sleep(0.3)
        os.killpg(grouped.proc.pid, signal.SIGINT)
    assert grouped.proc.wait(30) == 0
    took = time.monotonic() - started
    reader.join(10)
    log = grouped.log_path.read_text()
    assert "Traceback" not in log and "restarting" not in log and "started worker" in log
    assert log.count("started worker") == 1
    assert reader.failure is None and reader.done  # the stream ended cleanly either way
    assert reader.errors == [] or "shutting down" in reader.errors[0]["message"]
    assert not directory.exists()
    assert took < (2.5 if presses == 2 else 2 + 4)  # the second press does not wait out --drain-s


def test_sigterm_after_a_clean_drain_exits_0(grouped):
    directory = runtime_dir(grouped)
    worker_pid = grouped.health()["worker"]["pid"]
    os.kill(grouped.proc.pid, signal.SIGTERM)
    assert grouped.proc.wait(30) == 0
    assert "Traceback" not in grouped.log_path.read_text()
    assert not directory.exists()
    wait_for(lambda: not alive(worker_pid), 10, "the worker to be gone")


# ---- 5: a model that cannot load ---------------------------------------------------


def test_serve_fails_when_the_model_cannot_load(tmp_path):
    started = time.monotonic()
    result = mlxd("serve", "--model", str(tmp_path / "nope"), "--port", str(free_port()), timeout=60)
    assert result.returncode == 1
    assert time.monotonic() - started < 30  # not one 30 s crash-loop retry
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("mlxd: error: cannot load the model:") and "no such file or directory" in last
    assert "restarting" not in result.stderr and "Traceback" not in result.stderr


def test_the_load_failure_reaches_health_and_the_503(split, tmp_path):  # noqa: F811
    s = split()
    assert s.gateway.answers() or wait_for(s.gateway.answers, 30, "the gateway")
    bad = s.start_worker("--model", str(tmp_path / "nope"))
    assert bad.wait(60) == 3  # EXIT_LOAD_FAILED
    wait_for(lambda: "load_error" in s.gateway.health()["worker"], 10, "the load error in /health")
    assert "no such file or directory" in s.gateway.health()["worker"]["load_error"]
    started = time.monotonic()
    response = s.gateway.http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
    assert response.status_code == 503 and response.headers["retry-after"]
    assert "cannot load its model" in response.json()["error"]["message"]
    assert time.monotonic() - started < 5  # at once, not after --worker-wait-s
    s.start_worker()
    s.gateway.wait_ready()
    assert "load_error" not in s.gateway.health()["worker"]


# ---- 6: one gateway per endpoint ---------------------------------------------------


def test_a_second_gateway_on_the_same_endpoint_is_refused(split):  # noqa: F811
    s = split()
    wait_for(s.gateway.answers, 30, "the first gateway")
    second = mlxd("gateway", "--worker-endpoint", s.endpoint, "--port", str(free_port()), timeout=60)
    assert second.returncode != 0
    assert "another gateway is already listening on" in second.stderr and "Traceback" not in second.stderr
    s.start_worker()
    s.gateway.wait_ready()  # the first one still gets its worker


# ---- 10: the smaller things --------------------------------------------------------


def test_models_answer_without_a_worker(tiny_model, tmp_path):
    """From the configuration, at once: no worker needed (it used to wait --worker-wait-s)."""
    endpoint = f"ipc://{tmp_path}/run/worker.sock"
    named = Server(["gateway", "--worker-endpoint", endpoint, "--served-model-name", MODEL_NAME,
                    "--worker-wait-s", "5"], tmp_path / "named.log")
    unnamed = Server(["gateway", "--worker-endpoint", f"ipc://{tmp_path}/run2/worker.sock", "--worker-wait-s", "5"],
                     tmp_path / "unnamed.log")
    served = Server(["serve", "--model", str(tiny_model), "--worker-wait-s", "5"], tmp_path / "serve.log")
    try:
        for server, names in ((named, [MODEL_NAME]), (unnamed, []), (served, [str(tiny_model)])):
            wait_for(server.answers, 30, "the gateway")
            started = time.monotonic()
            response = server.http.get("/v1/models")
            assert time.monotonic() - started < 2
            assert response.status_code == 200 and [m["id"] for m in response.json()["data"]] == names
    finally:
        for server in (named, unnamed, served):
            server.stop()


def test_a_killed_worker_is_seen_at_once(split):  # noqa: F811
    s = split()  # --worker-timeout-s at its default, 5 s
    worker = s.start_worker()
    s.gateway.wait_ready()
    os.kill(worker.pid, signal.SIGKILL)
    took = wait_for(lambda: s.gateway.http.get("/ready").status_code == 503, 5, "/ready to say 503")
    assert took < 1.0
    assert s.gateway.health()["worker"]["state"] == "absent"


def test_version():
    result = mlxd("--version")
    assert result.returncode == 0
    assert re.fullmatch(r"mlxd \S+ \(protocol \d+; mlx \S+, mlx-lm \S+, mlx-vlm \S+\)\n", result.stdout)


def test_serve_help_lists_no_worker_internal_flags():
    text = mlxd("serve", "--help").stdout
    assert "--model" in text and "--max-batch" in text and "--api-key" in text
    for internal in ("--parent-pid", "--worker-endpoint", "--curve-secret-key", "--curve-server-key"):
        assert internal not in text


def test_model_errors_say_what_is_accepted(tmp_path):
    served_name = mlxd("prepare-model", "--model", "SmolLM2-135M-Instruct")
    assert served_name.returncode == 1 and "leave --model out" in served_name.stderr
    (tmp_path / "empty").mkdir()
    no_config = mlxd("prepare-model", "--model", str(tmp_path / "empty"))
    assert no_config.returncode == 1 and "no config.json" in no_config.stderr
    assert "Hugging Face repo id" in no_config.stderr


class _Hub(BaseHTTPRequestHandler):
    status = 404

    def do_GET(self) -> None:
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "x"}')

    do_HEAD = do_GET

    def log_message(self, *args) -> None:
        pass


@pytest.mark.parametrize("status, says", [(404, "HTTP 404"), (401, "HTTP 401"), (None, "Connection refused")])
def test_a_download_failure_says_why(tmp_path, status, says):
    port = free_port()
    hub = None
    if status is not None:
        hub = ThreadingHTTPServer(("127.0.0.1", port), type("Hub", (_Hub,), {"status": status}))
        threading.Thread(target=hub.serve_forever, daemon=True).start()
    try:
        result = mlxd("prepare-model", "--model", "someone/some-model",
                      env={"HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HOME": str(tmp_path / "hf"),
                           "HF_HUB_OFFLINE": "0", "HF_HUB_ETAG_TIMEOUT": "5", "HF_HUB_DOWNLOAD_TIMEOUT": "5"})
    finally:
        if hub is not None:
            hub.shutdown()
    assert result.returncode == 1 and says in result.stderr, result.stderr


@pytest.mark.parametrize("target, wants_test_tools", [("run", False), ("test", True)])
def test_make_run_installs_no_test_tools_and_shows_progress(tmp_path, target, wants_test_tools):
    if shutil.which("make") is None:
        pytest.skip("no make")
    plan = subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60).stdout
    installs = [line for line in plan.splitlines() if "pip install" in line]
    assert installs and not any("--quiet" in line for line in installs)
    assert any("[test]" in line for line in installs) == wants_test_tools


# ---- 9: the model's sampling defaults ------------------------------------------------


@pytest.fixture(scope="module")
def recommending_model(tmp_path_factory) -> Path:
    """A tiny model with flat logits (sampling at temperature 1 wanders) that recommends greedy decoding."""
    path = make_tiny_model(tmp_path_factory.mktemp("models") / "recommending", logit_scale=1.0)
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_p": 5, "do_sample": True}))
    return path


def test_requests_that_leave_sampling_out_get_the_models_defaults(recommending_model, tmp_path):
    from tests.reference import Reference

    messages = [{"role": "user", "content": "Tell me a story"}]
    reference = Reference(recommending_model)
    expected = reference.greedy(reference.chat_prompt(messages), 24)
    server = Server(["serve", "--model", str(recommending_model), "--served-model-name", MODEL_NAME],
                    tmp_path / "serve.log")
    try:
        server.wait_ready()
        defaults = server.health()["worker"]["sampling_defaults"]
        assert defaults == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
        assert "ignored top_p=5" in server.log_path.read_text()
        chat = {"model": MODEL_NAME, "messages": messages, "max_tokens": 24, "seed": 3}
        silent = server.http.post("/v1/chat/completions", json=chat).json()
        assert silent["choices"][0]["message"]["content"] == expected.text
        anthropic = server.http.post("/v1/messages", json={"model": MODEL_NAME, "messages": messages,
                                                           "max_tokens": 24}).json()
        assert anthropic["content"][0]["text"] == expected.text
        # A request's own temperature still decides.
        hot = server.http.post("/v1/chat/completions", json={**chat, "temperature": 1.0}).json()
        assert hot["choices"][0]["message"]["content"] != expected.text
    finally:
        server.stop()
