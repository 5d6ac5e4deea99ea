"""Several models behind one gateway: `mlxd serve --model NAME=SOURCE` repeated,
each model in a worker of its own, each request routed by its model's name."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time

import httpx
import pytest

from tests.conftest import MLXD, ROOT, Server, free_port, running, wait_for
from tests.reference import Reference
from tests.test_metrics import scrape
from tests.test_restarts import StreamReader
from tests.tiny_model import make_tiny_model

NAMES = ["alpha", "beta", "gamma"]
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("pool")
    # Different seeds: different weights, so each model's greedy text is its own.
    return {name: make_tiny_model(root / name, seed=seed) for seed, name in enumerate(NAMES, start=1)}


@pytest.fixture(scope="module")
def pool(models):
    args = ["serve", "--heartbeat-s", "0.1"]
    for name, path in models.items():
        args += ["--model", f"{name}={path}"]
    with running(args, next(iter(models.values())).parent / "serve.log") as server:
        wait_for(lambda: len([w for w in server.health()["workers"] if w["ready"]]) == len(NAMES), 60,
                 "every model's worker")
        yield server


def complete(server, model: str, max_tokens: int = 8) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    return server.http.post("/v1/completions", json=body).json()


def test_each_name_reaches_its_own_model(pool, models):
    texts = {}
    for name, path in models.items():
        expected = Reference(path).greedy(Reference(path).text_prompt(PROMPT), 8)
        answer = complete(pool, name)
        assert answer["model"] == name and answer["choices"][0]["text"] == expected.text
        texts[name] = expected.text
    assert len(set(texts.values())) == len(NAMES)  # the models differ, so the routing is seen
    listed = pool.http.get("/v1/models").json()["data"]
    assert [(m["id"], m["status"]) for m in listed] == [(name, "loaded") for name in NAMES]
    assert sorted(w["model"] for w in pool.health()["workers"]) == NAMES


def test_an_unknown_model_is_a_404_naming_the_served_ones(pool):
    response = pool.http.post("/v1/completions", json={"model": "delta", "prompt": PROMPT, "max_tokens": 2})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and all(name in error["message"] for name in NAMES)


def test_killing_one_models_worker_leaves_another_models_stream_alone(pool, models):
    reader = StreamReader(pool.url)
    reader.body["model"] = "beta"
    reader.start()
    reader.wait_for_pieces(20)
    alpha = next(w["pid"] for w in pool.health()["workers"] if w["model"] == "alpha")
    os.kill(alpha, signal.SIGKILL)
    reader.join(120)
    assert reader.failure is None and reader.errors == [] and reader.done
    beta = Reference(models["beta"])
    assert reader.text == beta.greedy(beta.text_prompt(reader.body["prompt"]), reader.body["max_tokens"],
                                      ignore_eos=True).text
    assert pool.health()["worker"]["requests_resumed"] == 0  # beta's stream never moved
    # alpha's supervisor starts it again, and it answers as before.
    wait_for(lambda: any(w["model"] == "alpha" and w["ready"] and w["pid"] != alpha
                         for w in pool.health()["workers"]), 60, "alpha's new worker")
    alpha_ref = Reference(models["alpha"])
    assert complete(pool, "alpha")["choices"][0]["text"] == alpha_ref.greedy(alpha_ref.text_prompt(PROMPT), 8).text


def test_mlxd_ps_lists_each_models_worker(pool):
    result = subprocess.run([*MLXD, "ps", "--url", pool.url], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    header, *rows = result.stdout.splitlines()
    assert header.split()[:3] == ["MODEL", "PID", "STATE"]
    workers = {w["model"]: w["pid"] for w in pool.health()["workers"]}
    assert sorted((row.split()[0], int(row.split()[1]), row.split()[2]) for row in rows) == [
        (name, workers[name], "ready") for name in NAMES]


def test_metrics_describe_every_models_worker(pool):
    """Each worker's own numbers, labelled with its model: not the oldest worker's alone."""
    complete(pool, "gamma")
    gamma = next(w["pid"] for w in pool.health()["workers"] if w["model"] == "gamma")
    lookups = f'mlxd_prefix_cache_lookups_total{{model="gamma",pid="{gamma}"}} '
    wait_for(lambda: any(line.startswith(lookups) and float(line.split()[-1]) >= 1
                         for line in pool.http.get("/metrics").text.splitlines()), 10, "gamma's look-up in /metrics")
    text = pool.http.get("/metrics").text
    health = pool.health()
    for w in health["workers"]:
        assert f'mlxd_worker_up{{model="{w["model"]}",pid="{w["pid"]}"}} {int(w["ready"])}\n' in text
    assert f"mlxd_worker_restarts_total {sum(s['restarts'] for s in health['supervisors'])}\n" in text


def test_serve_ends_when_one_of_its_models_cannot_load(models, tmp_path):
    """With --preload, a model that cannot load at start ends `mlxd serve`, whichever worker reports first."""
    result = subprocess.run([*MLXD, "serve", "--preload", "--model", f"alpha={models['alpha']}", "--model",
                             f"broken={tmp_path / 'nope'}", "--port", str(free_port())],
                            capture_output=True, text=True, timeout=90, cwd=ROOT)
    assert result.returncode == 1, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("mlxd: error: cannot load the model:") and "nope" in last, last


def test_a_frozen_models_worker_makes_the_server_not_ready_until_it_answers_again(pool):
    """Its requests would wait and fail with a 503: a load balancer should send them elsewhere meanwhile."""
    assert pool.http.get("/ready").status_code == 200
    gamma = next(w["pid"] for w in pool.health()["workers"] if w["model"] == "gamma")
    os.kill(gamma, signal.SIGSTOP)
    answers: list[dict] = []
    try:
        wait_for(lambda: pool.http.get("/ready").status_code == 503, 15, "/ready to see gamma's worker frozen")
        assert pool.http.get("/ready").json() == {"ready": False, "models": ["gamma"]}  # which one, not why not
        # A request for gamma waits for a ready worker: the ops page counts it as waiting.
        asking = threading.Thread(target=lambda: answers.append(complete(pool, "gamma")), daemon=True)
        asking.start()
        wait_for(lambda: pool.http.get("/admin/state").json()["server"]["requests_waiting_to_start"] == 1, 10,
                 "the ops page to count the request waiting")
    finally:
        os.kill(gamma, signal.SIGCONT)
    wait_for(lambda: pool.http.get("/ready").status_code == 200, 15, "/ready once gamma's worker answers")
    asking.join(30)
    assert answers and answers[0]["choices"]


def test_a_flag_at_its_default_wins_over_an_inherited_variable(models, tmp_path):
    """Flags win over variables: the worker `mlxd serve` starts gets its settings as flags, and must not
    read a variable for one left out because it is at its default."""
    with running(["serve", "--model", f"alpha={models['alpha']}", "--max-batch", "32"], tmp_path / "serve.log",
                 env={"MLXD_MAX_BATCH": "2"}) as server:
        wait_for(lambda: server.health()["worker"].get("ready"), 60, "the worker")
        assert server.health()["worker"]["capacity"] == 32


# ---- the pool: models load when asked for, unload when idle or to make room ----

LAZY = {"MLXD_PRELOAD": "false"}


class Watcher(threading.Thread):
    """Polls /health until stopped: the most workers ever connected at once."""

    def __init__(self, server) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.most = 0
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            self.most = max(self.most, len(self.server.health()["workers"]))
            time.sleep(0.02)

    def stop(self) -> int:
        self.stopped.set()
        self.join()
        return self.most


def statuses(server) -> dict[str, str]:
    return {m["id"]: m["status"] for m in server.http.get("/v1/models").json()["data"]}


@pytest.fixture(scope="module")
def lazy_pool(models):
    args = ["serve", "--heartbeat-s", "0.1", "--max-loaded-models", "2", "--keep-alive", "10m"]
    for name, path in models.items():
        args += ["--model", f"{name}={path}"]
    srv = Server(args, next(iter(models.values())).parent / "lazy.log", env=LAZY)
    try:
        wait_for(srv.answers, 60, "the gateway")
        yield srv
    finally:
        srv.stop()


def test_preloaded_models_make_room_for_pinned_ones_and_unload_when_unasked(models, tmp_path):
    """--preload (the tests' default) loads the pinned model first, whatever the order of --model,
    and the others in the room left; one nobody asks for unloads after its keep-alive."""
    args = ["serve", "--heartbeat-s", "0.1", "--max-loaded-models", "2", "--keep-alive", "6s", "--pin", NAMES[-1]]
    for name, path in models.items():
        args += ["--model", f"{name}={path}"]
    with running(args, tmp_path / "serve.log") as srv:
        wait_for(lambda: statuses(srv) == {NAMES[0]: "loaded", NAMES[1]: "unloaded", NAMES[2]: "loaded"}, 6,
                 "the pinned model and the first one preloaded beside it")
        wait_for(lambda: statuses(srv) == {**dict.fromkeys(NAMES, "unloaded"), NAMES[-1]: "loaded"}, 30,
                 "the unasked model's keep-alive")


def test_models_load_on_first_request_and_at_most_two_stay_loaded(lazy_pool, models):
    assert lazy_pool.http.get("/ready").status_code == 200  # nothing has to load before requests come
    assert set(statuses(lazy_pool).values()) == {"unloaded"} and lazy_pool.health()["workers"] == []
    watcher = Watcher(lazy_pool)
    watcher.start()
    try:
        for name in [*NAMES, NAMES[0]]:
            ref = Reference(models[name])
            assert complete(lazy_pool, name)["choices"][0]["text"] == ref.greedy(ref.text_prompt(PROMPT), 8).text
            assert statuses(lazy_pool)[name] == "loaded"
    finally:
        most = watcher.stop()
    assert most <= 2
    # alpha was used last, gamma before it: beta, the least recently used, made room for alpha.
    assert statuses(lazy_pool) == {"alpha": "loaded", "beta": "unloaded", "gamma": "loaded"}
    pool = lazy_pool.health()["pool"]
    assert pool["max_loaded_models"] == 2 and pool["used"] == sum(
        m["memory"]["total"] for m in pool["models"].values() if "memory" in m)


def test_two_models_answer_concurrently_and_a_third_waits_for_room(lazy_pool, models):
    readers = []
    for name in ("alpha", "beta"):
        reader = StreamReader(lazy_pool.url, max_tokens=300)
        reader.body["model"] = name
        reader.start()
        readers.append(reader)
    watcher = Watcher(lazy_pool)
    watcher.start()
    try:
        for reader in readers:
            reader.wait_for_pieces(5, timeout=60)
        # Both models are busy: gamma cannot evict either, so it loads once one of them is done.
        ref = Reference(models["gamma"])
        assert complete(lazy_pool, "gamma")["choices"][0]["text"] == ref.greedy(ref.text_prompt(PROMPT), 8).text
        assert any(not r.is_alive() for r in readers)
        for reader in readers:
            reader.join(120)
    finally:
        most = watcher.stop()
    assert most <= 2
    for reader in readers:
        ref = Reference(models[reader.body["model"]])
        assert reader.failure is None and reader.errors == [] and reader.done
        assert reader.text == ref.greedy(ref.text_prompt(reader.body["prompt"]), 300, ignore_eos=True).text


def test_admin_unload_and_load(lazy_pool):
    loaded = lazy_pool.http.post("/admin/models/beta/load")
    assert loaded.status_code == 200 and loaded.json() == {"model": "beta", "status": "loaded"}
    assert statuses(lazy_pool)["beta"] == "loaded"
    pid = next(w["pid"] for w in lazy_pool.health()["workers"] if w["model"] == "beta")
    lost = lazy_pool.health()["worker"]["workers_lost"]
    unloaded = lazy_pool.http.post("/admin/models/beta/unload")
    assert unloaded.status_code == 200 and unloaded.json() == {"model": "beta", "status": "unloaded"}
    assert statuses(lazy_pool)["beta"] == "unloaded"
    assert all(w["model"] != "beta" for w in lazy_pool.health()["workers"])
    wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 10, "beta's worker to exit")
    # Stopped as asked: no loss counted, none shown on the ops page.
    assert lazy_pool.health()["worker"]["workers_lost"] == lost
    assert not [w for w in lazy_pool.http.get("/admin/state").json()["lost_workers"] if w["pid"] == pid]
    missing = lazy_pool.http.post("/admin/models/delta/load")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_an_unload_asked_while_a_stream_runs_shows_until_the_stream_ends(lazy_pool):
    reader = StreamReader(lazy_pool.url, max_tokens=200)
    reader.body["model"] = "alpha"
    reader.start()
    reader.wait_for_pieces(5)
    asked_before = lazy_pool.log_path.read_text().count("unloading alpha: unloaded by an admin request")
    asked = lazy_pool.http.post("/admin/models/alpha/unload")
    assert asked.status_code == 202 and asked.json()["status"] == "unloading"
    assert lazy_pool.health()["pool"]["models"]["alpha"]["unload_requested"] is True  # the ops page shows it
    reader.join(120)
    assert reader.done and not reader.errors
    wait_for(lambda: statuses(lazy_pool)["alpha"] == "unloaded", 30, "alpha to unload once its stream ended")
    assert lazy_pool.health()["pool"]["models"]["alpha"]["unload_requested"] is False
    # Not "idle past its keep-alive", in the log and the ops page's tail.
    assert lazy_pool.log_path.read_text().count("unloading alpha: unloaded by an admin request") == asked_before + 1


def test_keep_alive_zero_unloads_the_model_after_its_answer(lazy_pool, models):
    body = {"model": "beta", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "keep_alive": 0}
    answer = lazy_pool.http.post("/v1/completions", json=body).json()
    ref = Reference(models["beta"])
    assert answer["choices"][0]["text"] == ref.greedy(ref.text_prompt(PROMPT), 8).text
    wait_for(lambda: statuses(lazy_pool)["beta"] == "unloaded", 10, "beta to unload")
    # A duration as text keeps it for that long.
    body["keep_alive"] = "1m"
    assert lazy_pool.http.post("/v1/completions", json=body).status_code == 200
    time.sleep(1)
    assert statuses(lazy_pool)["beta"] == "loaded"
    assert lazy_pool.health()["pool"]["models"]["beta"]["unloads_in_s"] > 50
    # Past what a time can say (the year 9999): Ollama's "never", where it was a 500 on every /api/ps.
    body["keep_alive"] = 1e12
    assert lazy_pool.http.post("/v1/completions", json=body).status_code == 200
    ps = lazy_pool.http.get("/api/ps")
    assert ps.status_code == 200, ps.text
    assert [m["expires_at"] for m in ps.json()["models"] if m["name"] == "beta:latest"] == [
        "9999-12-31T23:59:59.999999Z"]
    # -1 keeps it for good, as pinning does: said so (`mlxd ps` and the ops page said "-", as for a busy model).
    body["keep_alive"] = -1
    assert lazy_pool.http.post("/v1/completions", json=body).status_code == 200
    beta = lazy_pool.health()["pool"]["models"]["beta"]
    assert beta["stays_loaded"] is True and beta["unloads_in_s"] is None
    body["keep_alive"] = "1m"
    assert lazy_pool.http.post("/v1/completions", json=body).status_code == 200
    assert lazy_pool.health()["pool"]["models"]["beta"]["stays_loaded"] is False


def test_an_unload_asked_while_an_admin_load_runs_stands(lazy_pool):
    """The load called off any unload asked before it once it was done, one asked while it loaded too."""
    assert lazy_pool.http.post("/admin/models/gamma/unload").status_code == 200
    wait_for(lambda: statuses(lazy_pool)["gamma"] == "unloaded", 30, "gamma to unload")
    loads: list = []
    loading = threading.Thread(target=lambda: loads.append(lazy_pool.http.post("/admin/models/gamma/load")))
    loading.start()
    wait_for(lambda: statuses(lazy_pool)["gamma"] == "loading", 10, "gamma to begin loading")
    asked = lazy_pool.http.post("/admin/models/gamma/unload")
    assert asked.status_code == 202 and asked.json()["status"] == "unloading"
    loading.join(60)
    assert loads[0].status_code == 200
    wait_for(lambda: statuses(lazy_pool)["gamma"] == "unloaded", 10, "gamma to unload once loaded")


def test_a_client_that_leaves_while_its_model_loads_has_nothing_run_for_it(lazy_pool):
    """It waited out the load and then ran for nobody: its prompt prefilled and its first tokens made,
    until a write found the connection gone. Its client is watched from the start now."""
    assert lazy_pool.http.post("/admin/models/gamma/unload").status_code == 200
    wait_for(lambda: statuses(lazy_pool)["gamma"] == "unloaded", 30, "gamma to unload")
    before = scrape(lazy_pool)["mlxd_prompt_tokens_total"]
    body = json.dumps({"model": "gamma", "prompt": PROMPT, "max_tokens": 8, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", lazy_pool.port)) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(lambda: statuses(lazy_pool)["gamma"] == "loading", 10, "gamma to begin loading")
    wait_for(lambda: statuses(lazy_pool)["gamma"] == "loaded", 60, "gamma to load")
    time.sleep(0.5)  # time enough to submit it, were it still to be submitted
    assert scrape(lazy_pool)["mlxd_prompt_tokens_total"] == before
    assert lazy_pool.health()["pool"]["models"]["gamma"]["memory"]["kv_reserved"] == 0


def test_a_drain_answers_a_request_waiting_for_its_model_at_once(models, tmp_path):
    """It waited for the load past the drain, for uvicorn's stop to cut it off with a 500."""
    srv = Server(["serve", "--model", f"alpha={models['alpha']}", "--drain-s", "5", "--worker-wait-s", "60"],
                 tmp_path / "serve.log", env=LAZY)
    worker = None
    try:
        wait_for(srv.answers, 60, "the gateway")
        answers: list = []
        body = {"model": "alpha", "prompt": PROMPT, "max_tokens": 2}
        asking = threading.Thread(target=lambda: answers.append(srv.http.post("/v1/completions", json=body)))
        asking.start()

        def loading() -> bool:
            nonlocal worker
            worker = srv.health()["supervisors"][0]["pid"]
            return worker is not None

        wait_for(loading, 10, "alpha's worker to start")
        os.kill(worker, signal.SIGSTOP)  # a load that would outlast the drain
        started = time.monotonic()
        os.kill(srv.proc.pid, signal.SIGTERM)
        asking.join(30)
        (answer,) = answers
        assert answer.status_code == 503 and int(answer.headers["retry-after"]) > 0, answer.text
        assert "shutting down" in answer.json()["error"]["message"]
        assert time.monotonic() - started < 3
    finally:
        if worker is not None:
            os.kill(worker, signal.SIGCONT)
        srv.stop()


def test_a_model_larger_than_the_budget_is_a_400(models, tmp_path):
    """It can never load: a 503 told clients (the SDKs retry it) to come back."""
    srv = Server(["serve", "--model", f"alpha={models['alpha']}", "--memory-budget", "100000"],
                 tmp_path / "serve.log", env=LAZY)
    try:
        wait_for(srv.answers, 60, "the gateway")
        for answer in (srv.http.post("/v1/completions", json={"model": "alpha", "prompt": PROMPT, "max_tokens": 2}),
                       srv.http.post("/admin/models/alpha/load")):
            assert answer.status_code == 400 and "retry-after" not in answer.headers, answer.text
            assert "more than the memory budget" in answer.json()["error"]["message"]
    finally:
        srv.stop()


def test_a_model_larger_loaded_than_on_disk_makes_room_once_measured(models, tmp_path):
    """A 4-bit model (dequantized here to float32) is charged its files' size until its worker measures it;
    then the pool was over its budget for good, its models sharing memory it did not have."""
    from mlx_lm import convert

    quantized = tmp_path / "q"
    convert(hf_path=str(models["gamma"]), mlx_path=str(quantized), quantize=True, q_bits=4)
    args = ["serve", "--heartbeat-s", "0.1", "--model", f"alpha={models['alpha']}", "--model", f"q={quantized}",
            "--memory-budget", "700000", "--prefix-cache-bytes", "0"]
    srv = Server(args, tmp_path / "serve.log", env=LAZY)
    try:
        wait_for(srv.answers, 60, "the gateway")
        assert "choices" in complete(srv, "alpha")
        assert srv.http.post("/admin/models/q/load").status_code == 200  # it fit as its files' 85 KB
        wait_for(lambda: srv.health()["pool"]["used"] <= 700_000, 10, "alpha, idle, to make room")
        assert statuses(srv) == {"alpha": "unloaded", "q": "loaded"}
        assert "over its memory budget" in srv.log_path.read_text()
    finally:
        srv.stop()


def test_two_models_of_the_same_weights_keep_to_their_own_workers(models, tmp_path):
    """Workers were picked by their weights alone: twin's ran alpha's requests, charged to alpha, so twin
    looked idle and could be unloaded under them."""
    args = ["serve", "--heartbeat-s", "0.1", "--model", f"alpha={models['alpha']}", "--model",
            f"twin={models['alpha']}"]
    with running(args, tmp_path / "serve.log") as srv:
        wait_for(lambda: len([w for w in srv.health()["workers"] if w["ready"]]) == 2, 60, "both workers")
        threads = [threading.Thread(target=complete, args=(srv, "alpha", 16)) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)

        def steps(name: str) -> int:
            return next(w["steps"] for w in srv.health()["workers"] if w["names"] == [name])

        wait_for(lambda: steps("alpha") > 0, 10, "alpha's worker's steps in its heartbeat")
        time.sleep(0.3)  # past another heartbeat of twin's
        assert steps("twin") == 0


def test_a_load_slower_than_the_wait_goes_on_when_its_request_gives_up(models, tmp_path):
    """keep_alive 0 and a load longer than --worker-wait-s: the request's 503 left the model idle, and it was
    stopped mid-load (each retry starting it over, a large model never served). It finishes loading now;
    the keep-alive counts from then."""
    srv = Server(["serve", "--model", f"alpha={models['alpha']}", "--worker-wait-s", "0.2"], tmp_path / "serve.log",
                 env=LAZY)
    try:
        wait_for(srv.answers, 60, "the gateway")
        body = {"model": "alpha", "prompt": PROMPT, "max_tokens": 4, "keep_alive": 0}
        assert srv.http.post("/v1/completions", json=body).status_code == 503
        wait_for(lambda: "worker ready" in srv.log_path.read_text(), 60, "alpha's worker to finish loading")
        wait_for(lambda: statuses(srv)["alpha"] == "unloaded", 10, "alpha to unload once ready (keep_alive 0)")
        assert "unloading alpha: idle past its keep-alive" in srv.log_path.read_text()
    finally:
        srv.stop()


@pytest.mark.parametrize("value", ["soon", "5 minutes", True, [1]])
def test_a_bad_keep_alive_is_a_400_in_each_api(lazy_pool, value):
    openai = lazy_pool.http.post("/v1/chat/completions", json={
        "model": "alpha", "messages": [{"role": "user", "content": "hi"}], "keep_alive": value})
    assert openai.status_code == 400 and openai.json()["error"]["param"] in ("keep_alive", "$.keep_alive", None)
    assert "keep_alive" in openai.json()["error"]["message"]
    anthropic = lazy_pool.http.post("/v1/messages", json={
        "model": "alpha", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "keep_alive": value})
    assert anthropic.status_code == 400 and anthropic.json()["type"] == "error"
    assert "keep_alive" in anthropic.json()["error"]["message"]


@pytest.fixture(scope="module")
def small_pool(models, tmp_path_factory):
    """alpha in a budget that holds its weights and 1,000 tokens of KV state (512 bytes each); a model
    that cannot load; requests that wait for a worker at most 0.3 s."""
    weights = 492_800
    args = ["serve", "--heartbeat-s", "0.1", "--model", f"alpha={models['alpha']}", "--model",
            f"broken={tmp_path_factory.mktemp('nope')}", "--prefix-cache-bytes", "0",
            "--memory-budget", str(weights + 1000 * 512), "--worker-wait-s", "0.3"]
    srv = Server(args, tmp_path_factory.mktemp("small") / "serve.log", env=LAZY)
    try:
        wait_for(srv.answers, 60, "the gateway")
        yield srv
    finally:
        srv.stop()


def test_a_request_for_a_loading_model_waits_then_gets_a_503_with_retry_after(small_pool):
    # alpha takes longer to load than --worker-wait-s (0.3 s): the request is told to come back.
    refused = small_pool.http.post("/v1/completions", json={"model": "alpha", "prompt": PROMPT, "max_tokens": 2})
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) > 0
    assert "within 0.3s" in refused.json()["error"]["message"]
    assert statuses(small_pool)["alpha"] in ("loading", "loaded")
    wait_for(lambda: statuses(small_pool)["alpha"] == "loaded", 60, "alpha to load")


