from gateway.affinity import BLOCK_TOKENS, PrefixIndex, prefix_blocks


def test_blocks_of_a_shared_prefix_are_equal_and_diverge_after_it():
    base = list(range(3 * BLOCK_TOKENS))
    longer = prefix_blocks(base + [7] * BLOCK_TOKENS)
    assert longer[:3] == prefix_blocks(base) and len(longer) == 4
    other = base.copy()
    other[BLOCK_TOKENS + 1] = -1  # differs in the second block: so does every later hash
    assert [a == b for a, b in zip(prefix_blocks(other), prefix_blocks(base))] == [True, False, False]
    assert prefix_blocks(base[: BLOCK_TOKENS - 1]) == []  # a partial block is not a prefix anyone caches


def test_the_index_matches_leading_blocks_and_forgets_the_oldest():
    index = PrefixIndex(max_blocks=4)
    first = prefix_blocks(list(range(3 * BLOCK_TOKENS)))
    index.add(first)
    assert index.matched(first) == 3
    assert index.matched(prefix_blocks([9] * BLOCK_TOKENS) + first) == 0  # leading blocks only
    index.add(prefix_blocks([5] * (2 * BLOCK_TOKENS)))  # two more: the first prompt's oldest block goes
    assert index.matched(first) == 0
