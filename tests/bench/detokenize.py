"""Incremental detokenizing cost, per streamed token, in the gateway's process.

    python -m tests.bench.detokenize [--model DIR] [--rounds 5]

Feeds a long text's token ids one at a time (as a worker step delivers them
to one request) through gateway.tokenizer.IncrementalDetokenizer, and, as a
floor, through tokenizers' DecodeStream alone. Reports the best round of
each in microseconds per token, and checks the text equals a full decode.
Default model: the embedded SmolLM2 (its cache directory).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tokenizers.decoders import DecodeStream

from gateway.tokenizer import IncrementalDetokenizer, Tokenizer
from protocol.worker_settings import DEFAULT_MODEL_NAME

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from worker.model_source import cache_dir

    model = args.model or cache_dir() / "models" / DEFAULT_MODEL_NAME
    tokenizer = Tokenizer({p.name: p.read_bytes() for p in model.iterdir() if p.suffix == ".json"})
    text = "".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    ids = tokenizer.encode_text(text)
    expected = tokenizer.decode(ids)

    def detokenizer() -> str:
        d = IncrementalDetokenizer(tokenizer)
        return "".join([d.add([t]) for t in ids] + [d.flush()])

    def decode_stream() -> str:
        stream = DecodeStream(skip_special_tokens=True)
        return "".join(stream.step(tokenizer.rust, t) or "" for t in ids)

    print(f"{len(ids)} tokens of docs/*.md, model {model.name}")
    for name, run in (("IncrementalDetokenizer", detokenizer), ("DecodeStream alone", decode_stream)):
        best = float("inf")
        for _ in range(args.rounds):
            started = time.perf_counter()
            out = run()
            best = min(best, time.perf_counter() - started)
        print(f"{name}: {best / len(ids) * 1e6:.2f} us/token (best of {args.rounds}), text exact: {out == expected}")


if __name__ == "__main__":
    main()
