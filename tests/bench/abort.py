"""Abort latency: from a client hanging up to its slot leaving the worker's batch.

    python -m tests.bench.abort [--model M] [--concurrency 8] [--aborts 16]

`mlxd serve --log-level debug` (default model: the embedded SmolLM2, whose
decode steps are long enough to tell "this step" from "the next") runs
--concurrency streams of greedy chat completions; each user reads a random
number of chunks (5-20), hangs up, and starts another. For each hang-up the
client notes the wall-clock time it closed the connection; the worker logs
the moment it drops the request from its batch ("aborted ID after step N",
to the millisecond, so a drop counts as 1 ms later than logged). Latency =
drop - hang-up. The bound is the step in flight: the worker drops an aborted
request after the step that was running when the abort arrived, before it
sends that step's tokens. So a drop within the step in flight comes before
the next step's chunks of the other streams reach the client. A step's
chunks arrive as a burst (a few ms, against a step of over 100 ms on
SmolLM2 here); the benchmark counts the drops that come before the first
burst after the hang-up, and gives the latency in median steps (the median
gap between a stream's chunks).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import os
import random
import re
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx
import msgspec

from tests.bench.load import MESSAGES, Client, pct
from tests.bench.serve_speed import start

LOG_LINE = re.compile(r"^(\S+ \S+) mlxd-worker\[\d+\] DEBUG aborted (.+) after step \d+$")


def dropped_at(log: str) -> dict[str, float]:
    """Request id -> when the worker dropped it (epoch seconds), from its log."""
    dropped = {}
    for line in log.splitlines():
        if m := LOG_LINE.match(line):
            when = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            dropped.update((request_id, when) for request_id in m[2].split())
    return dropped


async def users(url: str, model: str, concurrency: int, aborts: int) -> tuple[dict[str, float], list[float], list[float]]:
    """Hang-up time of each request by id, the arrival time of every chunk,
    and the gaps between chunks of each stream."""
    client = Client(url)
    hung_up: dict[str, float] = {}
    arrivals: list[float] = []
    gaps: list[float] = []
    remaining = aborts
    rng = random.Random(0)

    async def user() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            read_chunks = rng.randint(5, 20)
            seen, last = 0, None

            def on_event(data: bytes, now: float) -> bool:
                nonlocal seen, last
                chunk = msgspec.json.decode(data)
                arrivals.append(time.time())
                if last is not None:
                    gaps.append(now - last)
                last = now
                seen += 1
                if seen < read_chunks:
                    return False
                hung_up[chunk["id"]] = time.time()
                return True

            body = {"model": model, "messages": MESSAGES, "max_tokens": 1000, "temperature": 0, "stream": True,
                    "ignore_eos": True}
            await client.post_stream("/v1/chat/completions", body, on_event)

    try:
        await asyncio.gather(*(user() for _ in range(concurrency)))
        await asyncio.sleep(1)  # the last drops reach the log
    finally:
        client.close()
    return hung_up, sorted(arrivals), gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="default: the embedded SmolLM2")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--aborts", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "mlxd.log"
        with open(log_path, "w") as log:
            proc, url, _ = start(args.model, dict(os.environ), ["--log-level", "debug"], stderr=log)
            try:
                model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
                hung_up, arrivals, gaps = asyncio.run(users(url, model, args.concurrency, args.aborts))
            finally:
                proc.terminate()
                proc.wait(30)
        dropped = dropped_at(log_path.read_text())
    step = statistics.median(gaps)
    bursts = [arrivals[0]] + [a for before, a in zip(arrivals, arrivals[1:]) if a - before > step / 4]
    latencies, in_flight = [], 0
    for request_id, at in hung_up.items():
        if request_id in dropped:
            drop = dropped[request_id] + 0.001
            latencies.append(drop - at)
            i = bisect.bisect_right(bursts, at)
            in_flight += i == len(bursts) or drop < bursts[i]
    print(f"model: {args.model or 'SmolLM2-135M-Instruct (embedded)'}; {args.concurrency} streams; "
          f"{len(hung_up)} hang-ups, {len(latencies)} drops found in the worker's log")
    print(f"step time (median gap between chunks): {step * 1000:.1f} ms")
    print(f"hang-up to drop: p50 {pct(latencies, .5):.1f} ms, max {max(latencies) * 1000:.1f} ms = "
          f"{statistics.median(latencies) / step:.2f} / {max(latencies) / step:.2f} steps (p50 / max); "
          f"{in_flight} of {len(latencies)} dropped within the step in flight")


if __name__ == "__main__":
    main()
