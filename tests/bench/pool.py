"""The pool: how long a model takes to load cold and to switch to, and the
memory ledger's estimate against what MLX measures.

    python -m tests.bench.pool [--model NAME=SOURCE ...] [--rounds 3] [--prompt-tokens 512] [--max-tokens 512]

Starts `mlxd serve` with every model under --max-loaded-models 1 (each load
then unloads the model before it), no prefix cache, nothing preloaded. For
each model and round it times `POST /admin/models/NAME/load` (answered once
the model's worker is ready) twice: cold, after every model was unloaded, and
as a switch, with the previous model loaded (its unloading is in the time).

Then, per model, one greedy request of --prompt-tokens + --max-tokens: the
ledger's charge while it runs (weights as the worker measured them, plus the
request's KV reservation) against the most MLX active memory its worker
reported meanwhile (heartbeats carry it, read after every step), and the
weights' charge against MLX active memory once loaded, before any request.

Without --model: tiny random models of three sizes, and the embedded SmolLM2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from tests.bench.replicas import ROOT, free_port

MIB = 1 << 20


def call(url: str, path: str, body: dict | None = None, timeout: float = 600) -> dict:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Content-Type": "application/json"},
                                     method="POST" if body is not None else "GET")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response)


def timed_load(url: str, name: str) -> float:
    started = time.perf_counter()
    call(url, f"/admin/models/{name}/load", {})
    return time.perf_counter() - started


def unload_all(url: str, names: list[str]) -> None:
    for name in names:
        call(url, f"/admin/models/{name}/unload", {})


def worker_of(url: str, name: str) -> dict:
    return next(w for w in call(url, "/health")["workers"] if w["model"] == name)


def ledger_against_mlx(url: str, name: str, prompt_tokens: int, max_tokens: int) -> dict:
    """One request's ledger charge against the most MLX active memory seen while it ran."""
    time.sleep(0.5)  # a heartbeat or two after the load
    idle = worker_of(url, name)
    weights_charge = call(url, "/health")["pool"]["models"][name]["memory"]["weights"]
    body = {"model": name, "prompt": [7] * prompt_tokens, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    done = threading.Event()
    charged, active = 0, 0

    def run() -> None:
        try:
            call(url, "/v1/completions", body)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    while not done.is_set():
        health = call(url, "/health")
        charged = max(charged, health["pool"]["models"][name]["memory"]["total"])
        active = max(active, next(w for w in health["workers"] if w["model"] == name).get("memory", {})
                     .get("active", 0))
        time.sleep(0.05)
    return {"weights_charge": weights_charge, "idle_active": idle["memory"]["active"], "request_charge": charged,
            "request_active": active}


def default_models(tmp: Path) -> list[str]:
    from tests.tiny_model import make_tiny_model

    sizes = {"tiny-64": (2, 64), "tiny-512": (8, 512), "tiny-1024": (12, 1024)}
    models = [f"{name}={make_tiny_model(tmp / name, layers=layers, hidden=hidden)}"
              for name, (layers, hidden) in sizes.items()]
    return [*models, "SmolLM2-135M-Instruct="]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", default=None, help="NAME=SOURCE, repeatable")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=512)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mlxd-bench-") as tmp:
        models = args.model or default_models(Path(tmp))
        names = [m.partition("=")[0] for m in models]
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--max-loaded-models", "1",
                "--keep-alive", "-1", "--prefix-cache-bytes", "0", "--worker-wait-s", "600",
                "--context-length", str(args.prompt_tokens + args.max_tokens + 1)]
        for model in models:
            argv += ["--model", model]  # NAME= is the embedded default under NAME
        server = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    call(url, "/health")
                    break
                except OSError:
                    if time.monotonic() > deadline or server.poll() is not None:
                        raise SystemExit("mlxd serve did not start") from None
                    time.sleep(0.2)
            cold: dict[str, list[float]] = {n: [] for n in names}
            switch: dict[str, list[float]] = {n: [] for n in names}
            for _ in range(args.rounds):
                for i, name in enumerate(names):
                    unload_all(url, names)
                    cold[name].append(timed_load(url, name))
                    call(url, f"/admin/models/{name}/unload", {})
                    timed_load(url, names[i - 1])  # the one before it is loaded: the switch unloads it
                    switch[name].append(timed_load(url, name))
            print(f"{'model':<24}{'weights':>10}{'cold load s':>13}{'switch s':>10}   (median of {args.rounds})")
            for name in names:
                weights = call(url, "/health")["pool"]["models"][name].get("memory", {}).get("weights")
                if weights is None:
                    timed_load(url, name)
                    weights = call(url, "/health")["pool"]["models"][name]["memory"]["weights"]
                print(f"{name:<24}{weights / MIB:>8.1f}MiB{statistics.median(cold[name]):>13.2f}"
                      f"{statistics.median(switch[name]):>10.2f}")
            print(f"\nledger against MLX active memory (prompt {args.prompt_tokens} + {args.max_tokens} tokens, MiB)")
            print(f"{'model':<24}{'weights charged':>16}{'idle active':>12}{'request charged':>17}"
                  f"{'request active':>16}{'ratio':>7}")
            for name in names:
                timed_load(url, name)
                m = ledger_against_mlx(url, name, args.prompt_tokens, args.max_tokens)
                print(f"{name:<24}{m['weights_charge'] / MIB:>16.1f}{m['idle_active'] / MIB:>12.1f}"
                      f"{m['request_charge'] / MIB:>17.1f}{m['request_active'] / MIB:>16.1f}"
                      f"{m['request_charge'] / max(m['request_active'], 1):>7.2f}")
        finally:
            server.terminate()
            server.wait(60)


if __name__ == "__main__":
    main()
