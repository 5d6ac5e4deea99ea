"""Full garbage collections in mlxd's processes under a long run of streams.

    python -m tests.bench.gc_pauses [--streams 32] [--requests 1500]

A full collection (generation 2) walks every object its process holds, and
meanwhile the process does nothing else: in the gateway every stream stands
still, in the worker the batch. `mlxd serve` on the tiny random test model
streams --requests requests of 64 tokens to --streams users (the benchmarks'
load generator) after a warm-up round; a `sitecustomize` module put on the
servers' PYTHONPATH times each full collection in every process of theirs.
Reported per process: the full collections during the measured run, their
total and longest time; and the streams' inter-token latency p50, p99, p99.9
and maximum.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from tests.bench.harness import http_system
from tests.bench.load import load, pct
from tests.tiny_model import make_tiny_model

# Imported by every Python process that finds it on its path: the gateway and its worker.
TIMER = '''
import atexit, gc, json, os, sys, time
_out, _timed, _began = os.environ["MLXD_GC_PAUSES_DIR"], [], [0.0]

def _time(phase, info):
    if info["generation"] != 2:
        return
    if phase == "start":
        _began[0] = time.monotonic()
    else:
        _timed.append((_began[0], time.monotonic() - _began[0]))

gc.callbacks.append(_time)
atexit.register(lambda: open(os.path.join(_out, f"{os.getpid()}.json"), "w").write(
    json.dumps({"argv": sys.argv, "collections": _timed})))
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--requests", type=int, default=1500)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp())
    model_dir = str(make_tiny_model(work / "tiny"))
    (work / "hook").mkdir()
    (work / "hook" / "sitecustomize.py").write_text(TIMER)
    (work / "pauses").mkdir()
    path = os.pathsep.join(p for p in (str(work / "hook"), os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": path, "MLXD_GC_PAUSES_DIR": str(work / "pauses")}
    with http_system("mlxd", model_dir, args.streams, env=env) as server:
        # Outside the window: the first requests import what serving needs, once (load warms up again, briefly).
        asyncio.run(load(server.url, server.model, args.streams, args.streams, 8, server.extra))
        began = time.monotonic()
        result = asyncio.run(load(server.url, server.model, args.streams, args.requests, 64, server.extra))
        ended = time.monotonic()
    print("| process | full collections in the run | their total / longest (ms) |")
    print("|---|---|---|")
    for report in sorted(work.glob("pauses/*.json")):
        seen = json.loads(report.read_text())
        name = Path(seen["argv"][0]).parent.name  # gateway/__main__.py, worker/__main__.py
        during = [took for at, took in seen["collections"] if began <= at <= ended]
        print(f"| {name} | {len(during)} | {sum(during) * 1000:.0f} / {max(during, default=0) * 1000:.0f} |")
    gaps = result.itls
    print(f"\n{result.tok_s:.0f} tok/s; inter-token latency p50 / p99 / p99.9 / max: {pct(gaps, .5):.1f} / "
          f"{pct(gaps, .99):.1f} / {pct(gaps, .999):.1f} / {max(gaps) * 1000:.1f} ms; {result.failures} failed")
    print(f"command: python -m tests.bench.gc_pauses {' '.join(sys.argv[1:])}".rstrip())


if __name__ == "__main__":
    main()
