"""A worker that is a 2-rank mx.distributed group against one process, on this machine.

    python -m tests.bench.distributed [--model M] [--concurrency 1 8] [--tokens 64] [--rounds 2]

Serving: `mlxd serve` of the same model as one worker process, and as a
group of two ranks over MLX's ring backend on loopback (tensor parallel:
each rank holds half of every layer), driven alternately by the benchmarks'
load generator (4 x concurrency requests, at least 16, after a warm-up
round), --rounds times each, turns pooled. Both ranks share this machine's
cores, and every layer adds two all-reduces over TCP, so the group is
expected to be slower here: what it buys is a model that does not fit one
Mac. Without --model: a random llama of hidden size 512 and 8 layers
(tests/tiny_model.py; its heads split in two).

Idle: the CPU each rank of an idle group spends in 10 s (the ranks meet
every 25 ms while idle, worker/collective.py).

Broadcast: two ranks started directly (MLX_RANK, a ring hostfile) time
rank 0's per-turn broadcast of a step's engine input (worker/collective.py):
an empty step (most decode steps), an abort, and a new request of a
1,000-token prompt (the second, longer collective), each the median of 300.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.bench.cpu_share import cpu_seconds
from tests.bench.harness import http_system
from tests.bench.load import Result, load, pct

REPEATS = 300
IDLE_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_args() -> list[str]:
    return ["--distributed-hosts", "127.0.0.1,127.0.0.1", "--distributed-port", str(free_port())]


def serving(model: str, concurrency: list[int], tokens: int, rounds: int) -> None:
    results: dict[str, dict[int, Result]] = {"one process": {}, "2-rank group": {}}
    for c in concurrency:
        for _ in range(rounds):
            for system, args in (("one process", []), ("2-rank group", group_args())):
                with http_system("mlxd", model, max(concurrency), args=args) as server:
                    r = asyncio.run(load(server.url, server.model, c, max(4 * c, 16), tokens, server.extra))
                pooled = results[system].setdefault(c, Result())
                pooled.tokens += r.tokens
                pooled.wall += r.wall
                pooled.ttfts += r.ttfts
                pooled.itls += r.itls
                pooled.failures += r.failures
    print("| concurrency | worker | tok/s | × one process | TTFT p50 (ms) | ITL p50 (ms) | failed |")
    print("|---|---|---|---|---|---|---|")
    for c in concurrency:
        alone = results["one process"][c].tok_s
        for system, by_concurrency in results.items():
            r = by_concurrency[c]
            print(f"| {c} | {system} | {r.tok_s:.0f} | {r.tok_s / alone:.2f} | {pct(r.ttfts, .5):.1f} | "
                  f"{pct(r.itls, .5):.2f} | {r.failures} |")


def idle(model: str) -> None:
    with http_system("mlxd", model, 8, args=group_args()) as server:
        deadline = time.monotonic() + 60
        while "ranks" not in (worker := httpx.get(server.url + "/health").json()["worker"]):
            assert time.monotonic() < deadline, "the group never connected"
            time.sleep(0.1)
        ranks = [r["pid"] for r in worker["ranks"]]
        time.sleep(1)  # past the requests of its start
        before = [cpu_seconds(pid) for pid in ranks]
        time.sleep(IDLE_S)
        busy = [(cpu_seconds(pid) - b) / IDLE_S for pid, b in zip(ranks, before)]
    print("idle group, CPU per rank: " + ", ".join(f"rank {r}: {b:.1%} of a core" for r, b in enumerate(busy)))


def rank_main() -> None:
    """One rank of the broadcast measurement (started by broadcast())."""
    from worker.blas import load_fast_blas

    load_fast_blas()
    import mlx.core as mx

    from protocol import Abort, AddRequest, Sampling
    from worker.collective import GroupStep, RankChannel

    channel = RankChannel(mx.distributed.init(backend="ring", strict=True))
    steps = {
        "empty step": GroupStep(),
        "one abort": GroupStep(aborts=[Abort(["cmpl-0123456789abcdef0123456789abcdef"])]),
        "a request of 1,000 tokens": GroupStep(adds=[AddRequest("cmpl-0123456789abcdef0123456789abcdef",
                                                                list(range(1000)), Sampling(max_tokens=64))]),
    }
    for name, step in steps.items():
        times = []
        for _ in range(REPEATS):
            started = time.perf_counter()
            channel.share(step if channel.rank == 0 else None)
            times.append(time.perf_counter() - started)
        if channel.rank == 0:
            print(f"| {name} | {statistics.median(times) * 1e6:.0f} |", flush=True)


def broadcast() -> None:
    port = free_port()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as hostfile:
        json.dump([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]], hostfile)
    print("| rank 0 broadcasts | µs per turn (median) |\n|---|---|", flush=True)
    ranks = [subprocess.Popen([sys.executable, "-m", "tests.bench.distributed", "--rank"],
                              env={**os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": hostfile.name})
             for r in range(2)]
    for r in ranks:
        r.wait()
    os.unlink(hostfile.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main()
        return
    model = args.model
    if not model:
        from tests.tiny_model import make_tiny_model

        model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "medium", hidden=512, layers=8))
    serving(model, args.concurrency, args.tokens, args.rounds)
    print()
    idle(model)
    print()
    broadcast()


if __name__ == "__main__":
    main()
