"""The prefix cache's look-up: its trie's search finds the matches mlx-lm's finds, in time that does not
grow with what else is cached, and the KV state it hands out holds the match alone."""

import statistics
import threading
import time

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache, PromptTrie, RotatingKVCache

from worker.prefix_cache import LinearPromptTrie, PrefixCache

MODEL = "model"
sequences = st.lists(st.integers(0, 3), min_size=1, max_size=12)


@pytest.mark.parametrize("shortest", [False, True])
@settings(max_examples=300, deadline=None)
@given(cached=st.lists(sequences, min_size=1, max_size=8), dropped=st.lists(sequences, max_size=3),
       queries=st.lists(st.lists(st.integers(0, 3), max_size=14), min_size=1, max_size=6))
def test_the_search_finds_the_matches_mlx_lms_finds(shortest, cached, dropped, queries):
    theirs, ours = PromptTrie(), LinearPromptTrie(shortest)
    for trie in (theirs, ours):
        for tokens in cached:
            trie.add(MODEL, tokens, tuple(tokens))
        for tokens in dropped:  # as the LRU cache does with the prefixes of what it inserts
            if tokens in cached:
                trie.pop_prefixes(MODEL, tokens)
    for query in queries:
        want, got = theirs.search(MODEL, query), ours.search(MODEL, query)
        assert (got.exact, got.shorter, got.common_prefix) == (want.exact, want.shorter, want.common_prefix)
        assert (got.longer is None) == (want.longer is None)
        if got.longer is not None:
            # A cached sequence going on from the match: mlx-lm's is the shortest; any serves, unless shortest.
            assert len(got.longer) >= got.common_prefix
            if shortest:
                assert len(got.longer) == len(want.longer)
            assert got.longer[:got.common_prefix] == query[:got.common_prefix]
            assert ours.get(MODEL, got.longer) == tuple(got.longer)


def test_a_long_unmatched_tail_is_walked_once():
    """A prompt that shares a system prompt with a long cached conversation:
    mlx-lm's search copies the path at each node of the tail, which takes
    minutes for this one; walked once, it takes a fraction of a second."""
    trie = LinearPromptTrie()
    conversation = list(range(100_000))
    trie.add(MODEL, conversation, "cached")
    results = []
    search = threading.Thread(target=lambda: results.append(trie.search(MODEL, conversation[:1000] + [-1])),
                              daemon=True)
    search.start()
    search.join(10)
    assert results, "the search took over 10 s"
    assert results[0].longer == conversation and results[0].common_prefix == 1000


def search_seconds(trie: LinearPromptTrie, prompt: list[int]) -> float:
    times = []
    for _ in range(7):
        started = time.perf_counter()
        trie.search(MODEL, prompt)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def test_a_search_past_a_shared_system_prompt_does_not_walk_every_cached_chat():
    """A new chat whose system prompt 400 cached chats share: the search
    follows one of them down from the match, not all 400 (as a breadth-first
    search for the shortest does), so it takes about as long as beside one
    cached chat."""
    system = list(range(100))
    def chat(i):
        return system + [1000 + i] + list(range(2000, 2300))
    one, many = LinearPromptTrie(), LinearPromptTrie()
    one.add(MODEL, chat(0), 0)
    for i in range(400):
        many.add(MODEL, chat(i), i)
    prompt = system + [-1]
    result = many.search(MODEL, prompt)
    assert result.common_prefix == len(system) and result.longer[:len(system)] == system
    assert many.get(MODEL, result.longer) in range(400)
    alone, beside_many = search_seconds(one, prompt), search_seconds(many, prompt)
    assert beside_many < 20 * alone, f"{beside_many * 1e3:.2f} ms beside 400 chats, {alone * 1e3:.2f} ms beside one"


def test_a_prompt_sharing_a_system_prompt_gets_that_much_kv_state_alone():
    """The cached conversation's KV state serves the new prompt's match: its
    first 100 positions, in buffers that hold no more (sharing the
    conversation's would copy them whole at the first write)."""
    keys, values = mx.random.normal((1, 2, 3000, 8)), mx.random.normal((1, 2, 3000, 8))
    layer = KVCache()
    layer.update_and_fetch(keys, values)
    cache = PrefixCache(1 << 30)
    system = list(range(100))
    cache.keep(system + list(range(1000, 3900)), [layer])
    got, reused = cache.take(system + [-1, -2])
    assert reused == 100
    (taken,) = got
    assert taken.offset == 100 and taken.keys.shape[2] == taken.values.shape[2] == 100
    assert np.array_equal(np.array(taken.keys), np.array(keys[:, :, :100]))
    assert np.array_equal(np.array(taken.values), np.array(values[:, :, :100]))


def rotating(tokens: int, window: int) -> RotatingKVCache:
    layer = RotatingKVCache(max_size=window)
    layer.update_and_fetch(mx.random.normal((1, 1, tokens, 8)), mx.random.normal((1, 1, tokens, 8)))
    return layer


@pytest.mark.parametrize("windowed", [True, False])
def test_a_sliding_window_model_gets_a_short_chat_that_fits_its_window(windowed):
    """Gemma 3's sliding layers can be trimmed to a match only while they fit
    their window: a new chat sharing the system prompt of a cached long
    conversation (cached first) and of a short chat gets its system prompt's
    state from the short one, which the windowed search finds and the other
    does not."""
    cache = PrefixCache(1 << 30, windowed=windowed)
    system = list(range(20))
    cache.keep(system + list(range(100, 200)), [rotating(120, 64)])
    cache.keep(system + [500] + list(range(300, 310)), [rotating(31, 64)])
    _, reused = cache.take(system + [-1])
    assert reused == (len(system) if windowed else 0)
