"""Prefix affinity among replicas: which worker most likely holds a prompt's prefix.

Each worker keeps the KV state of recent prompts in its prefix cache
(worker/prefix_cache.py), so a request that shares a long prefix with one sent
to a replica before (a system prompt, an agent's history, the next turn of a
chat) prefills only its new tokens there. The gateway cannot see those caches;
it remembers instead which prompts it sent where, as chains of hashed
fixed-size token blocks (a block's hash covers every token before it, so equal
hashes mean equal prefixes), the way vLLM's and SGLang's cache-aware routers
approximate their workers' caches. The memory per worker is bounded; its oldest
blocks go first, as the worker's own LRU would drop them.
"""

from __future__ import annotations

from collections import OrderedDict

BLOCK_TOKENS = 32
MAX_BLOCKS = 1 << 16  # per worker: two million tokens of prompts remembered


def prefix_blocks(tokens: list[int], scope: str = "") -> list[int]:
    """The chained hashes of the prompt's whole blocks, in the prefix cache's
    `scope` (AddRequest.cache_scope): another scope's prompts do not help it."""
    hashes, chained = [], hash(scope)
    for start in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        chained = hash((chained, *tokens[start:start + BLOCK_TOKENS]))
        hashes.append(chained)
    return hashes


class PrefixIndex:
    """The prompt prefixes sent to one worker (as prefix_blocks), least recent first."""

    def __init__(self, max_blocks: int = MAX_BLOCKS) -> None:
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._max_blocks = max_blocks

    def matched(self, blocks: list[int]) -> int:
        """How many of the leading blocks this worker was sent."""
        count = 0
        for block in blocks:
            if block not in self._blocks:
                break
            count += 1
        return count

    def add(self, blocks: list[int]) -> None:
        for block in blocks:
            self._blocks[block] = None
            self._blocks.move_to_end(block)
        while len(self._blocks) > self._max_blocks:
            self._blocks.popitem(last=False)
