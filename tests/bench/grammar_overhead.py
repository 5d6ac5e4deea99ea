"""What structured output costs per token: json_schema (llguidance) vs unconstrained.

    python -m tests.bench.grammar_overhead [--model M]

Without --model it runs on the tiny random test model (built in a temporary
directory). Both requests are greedy chat completions through `mlxd serve`;
the figure is wall time per completion token, median of 5.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from tests.bench.serve_speed import start

SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 150, "maxLength": 150}},
          "required": ["text"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "hi"}]


def ms_per_token(client: httpx.Client, model: str, constrained: bool, seed: int) -> float:
    body = {"model": model, "messages": MESSAGES, "temperature": 0, "seed": seed}
    if constrained:
        body.update(max_tokens=400, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
    else:
        body.update(max_tokens=150, ignore_eos=True)
    started = time.perf_counter()
    usage = client.post("/v1/chat/completions", json=body).json()["usage"]
    return (time.perf_counter() - started) / usage["completion_tokens"] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="")
    args = parser.parse_args()
    model_path = args.model
    if not model_path:
        from worker.blas import load_fast_blas

        load_fast_blas()
        from tests.tiny_model import make_tiny_model

        model_path = str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny"))
    proc, url, _ = start(model_path, dict(os.environ))
    try:
        client = httpx.Client(base_url=url, timeout=600)
        model = client.get("/v1/models").json()["data"][0]["id"]
        for constrained in (False, True):  # warm-up, and the grammar tokenizer's one-off build
            ms_per_token(client, model, constrained, 0)
        free = [ms_per_token(client, model, False, i) for i in range(5)]
        constrained = [ms_per_token(client, model, True, i) for i in range(5)]
        print(f"model: {model}")
        print(f"unconstrained: {statistics.median(free):.2f} ms/token; json_schema: "
              f"{statistics.median(constrained):.2f} ms/token ({statistics.median(constrained) / statistics.median(free):.2f}x)")
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