def test_a_model_that_cannot_load_fails_its_own_requests_with_the_reason(small_pool):
    body = {"model": "broken", "prompt": PROMPT, "max_tokens": 2}
    assert small_pool.http.post("/v1/completions", json=body).status_code == 503  # waited 0.3 s for it
    wait_for(lambda: "load_error" in small_pool.health()["pool"]["models"]["broken"], 60, "broken's load to fail")
    refused = small_pool.http.post("/v1/completions", json=body)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_load_failed"
    assert "cannot load" in refused.json()["error"]["message"] and "nope" in refused.json()["error"]["message"]
    assert refused.json()["error"]["message"].count("cannot load") == 1  # was "cannot load: cannot load the model"
    assert statuses(small_pool)["broken"] == "unloaded"
    assert small_pool.proc.poll() is None


def test_a_budget_too_small_for_a_requests_reservation_is_a_400_before_the_200(small_pool, models):
    """However long it waited it would not fit: a 400, which clients do not retry (the SDKs retry a 503)."""
    wait_for(lambda: "choices" in complete(small_pool, "alpha"), 60, "alpha to load")
    assert small_pool.health()["pool"]["models"]["alpha"]["memory"]["weights"] == 492_800
    body = {"model": "alpha", "prompt": PROMPT, "max_tokens": 1200, "temperature": 0, "stream": True}
    prompt_tokens = scrape(small_pool)["mlxd_prompt_tokens_total"]
    with small_pool.http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 400 and "retry-after" not in response.headers
        error = json.loads(response.read())["error"]
    assert error["code"] == "memory_budget_exceeded" and "lower max_tokens" in error["message"]
    assert scrape(small_pool)["mlxd_prompt_tokens_total"] == prompt_tokens  # its prompt never ran
    # Nothing crashed, and a request that fits is answered.
    ref = Reference(models["alpha"])
    assert complete(small_pool, "alpha")["choices"][0]["text"] == ref.greedy(ref.text_prompt(PROMPT), 8).text
    assert small_pool.health()["pool"]["models"]["alpha"]["memory"]["kv_reserved"] == 0


