"""Memory a running request's hand-over to the prefix cache's disk tier takes.

    python -m tests.bench.disk_save_peak [--model DIR] [--tokens 2048]

The engine, in-process with a disk tier, runs one request of --tokens prompt
tokens (the embedded SmolLM2 by default) for 4 tokens. At its first token
the engine hands the prompt's KV state to the disk tier (so that a worker lost
mid-stream leaves it on disk); reported: each step's peak of MLX memory above
what was active before it. The hand-over's step shows what writing the
prompt's blocks costs beside the step's own work.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from worker.blas import load_fast_blas

load_fast_blas()

import mlx.core as mx  # noqa: E402

from protocol import AddRequest, Sampling  # noqa: E402
from protocol.worker_settings import DEFAULT_MODEL_NAME  # noqa: E402
from worker.disk_cache import DiskCache, layout_of  # noqa: E402
from worker.engine import Engine  # noqa: E402
from worker.footprint import probe_cache  # noqa: E402
from worker.grammar import Grammars  # noqa: E402
from worker.model import load_model  # noqa: E402
from worker.model_source import cache_dir  # noqa: E402
from worker.prefix_cache import PrefixCache  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    loaded = load_model(str(args.model or cache_dir() / "models" / DEFAULT_MODEL_NAME))
    with tempfile.TemporaryDirectory() as directory:
        disk = DiskCache(Path(directory), 1 << 40, b"disk_save_peak", layout_of(probe_cache(loaded.model)))
        engine = Engine(loaded.model, eos_token_ids=loaded.eos_token_ids, vocab_size=loaded.vocab_size,
                        context_length=args.tokens + 64, capacity=8, prefill_batch_size=4,
                        prefill_step_size=args.tokens, prefix_cache=PrefixCache(0, disk),
                        grammars=Grammars(loaded.hf_tokenizer, loaded.vocab_size, loaded.eos_token_ids))
        prompt = [(i * 7) % 300 + 5 for i in range(args.tokens)]
        engine.add(AddRequest("a", prompt, Sampling(max_tokens=4, ignore_eos=True)))
        peaks = []
        while engine.has_work:
            mx.eval(mx.zeros(1))
            mx.reset_peak_memory()
            before = mx.get_active_memory()
            engine.step()
            peaks.append((mx.get_peak_memory() - before) / 2**20)
        disk.close()
    print(f"{args.tokens}-token prompt; each step's peak MLX memory above what was active before it (MiB): "
          + " ".join(f"{p:.1f}" for p in peaks))


if __name__ == "__main__":
    main()
