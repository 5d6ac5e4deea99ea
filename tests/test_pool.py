"""Several models behind one gateway: `mlxd serve --model NAME=SOURCE` repeated,
each model in a worker of its own, each request routed by its model's name."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from tests.conftest import MLXD, ROOT, free_port, running, wait_for
from tests.reference import Reference
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


def test_serve_ends_when_one_of_its_models_cannot_load(models, tmp_path):
    """Whichever model's worker reports first: a model that cannot load at start ends `mlxd serve`."""
    result = subprocess.run([*MLXD, "serve", "--model", f"alpha={models['alpha']}", "--model",
                             f"broken={tmp_path / 'nope'}", "--port", str(free_port())],
                            capture_output=True, text=True, timeout=90, cwd=ROOT)
    assert result.returncode == 1, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("mlxd: error: cannot load the model:") and "nope" in last, last