def test_a_request_that_does_not_fit_beside_a_running_one_waits_for_it(models, tmp_path):
    """The budget holds 2,000 tokens of KV state: a stream of 1,500 tokens holds 1,536 of them (a
    256-token step); a second request would make the batch two rows of 1,536. It waits (it was a 503
    at once), shows in /health and /metrics while it does, and is answered once the stream ends.
    An embedding that does not fit either, whose client leaves while it waits, leaves the line then."""
    args = ["serve", "--heartbeat-s", "0.1", "--model", f"alpha={models['alpha']}", "--prefix-cache-bytes", "0",
            "--memory-budget", str(492_800 + 2000 * 512)]
    with running(args, tmp_path / "serve.log") as srv:
        stream = StreamReader(srv.url, max_tokens=1500)
        stream.body["model"] = "alpha"
        stream.start()
        stream.wait_for_pieces(3, timeout=60)
        with pytest.raises(httpx.TimeoutException):  # the client gives up while the embedding waits
            httpx.post(srv.url + "/v1/embeddings", json={"model": "alpha", "input": [[5] * 1600]}, timeout=0.5)
        wait_for(lambda: srv.health()["pool"]["models"]["alpha"]["waiting_for_memory"] == 0, 10, "it to leave")
        assert not stream.done  # it left as its client did, not once the stream made room
        answered: list = []

        def second() -> None:
            body = {"model": "alpha", "prompt": PROMPT, "max_tokens": 100, "temperature": 0}
            answered.append(srv.http.post("/v1/completions", json=body, timeout=60))
            answered.append(time.monotonic())

        waiting = threading.Thread(target=second, daemon=True)
        waiting.start()
        wait_for(lambda: srv.health()["pool"]["models"]["alpha"]["waiting_for_memory"] == 1, 10, "it to wait")
        assert scrape(srv)['mlxd_requests_waiting_for_memory{model="alpha"}'] == 1
        stream.join(120)
        waiting.join(60)
        assert stream.failure is None and stream.done and len(answered) == 2
        response, at = answered
        assert response.status_code == 200, response.text
        assert at > stream.times[-1]
        ref = Reference(models["alpha"])
        assert response.json()["choices"][0]["text"] == ref.greedy(ref.text_prompt(PROMPT), 100).text
        assert srv.health()["pool"]["models"]["alpha"]["waiting_for_memory"] == 0


