"""Reuse of KV state across requests that share a prompt prefix.

System prompts, multi-turn chats and agents re-sending their history all
start with tokens the model has seen. Finished (and aborted) requests leave
their KV cache here, in mlx-lm's LRU prompt cache (a token trie with a byte
budget); a new request takes a copy of the longest usable prefix and only
prefills the rest. Main thread only.
"""

from __future__ import annotations

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

from protocol import PrefixCacheStats

MODEL_KEY = "model"  # one model per worker


class PrefixCache:
    def __init__(self, budget_bytes: int) -> None:
        self._lru = LRUPromptCache(max_size=1 << 30, max_bytes=budget_bytes)
        self.hits = 0
        self.cached_tokens = 0

    def take(self, prompt: list[int]) -> tuple[list | None, int]:
        """A copy of the cached KV state for the longest usable prefix of
        `prompt`, and that prefix's length. At least one prompt token is always
        left to prefill, since the step that reads the prompt yields the first
        token."""
        cache, rest = self._lru.fetch_nearest_cache(MODEL_KEY, prompt)
        if cache is not None and not rest:
            if not can_trim_prompt_cache(cache):
                return None, 0
            trim_prompt_cache(cache, 1)
            rest = prompt[-1:]
        if cache is None:
            return None, 0
        reused = len(prompt) - len(rest)
        self.hits += 1
        self.cached_tokens += reused
        return cache, reused

    def keep(self, tokens: list[int], cache: list) -> None:
        """Remember the KV state of `tokens` (a finished or aborted request's)."""
        if tokens and cache:
            self._lru.insert_cache(MODEL_KEY, list(tokens), cache)

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self.hits, self.cached_tokens, self._lru.nbytes, len(self._lru))
