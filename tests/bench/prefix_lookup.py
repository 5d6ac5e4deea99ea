"""The prefix cache's look-up, on the worker's main thread, for long contexts.

    python -m tests.bench.prefix_lookup [--tokens 10000 50000 100000] [--chats 100 400]

A worker's RAM tier holds an agent's conversation of --tokens tokens; a new
conversation arrives that shares only its first 1,000 tokens (the system
prompt). Then the RAM tier holds --chats chats of 2,000 tokens that share
that system prompt, and a new one arrives. The worker looks each prompt up
before it prefills, while every running stream waits for its next step.
Timed (median of 5): the look-up with the prefix cache's trie
(worker.prefix_cache.LinearPromptTrie) and with mlx-lm's own, whose search
copies the path at each node of a cached sequence's unmatched tail, breadth
first over every cached sequence that shares the match. The KV state is a
tiny one (one layer, one head of 8), so that the time is the trie's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from worker.blas import load_fast_blas

load_fast_blas()

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import KVCache, PromptTrie  # noqa: E402

from worker.prefix_cache import PrefixCache  # noqa: E402

SHARED = 1000


def lookup_seconds(tokens: int, chats: int, trie: type[PromptTrie] | None) -> float:
    """The look-up of a new chat sharing SHARED tokens with each of `chats`
    cached ones of `tokens` tokens."""
    cache = PrefixCache(1 << 40)
    if trie is not None:
        cache._lru._trie = trie()
    system = list(range(SHARED))
    kv = KVCache()
    kv.update_and_fetch(mx.zeros((1, 1, tokens, 8)), mx.zeros((1, 1, tokens, 8)))
    mx.eval(kv.keys, kv.values)
    for chat in range(chats):
        cache.keep(system + [-2 - chat] + list(range(SHARED, tokens - 1)), [kv])
    prompt = system + [-1] * 20
    times = []
    for _ in range(5):
        started = time.perf_counter()
        _, reused = cache.take(prompt)
        times.append(time.perf_counter() - started)
        assert reused == SHARED
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[10_000, 50_000, 100_000])
    parser.add_argument("--chats", type=int, nargs="+", default=[100, 400])
    args = parser.parse_args()
    print("| cached | look-up, mlxd's trie (ms) | look-up, mlx-lm's trie (ms) |")
    print("|---|---|---|")
    cases = [(tokens, 1, f"a conversation of {tokens:,} tokens") for tokens in args.tokens]
    cases += [(2000, chats, f"{chats} chats of 2,000 tokens") for chats in args.chats]
    for tokens, chats, name in cases:
        ours, theirs = lookup_seconds(tokens, chats, None), lookup_seconds(tokens, chats, PromptTrie)
        print(f"| {name} | {ours * 1000:.2f} | {theirs * 1000:.1f} |", flush=True)
    print(f"command: python -m tests.bench.prefix_lookup {' '.join(sys.argv[1:])}".rstrip())


if __name__ == "__main__":
    main()
