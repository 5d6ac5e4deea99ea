"""A vision tower run in pieces. Main thread only.

MLX builds a graph lazily and computes it on `mx.eval`, so mlx-vlm's
`get_input_embeddings` returns at once with nothing computed. While it builds
that graph, the outputs of the tower's transformer blocks are recorded; the
engine then evaluates them a few blocks per step, as much as a time budget
allows, and running text streams keep their pace while a large image encodes.
Evaluating block k computes only what block k needs that is not computed yet,
so the pieces add up to one run of the tower, in order, and the graph's last
evaluation (the projection into the language model's embeddings) finds the
blocks done. A family whose code forced a block's output while building would
just have run that much at once: the answer is the same either way.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from time import perf_counter
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

# The attribute every served family's tower keeps its blocks in.
BLOCK_LISTS = ("layers", "blocks")


def tower_blocks(vlm: nn.Module) -> list:
    """The list (the model's own, so it can be swapped in place) of the vision
    tower's transformer blocks."""
    tower = vlm["vision_tower"] if "vision_tower" in vlm else vlm["vision_model"]
    for path, _ in tower.named_modules():
        parts = path.split(".")  # a block's path ends in its list's name and its index
        if len(parts) >= 2 and parts[-2] in BLOCK_LISTS and parts[-1].isdigit():
            owner = tower
            for part in parts[:-2]:
                owner = owner[part]
            return owner[parts[-2]]
    raise ValueError(f"no list of blocks ({' or '.join(BLOCK_LISTS)}) in {type(tower).__name__}")


class _Recorded:
    """A block that notes its (lazy) outputs on a tape as it is called."""

    def __init__(self, block: Callable, tape: list[list[mx.array]]) -> None:
        self.block, self.tape = block, tape

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.block(*args, **kwargs)
        self.tape.append([pair[1] for pair in tree_flatten(out) if isinstance(pair[1], mx.array)])
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.block, name)


@contextmanager
def recording(blocks: list) -> Iterator[list[list[mx.array]]]:
    """While open, each call of one of `blocks` appends its outputs to the list
    this yields; the blocks are the model's own again afterwards."""
    originals = list(blocks)
    tape: list[list[mx.array]] = []
    blocks[:] = [_Recorded(b, tape) for b in originals]
    try:
        yield tape
    finally:
        blocks[:] = originals


def evaluate_in_pieces(tape: list[list[mx.array]], budget: float) -> Generator[None, float, None]:
    """Evaluate the recorded outputs in order, yielding once a piece has spent
    `budget` seconds (each piece runs at least one block); the budget of the
    next piece comes with the `send` that resumes it. The tape lets go of
    each block's outputs once they are computed."""
    start = perf_counter()
    for i, outputs in enumerate(tape):
        if i and perf_counter() - start >= budget:
            budget = yield
            start = perf_counter()
        mx.eval(outputs)
        # The next block's graph holds what it needs of these; the tape would keep every block's until the end.
        outputs.clear()
