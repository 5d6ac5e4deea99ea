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

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

from protocol import PrefixCacheStats
from worker.disk_cache import DiskCache

MODEL_KEY = "model"  # one model per worker


class PrefixCache:
    def __init__(self, budget_bytes: int, disk: DiskCache | None = None) -> None:
        self._lru = LRUPromptCache(max_size=1 << 30, max_bytes=budget_bytes)
        self.disk = disk
        self.hits = 0
        self.cached_tokens = 0
        self.lookups = 0
        self.prefilled_tokens = 0
        self.disk_hits = 0

    def take(self, prompt: list[int]) -> tuple[list | None, int]:
        """A copy of the cached KV state for the longest usable prefix of
        `prompt`, and that prefix's length. At least one prompt token is always
        left to prefill, since the step that reads the prompt yields the first
        token."""
        self.lookups += 1
        cache, rest = self._lru.fetch_nearest_cache(MODEL_KEY, prompt)
        if cache is not None and not rest:
            if not can_trim_prompt_cache(cache):
                cache = None
            else:
                trim_prompt_cache(cache, 1)
                rest = prompt[-1:]
        reused = len(prompt) - len(rest) if cache is not None else 0
        if self.disk is not None:
            restored, length = self.disk.restore(prompt[:-1], reused)
            if restored is not None:
                cache, reused = restored, length
                self.disk_hits += 1
        self.prefilled_tokens += len(prompt) - reused
        if cache is None:
            return None, 0
        self.hits += 1
        self.cached_tokens += reused
        return cache, reused

    def keep(self, tokens: list[int], cache: list) -> None:
        """Remember the KV state of `tokens` (a finished or aborted request's)."""
        if tokens and cache:
            if self.disk is not None:
                self.disk.save(tokens, cache)
            self._lru.insert_cache(MODEL_KEY, list(tokens), cache)

    def stats(self) -> PrefixCacheStats:
        disk = self.disk
        return PrefixCacheStats(self.hits, self.cached_tokens, self._lru.nbytes, len(self._lru),
                                disk_tokens=disk.restored_tokens if disk else 0, disk_hits=self.disk_hits,
                                disk_bytes=disk.nbytes if disk else 0, lookups=self.lookups,
                                prefilled_tokens=self.prefilled_tokens)
