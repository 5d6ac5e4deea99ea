"""Serving benchmark: how much of the engine's own speed reaches the clients.

    python -m tests.bench.harness [--model M] [--concurrency 1 8 32 64] [--tokens 64] [--write]

In one run, with one streaming load generator, at each concurrency:
  engine  mlx-lm's BatchGenerator in-process, kept full (the engine limit)
  mlxd    `mlxd serve` end to end, over HTTP
  peer    `mlx_lm.server` (shipped with mlx-lm), over HTTP
Each HTTP request streams a chat completion of --tokens tokens (counted from
the server's usage; TTFT and inter-token gaps from the chunks with text); each system
gets 2 x concurrency requests (at least 8) after a warm-up round at the same
concurrency. Reported: aggregate
tokens/s, time to first token p50/p99, inter-token latency p50/p99, failures,
and each system's tokens/s as a ratio of the engine's. --write puts the table
into docs/benchmarks.md. Without --model the model is a 2-layer random-weight
llama (tests/tiny_model.py), where serving overhead dominates.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.bench.serve_speed import free_port

ROOT = Path(__file__).resolve().parents[2]
MESSAGES = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]


@dataclass
class Result:
    tokens: int = 0
    wall: float = 0.0
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    failures: int = 0

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall if self.wall else 0.0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(int(q * len(values)), len(values) - 1)] * 1000


# ---- the engine limit --------------------------------------------------------


def engine_limit(model_dir: str, concurrency: int, requests: int, tokens: int) -> Result:
    """mlx-lm's BatchGenerator in this process, refilled as sequences finish."""
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    model, tokenizer = load(model_dir)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    generator = BatchGenerator(model, completion_batch_size=max(concurrency, 1), prefill_batch_size=min(8, concurrency))
    # Warm-up at this concurrency: the first calls of a new shape compile kernels.
    generator.insert([prompt] * concurrency, max_tokens=[8] * concurrency)
    finished = 0
    while finished < concurrency:
        finished += sum(r.finish_reason is not None for r in generator.next()[1])
    result = Result()
    started_at: dict[int, float] = {}
    last: dict[int, float] = {}
    submitted = done = 0

    def submit(n: int) -> None:
        nonlocal submitted
        for uid in generator.insert([prompt] * n, max_tokens=[tokens] * n):
            started_at[uid] = time.perf_counter()
        submitted += n

    begin = time.perf_counter()
    submit(min(concurrency, requests))
    while done < requests:
        _, responses = generator.next()
        now = time.perf_counter()
        for r in responses:
            result.tokens += 1
            if r.uid in last:
                result.itls.append(now - last[r.uid])
            else:
                result.ttfts.append(now - started_at[r.uid])
            last[r.uid] = now
            if r.finish_reason is not None:
                done += 1
                if submitted < requests:
                    submit(1)
    result.wall = time.perf_counter() - begin
    generator.close()
    return result


# ---- HTTP systems ------------------------------------------------------------


