"""What a request joining the running batch costs the streams already in it.

    python -m tests.bench.join_cost [--model DIR] [--users 8] [--tokens 128] [--steps 1500] [--passes 3]

The worker's Engine in this process (no gateway, no HTTP) keeps --users
requests of --tokens tokens decoding, their first requests of staggered
lengths so that they end at different steps, as a server's clients' requests
do; each finished request is replaced by a new one (the load generator's
chat prompt) before the next step. A join spans three of the worker's turns:
the one in which the request arrives (its prompt prefilled), the next (it
moves into the running batch) and the one after (the batch's first step with
it). Reported per pass, after a warm-up: tokens/s, the median plain turn
(neither it nor the two before had a join), each of the three join turns as
a multiple of it, and their sum less three: what a join costs, in plain
decode steps. Default model: the tiny random test model (tests/tiny_model.py).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from worker.blas import load_fast_blas

load_fast_blas()  # before MLX loads

from mlx_lm import load as load_model  # noqa: E402

from protocol import AddRequest, Sampling  # noqa: E402
from tests.bench.load import MESSAGES  # noqa: E402
from tests.tiny_model import make_tiny_model  # noqa: E402
from worker.engine import Engine  # noqa: E402

WARM_UP_STEPS = 200


def run_pass(model, prompt: list[int], users: int, tokens: int, steps: int) -> str:
    engine = Engine(model, eos_token_ids=[], vocab_size=model.args.vocab_size, context_length=4096,
                    capacity=max(64, users), prefill_batch_size=8, prefill_step_size=2048)
    added = 0

    def add(max_tokens: int) -> None:
        nonlocal added
        added += 1
        engine.add(AddRequest(f"r{added}", prompt, Sampling(max_tokens=max_tokens, ignore_eos=True)))

    for i in range(users):
        add(max(1, tokens * (i + 1) // users))
    turns, joined, replace, produced = [], [], 0, 0
    for step in range(WARM_UP_STEPS + steps):
        if step == WARM_UP_STEPS:
            turns, joined, produced = [], [], 0
            begin = time.perf_counter()
        joined.append(replace > 0)
        for _ in range(replace):
            add(tokens)
        started = time.perf_counter()
        outputs = engine.step()
        turns.append(time.perf_counter() - started)
        produced += len(outputs)
        replace = sum(o.finish_reason is not None for o in outputs)
    wall = time.perf_counter() - begin
    engine.abort_all()
    plain = statistics.median(t for i, t in enumerate(turns) if i >= 2 and not any(joined[i - 2:i + 1]))
    ratios = [statistics.median(turns[i + d] for i in range(len(turns) - d) if joined[i]) / plain for d in range(3)]
    return (f"{produced / wall:.0f} tok/s, plain turn {plain * 1e3:.2f} ms, join turns "
            f"{' / '.join(f'{r:.2f}' for r in ratios)}x: a join costs {sum(ratios) - 3:.2f} plain steps "
            f"({sum(joined)} joins)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="")
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model, tokenizer = load_model(args.model or str(make_tiny_model(Path(tmp) / "tiny")))
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    print(f"{args.users} users, {args.tokens} tokens a request, a prompt of {len(prompt)} tokens")
    for n in range(args.passes):
        print(f"pass {n + 1}: {run_pass(model, prompt, args.users, args.tokens, args.steps)}", flush=True)


if __name__ == "__main__":
    main()