def test_embeddings_reserve_their_largest_input_not_their_sum(small_pool, models):
    """The worker embeds the inputs one after another: three of 400 tokens fit a
    budget of 1,000 tokens of KV state; one of 1,200 does not."""
    wait_for(lambda: "choices" in complete(small_pool, "alpha"), 60, "alpha to load")
    three = small_pool.http.post("/v1/embeddings", json={"model": "alpha", "input": [[5] * 400] * 3})
    assert three.status_code == 200 and len(three.json()["data"]) == 3
    one = small_pool.http.post("/v1/embeddings", json={"model": "alpha", "input": [[5] * 1200]})
    assert one.status_code == 400 and one.json()["error"]["code"] == "memory_budget_exceeded"
    assert "shorten its inputs" in one.json()["error"]["message"] and "max_tokens" not in one.json()["error"]["message"]


def test_a_pinned_model_loads_at_start_and_stays(models, tmp_path):
    args = ["serve", "--heartbeat-s", "0.1", "--model", f"alpha={models['alpha']}", "--model",
            f"beta={models['beta']}", "--pin", "alpha", "--max-loaded-models", "1", "--keep-alive", "0",
            "--admin-key", "admin-key-otter"]
    srv = Server(args, tmp_path / "serve.log", env=LAZY)
    try:
        wait_for(lambda: srv.answers() and srv.http.get("/ready").status_code == 200, 60, "the pinned model")
        assert statuses(srv) == {"alpha": "loaded", "beta": "unloaded"}
        assert complete(srv, "alpha")["choices"]  # keep-alive 0, but pinned: it stays
        time.sleep(1)
        assert statuses(srv)["alpha"] == "loaded"
        # The one slot is alpha's for good: beta is refused at once, naming why, with a 400 (not a 503, which
        # SDKs retry: it would never succeed while the pin stands).
        refused = srv.http.post("/v1/completions", json={"model": "beta", "prompt": PROMPT, "max_tokens": 2})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "no_room"
        assert "1 of at most 1 models loaded (alpha (pinned))" in refused.json()["error"]["message"]
        # /admin takes the admin key, and only it.
        assert srv.http.post("/admin/models/alpha/unload").status_code == 401
        unloaded = srv.http.post("/admin/models/alpha/unload", headers={"Authorization": "Bearer admin-key-otter"})
        assert unloaded.status_code == 200 and statuses(srv)["alpha"] == "unloaded"
        # The operator unloaded it: no reason to send clients elsewhere (it was a 503 until loaded again),
        # and pinning it again while unloaded makes none either.
        assert srv.http.get("/ready").status_code == 200
        pinned = srv.http.post("/admin/models/alpha/pin", headers={"Authorization": "Bearer admin-key-otter"})
        assert pinned.status_code == 200 and srv.http.get("/ready").status_code == 200
        ref = Reference(models["beta"])
        assert complete(srv, "beta")["choices"][0]["text"] == ref.greedy(ref.text_prompt(PROMPT), 8).text
    finally:
        srv.stop()


