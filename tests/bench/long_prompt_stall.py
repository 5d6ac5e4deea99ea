"""What an agent's long prompt costs the streams already running.

    python -m tests.bench.long_prompt_stall [--words 60000] [--streams 8] [--prompts 5]

`mlxd serve` on the tiny random test model streams to --streams users (the
benchmarks' load generator) while one more client sends, one after another,
--prompts chat requests whose one message holds --words words (about 1.3
tokens a word here). The gateway tokenizes each in full, then refuses it
(400: longer than the model's context), so what the streams see is the
gateway's tokenizing alone. Reported: the streams' inter-token latency p50,
p99 and maximum with the long prompts and without them, and how long the
gateway took to answer each long prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.bench.harness import http_system
from tests.bench.load import Result, load


def quantiles(gaps: list[float]) -> str:
    p99 = statistics.quantiles(gaps, n=100)[98]
    return f"{statistics.median(gaps) * 1000:.1f} / {p99 * 1000:.1f} / {max(gaps) * 1000:.1f}"


async def with_long_prompts(url: str, model: str, streams: int, requests: int, extra: dict, text: str,
                            prompts: int) -> tuple[Result, list[float]]:
    answered: list[float] = []

    async def long_prompts() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            await asyncio.sleep(0.5)  # the streams are running
            for _ in range(prompts):
                started = time.perf_counter()
                response = await client.post("/v1/chat/completions", json={
                    "model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 8})
                assert response.status_code == 400, response.text
                answered.append(time.perf_counter() - started)

    result, _ = await asyncio.gather(load(url, model, streams, requests, 64, extra), long_prompts())
    return result, answered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--words", type=int, default=60_000)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=5)
    args = parser.parse_args()
    from tests.tiny_model import make_tiny_model

    model_dir = str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny"))
    text = " ".join(["the keeper of the lighthouse watched the sea"] * (args.words // 8))
    requests = 20 * args.streams
    with http_system("mlxd", model_dir, args.streams) as server:
        alone = asyncio.run(load(server.url, server.model, args.streams, requests, 64, server.extra))
        beside, answered = asyncio.run(with_long_prompts(server.url, server.model, args.streams, requests,
                                                         server.extra, text, args.prompts))
    print("| streams' ITL p50 / p99 / max (ms) | alone | beside long prompts | long prompt answered in (s) |")
    print("|---|---|---|---|")
    print(f"| {args.streams} streams | {quantiles(alone.itls)} | {quantiles(beside.itls)} | "
          f"{', '.join(f'{a:.2f}' for a in answered)} |")
    print(f"command: python -m tests.bench.long_prompt_stall {' '.join(sys.argv[1:])}".rstrip())


if __name__ == "__main__":
    main()
