"""Reuse of KV state across requests that share a prompt prefix.

System prompts, multi-turn chats and agents re-sending their history all
start with tokens the model has seen. Finished (and aborted) requests leave
their KV cache here, in mlx-lm's LRU prompt cache (a token trie with a byte
budget); a new request takes a copy of the longest usable prefix and only
prefills the rest. Main thread only.

With a disk tier (worker.disk_cache), finished requests' KV state is also
written there in blocks, and a prompt whose prefix the disk holds longer
than RAM does is read back from it: after a restart, that is every prompt
seen before.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    KVCache,
    LRUPromptCache,
    PromptTrie,
    PromptTrieResult,
    can_trim_prompt_cache,
    trim_prompt_cache,
)

from protocol import PrefixCacheStats
from worker.disk_cache import DiskCache


class LinearPromptTrie(PromptTrie):
    """mlx-lm's token trie, with a search whose time does not grow with what
    else is cached.

    Past the prompt's longest match, the search looks for a cached sequence
    that goes on from there (its KV state, trimmed, serves the match).
    mlx-lm 0.32.2 looks for the shortest one breadth first, copying the path
    walked so far at every node it visits: quadratic in a cached sequence's
    unmatched tail (a prompt sharing a system prompt with a cached
    50,000-token conversation took 2 s on the worker's main thread, every
    stream waiting), and, without the copies, still a walk over every cached
    sequence that shares the match (a new chat beside 400 cached ones with
    its system prompt: 0.6 s). Here the search follows one cached sequence
    down from the match, the oldest (a dict keeps its children in insertion
    order): any of them holds the match's KV state, and PrefixCache.take
    keeps only that much of it.

    With `shortest`, for models with sliding-window layers (Gemma 3), it
    still looks for the shortest, breadth first without the copies: such a
    cache can be trimmed to the match only while it fits the window, which a
    short chat does and a long conversation does not."""

    def __init__(self, shortest: bool = False) -> None:
        super().__init__()
        self.shortest = shortest

    def search(self, model: Any, tokens: list[int]) -> PromptTrieResult:
        if model not in self._trie:
            return PromptTrieResult(model, None, None, None, 0)
        node = self._trie[model]
        if not tokens and "__value__" in node:
            return PromptTrieResult(model, [], None, None, 0)
        last, index = -1, 0
        while index < len(tokens) and tokens[index] in node:
            node = node[tokens[index]]
            if "__value__" in node:
                last = index
            index += 1
        if last == len(tokens) - 1 >= 0:
            return PromptTrieResult(model, tokens, None, None, 0)
        shorter = tokens[: last + 1] if last > 0 else None
        longer = tokens[:index] + self._nearest_value(node) if index > 0 else None
        return PromptTrieResult(model, None, shorter, longer, index)

    def _nearest_value(self, node: dict) -> list[int]:
        """The tokens from `node` to a node below it holding a value (every
        leaf holds one): the nearest with `shortest`, else down the oldest
        children."""
        if not self.shortest:
            tokens = []
            while "__value__" not in node:
                token, node = next(iter(node.items()))
                tokens.append(token)
            return tokens
        queue: deque[tuple[dict, tuple | None]] = deque([(node, None)])
        while queue:
            node, path = queue.popleft()
            if "__value__" in node:
                tokens = []
                while path is not None:
                    token, path = path
                    tokens.append(token)
                return tokens[::-1]
            queue.extend((child, (token, path)) for token, child in node.items())
        raise KeyError("no cached sequence below this node")


class PrefixCache:
    def __init__(self, budget_bytes: int, disk: DiskCache | None = None, windowed: bool = False,
                 agree: Callable[[int, bool], int] | None = None) -> None:
        """windowed: the model has sliding-window layers (see LinearPromptTrie).
        agree: in a distributed group, every rank's length found and whether
        its cache can be cut shorter, to the length every rank reuses
        (RankChannel.common_prefix)."""
        self._lru = LRUPromptCache(max_size=1 << 30, max_bytes=budget_bytes)
        self._lru._trie = LinearPromptTrie(shortest=windowed)  # mlx-lm 0.32.2's (pinned) attribute
        self.disk = disk
        self.agree = agree
        self.hits = 0
        self.cached_tokens = 0
        self.lookups = 0
        self.prefilled_tokens = 0
        self.disk_hits = 0

    def take(self, prompt: list[int], scope: str = "") -> tuple[list | None, int]:
        """A copy of the cached KV state for the longest usable prefix of
        `prompt` among those kept in `scope` (AddRequest.cache_scope), and
        that prefix's length. At least one prompt token is always left to
        prefill, since the step that reads the prompt yields the first token."""
        self.lookups += 1
        # One model a worker: mlx-lm's key for the model holds the scope instead.
        cache, rest = self._lru.fetch_nearest_cache(scope, prompt)
        if cache is not None and not rest:
            if not can_trim_prompt_cache(cache):
                cache = None
            else:
                trim_prompt_cache(cache, 1)
                rest = prompt[-1:]
        if cache is not None:
            drop_past_offset(cache)
        reused = len(prompt) - len(rest) if cache is not None else 0
        if self.disk is not None:
            restored, length = self.disk.restore(prompt[:-1], reused, scope)
            if restored is not None:
                cache, reused = restored, length
                self.disk_hits += 1
        if self.agree is not None:
            # The ranks' caches can hold other prefixes (a shard of fixed-size state cannot be cut
            # shorter, or keeps what another shard dropped); ranks that prefilled different lengths
            # would each run a batch the others do not.
            common = self.agree(reused, cache is not None and can_trim_prompt_cache(cache))
            if common < reused:
                if common:
                    if trim_prompt_cache(cache, reused - common) != reused - common:
                        # A cache that said it could be cut and was not: a wrong answer if it went on.
                        raise RuntimeError(f"could not cut the cached prefix from {reused} tokens to {common}")
                    drop_past_offset(cache)
                else:
                    cache = None
                reused = common
        self.prefilled_tokens += len(prompt) - reused
        if cache is None:
            return None, 0
        self.hits += 1
        self.cached_tokens += reused
        return cache, reused

    def keep(self, tokens: list[int], cache: list, scope: str = "") -> None:
        """Remember the KV state of `tokens` (a finished or aborted request's) in `scope`."""
        if tokens and cache:
            own_buffers(cache)
            if self.disk is not None:
                self.disk.save(tokens, cache, scope)
            self._lru.insert_cache(scope, list(tokens), cache)

    def stats(self) -> PrefixCacheStats:
        disk = self.disk
        return PrefixCacheStats(self.hits, self.cached_tokens, self._lru.nbytes, len(self._lru),
                                disk_tokens=disk.restored_tokens if disk else 0, disk_hits=self.disk_hits,
                                disk_bytes=disk.nbytes if disk else 0, lookups=self.lookups,
                                prefilled_tokens=self.prefilled_tokens, disk_budget=disk.budget if disk else 0)


def own_buffers(cache: list) -> None:
    """Gives a request's KV state buffers of its own, of its own size. What
    mlx-lm hands back is a lazy copy of the request's row of the batch (or a
    view of a longer cached sequence, for one aborted before its prefill):
    until computed, it holds the batch's whole buffers, every row of them,
    where the budget counts one row. Scheduled, not waited for: the step
    after it is already on its way."""
    drop_past_offset(cache)
    for layer in cache:
        if isinstance(layer, KVCache) and layer.keys is not None:
            layer.keys, layer.values = mx.contiguous(layer.keys), mx.contiguous(layer.values)
    mx.async_eval([layer.state for layer in cache])


def drop_past_offset(cache: list) -> None:
    """Lets a trimmed KV cache hold only what it keeps. The copy of a cached
    sequence that serves a shorter prompt shares that sequence's buffers, and
    its first write copies them whole: a new chat sharing only its system
    prompt with a long cached conversation would copy the conversation's
    KV state."""
    for layer in cache:
        if isinstance(layer, KVCache) and layer.keys is not None and layer.offset < layer.keys.shape[2]:
            layer.keys = layer.keys[..., : layer.offset, :]
            layer.values = layer.values[..., : layer.offset, :]
