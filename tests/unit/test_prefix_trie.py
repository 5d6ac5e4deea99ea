"""The prefix cache's token trie: mlx-lm's search, made linear, finds what mlx-lm's finds."""

import threading

from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import PromptTrie

from worker.prefix_cache import LinearPromptTrie

MODEL = "model"
sequences = st.lists(st.integers(0, 3), min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(cached=st.lists(sequences, min_size=1, max_size=8), dropped=st.lists(sequences, max_size=3),
       queries=st.lists(st.lists(st.integers(0, 3), max_size=14), min_size=1, max_size=6))
def test_the_search_finds_what_mlx_lms_finds(cached, dropped, queries):
    theirs, ours = PromptTrie(), LinearPromptTrie()
    for trie in (theirs, ours):
        for tokens in cached:
            trie.add(MODEL, tokens, tuple(tokens))
        for tokens in dropped:  # as the LRU cache does with the prefixes of what it inserts
            if tokens in cached:
                trie.pop_prefixes(MODEL, tokens)
    for query in queries:
        want, got = theirs.search(MODEL, query), ours.search(MODEL, query)
        assert (got.exact, got.shorter, got.common_prefix) == (want.exact, want.shorter, want.common_prefix)
        if want.longer is None:
            assert got.longer is None
        else:
            # The shortest cached sequence going on from the match: either, where two are as short.
            assert got.longer is not None and len(got.longer) == len(want.longer)
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
