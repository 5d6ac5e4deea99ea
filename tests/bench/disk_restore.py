"""Reading a prompt's KV state back from the prefix cache's disk tier.

    python -m tests.bench.disk_restore [--tokens 20480] [--repeats 10]

The KV state of a Qwen2.5-0.5B-shaped model (24 layers, 2 KV heads of 64,
bfloat16: 12 KiB a token) for --tokens tokens of random values is written by
worker.disk_cache (in blocks of BLOCK_TOKENS), then read back --repeats times by a new
DiskCache on the same directory, as a worker after a restart does; the files
are in the page cache, as they are after the first read. Reported: the
median and the fastest read, and its rate. This is the part of a turn served
from disk that the worker's main thread waits for (tests.bench.agent_replay
measures whole turns).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from worker.blas import load_fast_blas

load_fast_blas()

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from worker.disk_cache import BLOCK_TOKENS, DiskCache, layout_of  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM = 24, 2, 64
IDENTITY = b"bench"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=20480)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    tokens = list(range(args.tokens + 1))
    cache = []
    for _ in range(LAYERS):
        c = KVCache()
        shape = (1, KV_HEADS, args.tokens, HEAD_DIM)
        c.update_and_fetch(mx.random.normal(shape).astype(mx.bfloat16), mx.random.normal(shape).astype(mx.bfloat16))
        cache.append(c)
    with tempfile.TemporaryDirectory() as directory:
        writer = DiskCache(Path(directory), 1 << 40, IDENTITY, layout_of(cache))
        writer.save(tokens, cache)
        writer.close()
        reader = DiskCache(Path(directory), 1 << 40, IDENTITY, layout_of(cache))
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            restored, length = reader.restore(tokens, 0)
            times.append(time.perf_counter() - started)
            assert restored is not None and length == args.tokens // BLOCK_TOKENS * BLOCK_TOKENS
            del restored
        reader.close()
        megabytes = reader.nbytes / 1e6
    fastest = min(times)
    print(f"{length} tokens ({megabytes:.0f} MB of blocks): median {statistics.median(times) * 1e3:.0f} ms, "
          f"fastest {fastest * 1e3:.0f} ms ({megabytes / fastest / 1e3:.2f} GB/s)")


if __name__ == "__main__":
    main()
