"""Time to first token with a shared 2,000-token system prompt, cold vs warm prefix cache.

    python -m tests.bench.prefix_cache [--model M] [--rounds 3]

Each round uses a new system prompt (so the first request is cold), then asks
a second question under the same system prompt (warm). Streaming chat
completions through `mlxd serve`; default model: the embedded SmolLM2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid

import httpx

from tests.bench.serve_speed import start


def ttft(client: httpx.Client, model: str, system: str, question: str) -> tuple[float, int]:
    body = {"model": model, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    started = time.perf_counter()
    first = None
    cached = 0
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - started
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    return first, cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    proc, url, _ = start(args.model, dict(os.environ))
    try:
        client = httpx.Client(base_url=url, timeout=600)
        model = client.get("/v1/models").json()["data"][0]["id"]
        ttft(client, model, "warm-up", "hi")
        guidelines = " ".join(f"Guideline {i}: be precise and helpful." for i in range(220))
        tokens = client.post("/v1/chat/completions", json={
            "model": model, "max_tokens": 1, "messages": [{"role": "system", "content": f"Session 0. {guidelines}"}],
        }).json()["usage"]["prompt_tokens"]
        cold, warm, cached = [], [], []
        for _ in range(args.rounds):
            # A session id never seen before makes the first request of the round cold.
            system = f"Session {uuid.uuid4().hex}. {guidelines}"
            t, _ = ttft(client, model, system, "What is the capital of France?")
            cold.append(t)
            t, c = ttft(client, model, system, "And what is the capital of Germany?")
            warm.append(t)
            cached.append(c)
        print(f"model: {model}; system prompt about {tokens} tokens; {args.rounds} rounds")
        print(f"TTFT cold p50 {statistics.median(cold) * 1000:.0f} ms, warm p50 {statistics.median(warm) * 1000:.0f} ms "
              f"(warm/cold {statistics.median(warm) / statistics.median(cold):.2f}); cached_tokens on the warm "
              f"requests: {cached}")
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