async def one_request(client: httpx.AsyncClient, model: str, tokens: int, extra: dict, result: Result) -> None:
    body = {"model": model, "messages": MESSAGES, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    started = time.perf_counter()
    last = None
    chunks = 0
    usage = None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                result.failures += 1
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                if not chunk.get("choices") or not chunk["choices"][0].get("delta", {}).get("content"):
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttfts.append(now - started)
                else:
                    result.itls.append(now - last)
                last = now
                chunks += 1
    except httpx.HTTPError:
        result.failures += 1
        return
    # Tokens as the server counts them: a token can end mid-character and
    # arrive in the next chunk, so chunks undercount (by a third on a random model).
    result.tokens += usage["completion_tokens"] if usage else chunks


async def load(url: str, model: str, concurrency: int, requests: int, tokens: int, extra: dict) -> Result:
    result = Result()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        # Warm-up at this concurrency: the first calls of a new shape compile kernels.
        await asyncio.gather(*(one_request(client, model, 8, extra, Result()) for _ in range(concurrency)))
        queue = asyncio.Queue()
        for _ in range(requests):
            queue.put_nowait(None)

        async def user() -> None:
            while not queue.empty():
                queue.get_nowait()
                await one_request(client, model, tokens, extra, result)

        begin = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        result.wall = time.perf_counter() - begin
    return result


def start_server(argv: list[str], url: str, env: dict) -> subprocess.Popen:
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{argv[:3]} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/v1/models", timeout=30).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"{argv[:3]} did not come up")


def http_system(name: str, model_dir: str, concurrencies: list[int], tokens: int) -> dict[int, Result]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    if name == "mlxd":
        argv = [sys.executable, "-m", "gateway", "serve", "--model", model_dir, "--port", str(port),
                "--max-batch", str(max(concurrencies))]
        extra = {"ignore_eos": True}
    else:
        from worker.blas import openblas_path

        if openblas_path():  # the same BLAS as mlxd's worker and the engine
            env["LD_PRELOAD"] = str(openblas_path())
        argv = [sys.executable, "-m", "mlx_lm", "server", "--model", model_dir, "--port", str(port),
                "--decode-concurrency", str(max(concurrencies))]
        extra = {}
    proc = start_server(argv, url, env)
    try:
        # mlx_lm.server names a local model by its path (its /v1/models lists the Hugging Face cache).
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"] if name == "mlxd" else model_dir
        return {c: asyncio.run(load(url, model, c, max(2 * c, 8), tokens, extra)) for c in concurrencies}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def table(results: dict[str, dict[int, Result]], concurrencies: list[int]) -> str:
    rows = ["| concurrency | system | tok/s | × engine | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | failed |",
            "|---|---|---|---|---|---|---|"]
    for c in concurrencies:
        engine = results["engine"][c].tok_s
        for system in ("engine", "mlxd", "mlx_lm.server"):
            r = results[system][c]
            rows.append(
                f"| {c} | {system} | {r.tok_s:.0f} | {r.tok_s / engine:.2f} | {pct(r.ttfts, .5):.1f} / "
                f"{pct(r.ttfts, .99):.1f} | {pct(r.itls, .5):.2f} / {pct(r.itls, .99):.2f} | {r.failures} |"
            )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md")
    args = parser.parse_args()
    from worker.blas import load_fast_blas

    load_fast_blas()
    model_dir = args.model
    if not model_dir:
        from tests.tiny_model import make_tiny_model

        model_dir = str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny-2-layer"))
    results = {
        "engine": {c: engine_limit(model_dir, c, max(2 * c, 8), args.tokens) for c in args.concurrency},
        "mlxd": http_system("mlxd", model_dir, args.concurrency, args.tokens),
        "mlx_lm.server": http_system("mlx_lm.server", model_dir, args.concurrency, args.tokens),
    }
    command = "python -m tests.bench.harness " + " ".join(sys.argv[1:])
    text = (f"Command: `{command.strip()}`; machine: {platform.machine()}, {os.cpu_count()} cores, "
            f"{platform.system()}; model: {args.model or 'random-weight 2-layer llama (tests/tiny_model.py)'}; "
            f"{args.tokens} tokens per request, streamed.\n\n{table(results, args.concurrency)}\n")
    print(text)
    if args.write:
        path = ROOT / "docs" / "benchmarks.md"
        marker_start, marker_end = "<!-- harness:start -->", "<!-- harness:end -->"
        doc = path.read_text()
        block = f"{marker_start}\n{text}{marker_end}"
        if marker_start in doc:
            doc = doc[: doc.index(marker_start)] + block + doc[doc.index(marker_end) + len(marker_end):]
        else:
            doc += f"\n## Serving overhead: engine limit vs mlxd vs mlx_lm.server\n\n{block}\n"
        path.write_text(doc)


if __name__ == "__main__":
    main()
