"""Resident memory of the gateway process under 64 concurrent streams (Linux: /proc).

    python -m tests.bench.gateway_memory [--model M] [--concurrency 64]

Without --model: the tiny random test model. Reports the gateway's RSS before
the load and its peak while `--concurrency` streams of 256 tokens run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import threading
from pathlib import Path

from tests.bench.load import load
from tests.bench.serve_speed import start


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="")
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    model_path = args.model
    if not model_path:
        from tests.tiny_model import make_tiny_model

        model_path = str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny"))
    proc, url, _ = start(model_path, dict(os.environ))
    try:
        import httpx

        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        idle = rss_mb(proc.pid)
        peak = idle
        done = threading.Event()
        result = {}

        def run() -> None:
            result["r"] = asyncio.run(load(url, model, args.concurrency, args.concurrency, 256, {"ignore_eos": True}))
            done.set()

        threading.Thread(target=run, daemon=True).start()
        while not done.wait(0.05):
            peak = max(peak, rss_mb(proc.pid))
        print(f"gateway RSS: {idle:.0f} MB idle, {peak:.0f} MB peak under {args.concurrency} streams "
              f"({result['r'].failures} failed)")
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
