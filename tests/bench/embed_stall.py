"""What a large embeddings request costs the streams already running.

    python -m tests.bench.embed_stall [--model M] [--inputs 2048] [--tokens 200] [--streams 8]

`mlxd serve` on the tiny random test model (or --model) streams to --streams users (the
benchmarks' load generator) while one more client sends one /v1/embeddings
request of --inputs inputs of about --tokens tokens each. Reported: the
streams' inter-token latency p50, p99 and maximum alone and beside the
embedding, and how long the embedding took.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.bench.harness import http_system
from tests.bench.load import Result, load
from tests.bench.long_prompt_stall import quantiles


async def beside_an_embedding(url: str, model: str, streams: int, requests: int, extra: dict,
                              inputs: list[list[int]]) -> tuple[Result, float]:
    async def embed() -> float:
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            await asyncio.sleep(0.5)  # the streams are running
            started = time.perf_counter()
            response = await client.post("/v1/embeddings", json={"model": model, "input": inputs})
            assert response.status_code == 200, response.text
            return time.perf_counter() - started

    result, took = await asyncio.gather(load(url, model, streams, requests, 64, extra), embed())
    return result, took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="default: the tiny random test model")
    parser.add_argument("--inputs", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--streams", type=int, default=8)
    args = parser.parse_args()
    model_dir = args.model
    if not model_dir:
        from tests.tiny_model import make_tiny_model

        model_dir = str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny"))
    inputs = [[(7 * i + j) % 380 + 3 for j in range(args.tokens)] for i in range(args.inputs)]
    requests = 20 * args.streams
    with http_system("mlxd", model_dir, args.streams) as server:
        alone = asyncio.run(load(server.url, server.model, args.streams, requests, 64, server.extra))
        beside, took = asyncio.run(beside_an_embedding(server.url, server.model, args.streams, requests,
                                                       server.extra, inputs))
    print("| streams' ITL p50 / p99 / max (ms) | alone | beside the embedding | embedding took (s) |")
    print("|---|---|---|---|")
    print(f"| {args.streams} streams, {args.inputs} inputs of {args.tokens} tokens | {quantiles(alone.itls)} | "
          f"{quantiles(beside.itls)} | {took:.2f} |")
    print(f"command: python -m tests.bench.embed_stall {' '.join(sys.argv[1:])}".rstrip())


if __name__ == "__main__":
    main()