def test_a_model_in_steady_use_keeps_no_other_model_out(models, tmp_path):
    """One slot, alpha's requests back to back from four clients, then one for
    beta: beta waited for an idle alpha that never came (a new request always
    overlapped the last), and got a 503 at the end of its wait. New requests
    to alpha now wait behind beta's load, first come first served."""
    args = ["serve", "--heartbeat-s", "0.1", "--model", f"alpha={models['alpha']}", "--model",
            f"beta={models['beta']}", "--max-loaded-models", "1", "--keep-alive", "10m", "--worker-wait-s", "50"]
    # alpha's clients wait through two loads (beta's, then alpha's again): 20 s of them on a loaded CI machine.
    srv = Server(args, tmp_path / "serve.log", env=LAZY)
    stop = threading.Event()
    answered: list[int] = []

    def busy(tokens: int) -> None:  # of lengths that end apart, so that one always runs
        while not stop.is_set():
            answered.append(srv.http.post("/v1/completions", json={
                "model": "alpha", "prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True}).status_code)

    clients = [threading.Thread(target=busy, args=(tokens,)) for tokens in (13, 21, 34, 55)]
    try:
        wait_for(srv.answers, 60, "the gateway")
        for client in clients:
            client.start()
        wait_for(lambda: len(answered) >= 4, 60, "alpha's clients")
        started = time.monotonic()
        beta = srv.http.post("/v1/completions", json={"model": "beta", "prompt": PROMPT, "max_tokens": 8,
                                                      "temperature": 0}, timeout=60)
        assert beta.status_code == 200, beta.text
        assert time.monotonic() - started < 15
        ref = Reference(models["beta"])
        assert beta.json()["choices"][0]["text"] == ref.greedy(ref.text_prompt(PROMPT), 8).text
    finally:
        stop.set()
        for client in clients:
            client.join(60)
        srv.stop()
    assert set(answered) == {200}  # alpha's clients waited their turn, then were answered


def test_a_worker_slow_to_stop_holds_up_no_other_model_and_keeps_its_room(models, tmp_path):
    """--drain-s 1: a worker deaf to SIGTERM (stopped here) is killed 6 s after its unload began."""
    args = ["serve", "--heartbeat-s", "0.1", "--worker-timeout-s", "60", "--drain-s", "1", "--worker-wait-s", "60",
            "--max-loaded-models", "2", "--keep-alive", "10m", "--pin", "alpha"]
    for name, path in models.items():
        args += ["--model", f"{name}={path}"]
    srv = Server(args, tmp_path / "serve.log", env=LAZY)
    done: dict[str, float] = {}
    answers: dict[str, object] = {}

    def in_background(name: str, call) -> threading.Thread:
        def run() -> None:
            answers[name] = call()
            done[name] = time.monotonic()
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    try:
        wait_for(lambda: srv.answers() and srv.http.get("/ready").status_code == 200, 60, "alpha, pinned")
        assert complete(srv, "beta")["choices"]
        beta = next(w["pid"] for w in srv.health()["workers"] if w["model"] == "beta")
        os.kill(beta, signal.SIGSTOP)
        unload = in_background("unload", lambda: srv.http.post("/admin/models/beta/unload", timeout=60))
        time.sleep(0.3)
        beta_entry = srv.health()["pool"]["models"]["beta"]
        assert beta_entry["status"] == "unloading" and beta_entry["memory"]  # its room is not free yet
        started = time.monotonic()
        ref = Reference(models["alpha"])
        assert complete(srv, "alpha")["choices"][0]["text"] == ref.greedy(ref.text_prompt(PROMPT), 8).text
        assert time.monotonic() - started < 3  # not held until beta's worker is killed
        # gamma needs beta's place (alpha is pinned): it starts only once beta's worker is gone.
        gamma = in_background("gamma", lambda: complete(srv, "gamma"))
        watcher = Watcher(srv)
        watcher.start()
        unload.join(30)
        gamma.join(60)
        assert watcher.stop() <= 2
        assert answers["unload"].status_code == 200 and done["unload"] < done["gamma"]
        ref = Reference(models["gamma"])
        assert answers["gamma"]["choices"][0]["text"] == ref.greedy(ref.text_prompt(PROMPT), 8).text
        assert not os.path.exists(f"/proc/{beta}")
        assert statuses(srv) == {"alpha": "loaded", "beta": "unloaded", "gamma": "loaded"}
        assert "ignored SIGTERM" in srv.log_path.read_text()
    finally:
        srv.stop()


def test_ready_once_a_preloaded_model_is_unloaded_before_it_was_ready(models, tmp_path):
    args = ["serve", "--heartbeat-s", "0.1", "--preload", "--max-loaded-models", "1", "--worker-wait-s", "60",
            "--model", f"alpha={models['alpha']}", "--model", f"beta={models['beta']}"]
    srv = Server(args, tmp_path / "serve.log")
    try:
        wait_for(srv.answers, 60, "the gateway")
        assert statuses(srv)["alpha"] == "loading"  # still loading when beta's request makes room
        ref = Reference(models["beta"])
        assert complete(srv, "beta")["choices"][0]["text"] == ref.greedy(ref.text_prompt(PROMPT), 8).text
        assert statuses(srv) == {"alpha": "unloaded", "beta": "loaded"}
        wait_for(lambda: srv.http.get("/ready").status_code == 200, 10, "/ready")
    finally:
        srv.stop()
