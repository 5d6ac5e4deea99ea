"""Where the CPU goes: seconds of CPU per 1000 streamed tokens, by process.

    python -m tests.bench.cpu_share [--model M] [--concurrency 8 32 64] [--tokens 64]

On a machine the load generator, the gateway and the worker share, every
cycle one of them spends is a cycle the others lack. This drives `mlxd
serve` with the benchmarks' load generator (6 x concurrency requests of 64
tokens, at least 48) and reads each process's user + system time from its
CPU clock (Linux): the gateway, its worker (the gateway's child) and this
process (the load generator). Without --model: the tiny random test model.

With several --tokens, each concurrency runs once per request length (the
same number of tokens in all), which separates what the gateway spends per
request from what it spends per token.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import sys
import tempfile
import time
from pathlib import Path

from tests.bench.harness import http_system
from tests.bench.load import load


def cpu_seconds(pid: int) -> float:
    """The process's CPU time (all its threads, user and system), to the
    nanosecond: /proc's clock ticks (10 ms) would be a tenth of what a short run measures."""
    clock = ctypes.c_int()
    if ctypes.CDLL(None).clock_getcpuclockid(pid, ctypes.byref(clock)) != 0:
        raise OSError(f"no CPU clock for pid {pid}")
    return time.clock_gettime(clock.value)


def children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--tokens", type=int, nargs="+", default=[64], help="tokens per request")
    args = parser.parse_args()
    model_dir = args.model
    if not model_dir:
        from tests.tiny_model import make_tiny_model

        model_dir = str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny"))
    print("| concurrency | tokens per request | tok/s | gateway | worker | load generator | cores busy |")
    print("|---|---|---|---|---|---|---|")
    with http_system("mlxd", model_dir, max(args.concurrency)) as server:
        gateway = server.pid
        (worker,) = children(gateway)
        for c in args.concurrency:
            for tokens in args.tokens:
                asyncio.run(load(server.url, server.model, c, c, 8, server.extra))
                before = cpu_seconds(gateway), cpu_seconds(worker), time.process_time()
                requests = max(6 * c, 48) * 64 // tokens
                result = asyncio.run(load(server.url, server.model, c, requests, tokens, server.extra))
                after = cpu_seconds(gateway), cpu_seconds(worker), time.process_time()
                used = [b - a for a, b in zip(before, after)]
                per_k = [u / (result.tokens / 1000) for u in used]
                print(f"| {c} | {tokens} | {result.tok_s:.0f} | {per_k[0]:.3f} s | {per_k[1]:.3f} s | "
                      f"{per_k[2]:.3f} s | {sum(used) / result.wall:.2f} |", flush=True)
    print(f"CPU seconds per 1000 tokens; model: {args.model or 'tiny random test model'}; {os.cpu_count()} cores; "
          f"command: python -m tests.bench.cpu_share {' '.join(sys.argv[1:])}".rstrip())


if __name__ == "__main__":
    main()
