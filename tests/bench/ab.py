"""A/B: two configurations of `mlxd serve`, up at once, taking turns.

    python -m tests.bench.ab --b OPENBLAS_NUM_THREADS=1 [--a K=V ...] [--model M] [--concurrency 8 32 64]

Each configuration is environment variables for its server (MLXD_* for any
flag). Both servers run side by side; at each concurrency they take turns
for --rounds rounds (A, B, A, B, ...), so a slow spell of this shared
machine falls on both, and each turn is the harness's load (4 x concurrency
requests of --tokens tokens, at least 16). Prints tokens/s, time to first
token and inter-token latency of each, and B's tokens/s as a ratio of A's.
Without --model: the tiny random test model.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from contextlib import ExitStack
from pathlib import Path

from tests.bench.harness import http_system
from tests.bench.load import Result, load, pct


def environment(pairs: list[str]) -> dict[str, str]:
    return dict(pair.split("=", 1) for pair in pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", nargs="*", default=[], metavar="K=V", help="configuration A's environment")
    parser.add_argument("--b", nargs="*", default=[], metavar="K=V", help="configuration B's environment")
    parser.add_argument("--model", default="")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    model_dir = args.model
    if not model_dir:
        from tests.tiny_model import make_tiny_model

        model_dir = str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny"))
    print(f"A: {' '.join(args.a) or '(defaults)'}; B: {' '.join(args.b) or '(defaults)'}; "
          f"model: {args.model or 'tiny random test model'}; {args.tokens} tokens per request")
    print("| concurrency | A tok/s | B tok/s | B / A | TTFT p50 A / B (ms) | ITL p50 A / B (ms) | failed A / B |")
    print("|---|---|---|---|---|---|---|")
    with ExitStack() as stack:
        servers = [stack.enter_context(http_system("mlxd", model_dir, max(args.concurrency), environment(pairs)))
                   for pairs in (args.a, args.b)]
        for c in args.concurrency:
            a, b = Result(), Result()
            for _ in range(args.rounds):
                for server, result in zip(servers, (a, b)):
                    result.add(asyncio.run(load(server.url, server.model, c, max(4 * c, 16), args.tokens,
                                                server.extra)))
            print(f"| {c} | {a.tok_s:.0f} | {b.tok_s:.0f} | {b.tok_s / a.tok_s:.2f} | "
                  f"{pct(a.ttfts, .5):.1f} / {pct(b.ttfts, .5):.1f} | {pct(a.itls, .5):.2f} / {pct(b.itls, .5):.2f} | "
                  f"{a.failures} / {b.failures} |", flush=True)


if __name__ == "__main__":
    main()
