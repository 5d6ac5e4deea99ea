"""Serving benchmark: how much of the engine's own speed reaches the clients.

    python -m tests.bench.harness [--model M] [--concurrency 1 8 32 64] [--tokens 64] [--rounds 3] [--write]

Three systems, all up at once, driven by one streaming load generator
(tests/bench/load.py):
  engine  mlx-lm's BatchGenerator in-process, kept full (the engine limit)
  mlxd    `mlxd serve` end to end, over HTTP
  peer    `mlx_lm.server` (shipped with mlx-lm), over HTTP
At each concurrency the systems take turns, --rounds times (engine, mlxd,
peer, engine, ...), so that a slow spell of this shared machine falls on all
three; each turn is 4 x concurrency requests (at least 16) of --tokens tokens
after a warm-up round, and the turns of a system are pooled. Tokens are
counted from the servers' usage. Time to first token is to the first text a
client could show: the first chunk with text, and for the engine the first
token whose text is complete (a token may end mid-character); the engine's
time to its first token, text or not, is reported beside it. Reported:
aggregate tokens/s, TTFT p50/p99, inter-token latency p50/p99, failures, and
each system's tokens/s as a ratio of the engine's. --write puts the table
into docs/benchmarks.md. Without --model the model is a 2-layer random-weight
llama (tests/tiny_model.py), where serving overhead dominates.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import NamedTuple

import httpx

from tests.bench.load import MESSAGES, Result, load, pct
from tests.bench.serve_speed import free_port

ROOT = Path(__file__).resolve().parents[2]


# ---- the engine limit --------------------------------------------------------


class EngineLimit:
    """mlx-lm's BatchGenerator in this process, refilled as sequences finish."""

    def __init__(self, model_dir: str) -> None:
        from mlx_lm import load as load_model

        self.model, self.tokenizer = load_model(model_dir)
        self.prompt = self.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)

    def run(self, concurrency: int, requests: int, tokens: int) -> Result:
        from mlx_lm.generate import BatchGenerator

        generator = BatchGenerator(self.model, completion_batch_size=concurrency,
                                   prefill_batch_size=min(8, concurrency))
        # Warm-up at this concurrency: the first calls of a new shape compile kernels.
        generator.insert([self.prompt] * concurrency, max_tokens=[8] * concurrency)
        finished = 0
        while finished < concurrency:
            finished += sum(r.finish_reason is not None for r in generator.next()[1])
        result = Result()
        started_at: dict[int, float] = {}
        last: dict[int, float] = {}
        before_text: dict[int, list[int]] = {}  # tokens of requests that have shown no text yet
        submitted = done = 0

        def submit(n: int) -> None:
            nonlocal submitted
            for uid in generator.insert([self.prompt] * n, max_tokens=[tokens] * n):
                started_at[uid] = time.perf_counter()
                before_text[uid] = []
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
                    result.first_tokens.append(now - started_at[r.uid])
                last[r.uid] = now
                if r.uid in before_text:
                    before_text[r.uid].append(r.token)
                    text = self.tokenizer.decode(before_text[r.uid])
                    if (text and not text.endswith("\ufffd")) or r.finish_reason is not None:
                        result.ttfts.append(now - started_at[r.uid])
                        del before_text[r.uid]
                if r.finish_reason is not None:
                    done += 1
                    if submitted < requests:
                        submit(1)
        result.wall = time.perf_counter() - begin
        generator.close()
        return result


# ---- HTTP systems ------------------------------------------------------------


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


class Server(NamedTuple):
    url: str
    model: str  # the name to ask for
    extra: dict  # body fields every request adds
    pid: int


@contextmanager
def http_system(name: str, model_dir: str, max_concurrency: int, env: dict | None = None,
                args: Sequence[str] = ()) -> Iterator[Server]:
    """`mlxd serve` (name "mlxd") or mlx_lm.server, up for the block; `env`
    adds to the server's environment, `args` to mlxd's flags."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, **(env or {})}
    if name == "mlxd":
        argv = [sys.executable, "-m", "gateway", "serve", "--preload", "--model", model_dir, "--port", str(port),
                "--max-batch", str(max_concurrency), *args]
        extra = {"ignore_eos": True}
    else:
        from worker.blas import openblas_path

        if openblas_path():  # the same BLAS as mlxd's worker and the engine
            env["LD_PRELOAD"] = str(openblas_path())
        argv = [sys.executable, "-m", "mlx_lm", "server", "--model", model_dir, "--port", str(port),
                "--decode-concurrency", str(max_concurrency)]
        extra = {}
    proc = start_server(argv, url, env)
    try:
        # mlx_lm.server names a local model by its path (its /v1/models lists the Hugging Face cache).
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"] if name == "mlxd" else model_dir
        yield Server(url, model, extra, proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def table(results: dict[str, dict[int, Result]], concurrencies: list[int]) -> str:
    rows = ["| concurrency | system | tok/s | × engine | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | failed |",
            "|---|---|---|---|---|---|---|"]
    first_token = ", ".join(f"{pct(results['engine'][c].first_tokens, .5):.1f} ms at {c}" for c in concurrencies)
    for c in concurrencies:
        engine = results["engine"][c].tok_s
        for system, by_concurrency in results.items():
            r = by_concurrency[c]
            rows.append(
                f"| {c} | {system} | {r.tok_s:.0f} | {r.tok_s / engine:.2f} | {pct(r.ttfts, .5):.1f} / "
                f"{pct(r.ttfts, .99):.1f} | {pct(r.itls, .5):.2f} / {pct(r.itls, .99):.2f} | {r.failures} |"
            )
    return "\n".join(rows) + f"\n\nThe engine's time to its first token (p50), text or not: {first_token}.\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="turns of each system at each concurrency")
    parser.add_argument("--no-peer", action="store_true", help="leave mlx_lm.server out")
    parser.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md")
    args = parser.parse_args()
    from worker.blas import load_fast_blas

    load_fast_blas()
    model_dir = args.model
    if not model_dir:
        from tests.tiny_model import make_tiny_model

        model_dir = str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny-2-layer"))
    systems = ("engine", "mlxd") + (() if args.no_peer else ("mlx_lm.server",))
    results = {system: {c: Result() for c in args.concurrency} for system in systems}
    engine = EngineLimit(model_dir)
    with ExitStack() as stack:
        servers = {s: stack.enter_context(http_system(s, model_dir, max(args.concurrency))) for s in systems[1:]}
        for c in args.concurrency:
            requests = max(4 * c, 16)
            for _ in range(args.rounds):
                results["engine"][c].add(engine.run(c, requests, args.tokens))
                for system, server in servers.items():
                    results[system][c].add(asyncio.run(load(server.url, server.model, c, requests, args.tokens,
                                                            server.extra)))
            print(f"concurrency {c}: " + ", ".join(f"{s} {results[s][c].tok_s:.0f} tok/s" for s in systems),
                  flush=True)
    command = "python -m tests.bench.harness " + " ".join(sys.argv[1:])
    text = (f"Command: `{command.strip()}`; machine: {platform.machine()}, {os.cpu_count()} cores, "
            f"{platform.system()}; model: {args.model or 'random-weight 2-layer llama (tests/tiny_model.py)'}; "
            f"{args.tokens} tokens per request, streamed; {args.rounds} rounds.\n\n{table(results, args.concurrency)}")
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
