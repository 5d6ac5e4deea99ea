"""Replicas: what a second worker of the model on one gateway endpoint adds.

    python -m tests.bench.replicas [--model M] [--concurrency 16 64] [--tokens 128] [--devices 0 1]

Starts `mlxd gateway` and one `mlxd worker` on its ipc endpoint, drives the
benchmarks' load generator (4 x concurrency requests, twice: the second run,
with every batch size's kernels compiled, counts), then adds a second worker
of the same model and drives it again. With
--devices, worker i runs with CUDA_VISIBLE_DEVICES set to the i-th value, so
that on a machine with two GPUs each replica has its own; without, both share
the machine (on a CPU the second one can only split the cores). Without
--model: the tiny random test model. Prints tok/s with one and two replicas.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tests.bench.load import load

# Standard library and the load generator only: this runs where httpx is not installed (the lent GPU).
ROOT = Path(__file__).resolve().parents[2]
NAME = "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(argv: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def start_worker(model: str, endpoint: str, max_batch: int, device: str | None) -> subprocess.Popen:
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": device} if device is not None else {})}
    return start([sys.executable, "-m", "worker", "--model", model, "--worker-endpoint", endpoint,
                  "--max-batch", str(max_batch)], env)


def wait_for_workers(url: str, count: int) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=10) as response:
                workers = json.load(response)["workers"]
            if len([w for w in workers if w["ready"]]) == count:
                return
        except OSError:
            pass  # the gateway is starting
        time.sleep(0.5)
    raise SystemExit(f"{count} workers did not become ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--devices", nargs=2, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mlxd-bench-") as tmp:
        model = args.model
        if not model:
            from tests.tiny_model import make_tiny_model

            model = str(make_tiny_model(Path(tmp) / "tiny"))
        endpoint, port = f"ipc://{tmp}/worker.sock", free_port()
        url = f"http://127.0.0.1:{port}"
        limit = str(max(args.concurrency))  # the load generator is one client: above the per-client default
        gateway = start([sys.executable, "-m", "gateway", "gateway", "--worker-endpoint", endpoint,
                         "--port", str(port), "--served-model-name", NAME, "--max-inflight", limit,
                         "--max-inflight-per-key", limit], dict(os.environ))
        devices = args.devices or [None, None]
        workers: list[subprocess.Popen] = []
        tok_s: dict[int, dict[int, float]] = {}
        try:
            for replicas in (1, 2):
                workers.append(start_worker(model, endpoint, max(args.concurrency), devices[replicas - 1]))
                wait_for_workers(url, replicas)
                for concurrency in args.concurrency:
                    # Twice, keeping the second: a new worker compiles kernels for every batch size it meets.
                    for _ in range(2):
                        result = asyncio.run(load(url, NAME, concurrency, 4 * concurrency, args.tokens,
                                                  {"ignore_eos": True}))
                    if result.failures:
                        raise SystemExit(f"{result.failures} requests failed")
                    tok_s.setdefault(concurrency, {})[replicas] = result.tok_s
        finally:
            for process in [*workers, gateway]:
                process.terminate()
                process.wait(30)
    print("| streams | 1 replica tok/s | 2 replicas tok/s | 2 / 1 |\n|---|---|---|---|")
    for concurrency, by_replicas in tok_s.items():
        print(f"| {concurrency} | {by_replicas[1]:.0f} | {by_replicas[2]:.0f} | {by_replicas[2] / by_replicas[1]:.2f} |")
    where = f"CUDA devices {' and '.join(args.devices)}" if args.devices else "one machine, shared"
    print(f"model: {args.model or 'tiny random test model'}; {args.tokens} tokens per request; {where}; command: "
          f"python -m tests.bench.replicas {' '.join(sys.argv[1:])}")


if __name__ == "__main__":
    main()
