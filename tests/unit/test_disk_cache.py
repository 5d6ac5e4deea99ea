"""The disk tier's blocks: written whole, read back only under the same chain
of keys, evicted least recently used first, dropped when damaged."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from worker.disk_cache import BLOCK_TOKENS, DiskCache, chain_keys

IDENTITY = b"model-a"


def kv_cache(tokens: int, layers: int = 2, seed: int = 0) -> list[KVCache]:
    mx.random.seed(seed)
    cache = []
    for _ in range(layers):
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, 2, tokens, 8)).astype(mx.bfloat16),
                           mx.random.normal((1, 2, tokens, 4)).astype(mx.float16))
        cache.append(c)
    return cache


def written(directory, budget: int, tokens: list[int], cache: list, identity: bytes = IDENTITY) -> None:
    disk = DiskCache(directory, budget, identity)
    disk.save(tokens, cache)
    disk.close()  # everything queued is on disk


def test_blocks_come_back_as_they_went_in(tmp_path):
    tokens = list(range(3 * BLOCK_TOKENS + 10))
    cache = kv_cache(len(tokens))
    written(tmp_path, 1 << 30, tokens, cache)
    assert len(list(tmp_path.glob("*.kv"))) == 3  # whole blocks only
    restored, length = DiskCache(tmp_path, 1 << 30, IDENTITY).restore(tokens, 0)
    assert length == 3 * BLOCK_TOKENS and restored is not None
    for mine, theirs in zip(restored, cache):
        assert mine.offset == length
        assert mx.array_equal(mine.keys, theirs.keys[..., :length, :])
        assert mx.array_equal(mine.values, theirs.values[..., :length, :])
        assert (mine.keys.dtype, mine.values.dtype) == (mx.bfloat16, mx.float16)
    # Only a chain longer than what the caller already has is worth reading.
    assert DiskCache(tmp_path, 1 << 30, IDENTITY).restore(tokens, 3 * BLOCK_TOKENS) == (None, 0)


def test_a_block_matches_only_behind_the_same_tokens_and_model(tmp_path):
    tokens = list(range(2 * BLOCK_TOKENS))
    written(tmp_path, 1 << 30, tokens, kv_cache(len(tokens)))
    other_start = [7] + tokens[1:]  # the second block's tokens are the same, its chain is not
    assert DiskCache(tmp_path, 1 << 30, IDENTITY).restore(other_start, 0) == (None, 0)
    assert DiskCache(tmp_path, 1 << 30, b"model-b").restore(tokens, 0) == (None, 0)
    _, length = DiskCache(tmp_path, 1 << 30, IDENTITY).restore(tokens[:BLOCK_TOKENS + 5], 0)
    assert length == BLOCK_TOKENS


def test_the_least_recently_used_blocks_go_past_the_budget(tmp_path):
    tokens = list(range(4 * BLOCK_TOKENS))
    cache = kv_cache(len(tokens))
    written(tmp_path / "probe", 1 << 30, tokens[:BLOCK_TOKENS], cache)
    block = next((tmp_path / "probe").glob("*.kv")).stat().st_size
    written(tmp_path / "kv", 2 * block, tokens, cache)
    files = list((tmp_path / "kv").glob("*.kv"))
    assert len(files) == 2 and sum(f.stat().st_size for f in files) <= 2 * block
    # The chain's first blocks went first, so nothing of it can be read back.
    assert DiskCache(tmp_path / "kv", 2 * block, IDENTITY).restore(tokens, 0) == (None, 0)


def garbage(path, _tokens) -> None:
    path.write_bytes(b"not a block at all")


def truncated(path, _tokens) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def of_another_layout(path, tokens) -> None:
    """A sound file (its checksum holds) whose arrays are not its chain's shape."""
    other = path.parent.parent / "other"
    c = KVCache()
    c.update_and_fetch(mx.zeros((1, 1, len(tokens), 8)), mx.zeros((1, 1, len(tokens), 8)))
    written(other, 1 << 30, tokens, [c])
    path.write_bytes((other / path.name).read_bytes())


@pytest.mark.parametrize("damage", [garbage, truncated, of_another_layout])
def test_a_damaged_or_foreign_block_ends_the_chain_and_is_removed(tmp_path, damage):
    tokens = list(range(3 * BLOCK_TOKENS))
    written(tmp_path / "kv", 1 << 30, tokens, kv_cache(len(tokens)))
    chain = [tmp_path / "kv" / f"{key}.kv" for key in chain_keys(IDENTITY, tokens)]
    damage(chain[1], tokens)
    restored, length = DiskCache(tmp_path / "kv", 1 << 30, IDENTITY).restore(tokens, 0)
    assert length == BLOCK_TOKENS and restored is not None and restored[0].keys.shape[2] == BLOCK_TOKENS
    assert not chain[1].exists() and chain[0].exists()


def test_workers_sharing_a_directory_read_each_others_blocks(tmp_path):
    tokens = list(range(2 * BLOCK_TOKENS))
    reader = DiskCache(tmp_path, 1 << 30, IDENTITY)  # started before the other wrote anything
    written(tmp_path, 1 << 30, tokens, kv_cache(len(tokens)))
    _, length = reader.restore(tokens, 0)
    assert length == 2 * BLOCK_TOKENS
    assert reader.nbytes == sum(f.stat().st_size for f in tmp_path.glob("*.kv"))


def test_a_file_gone_while_a_worker_starts_is_skipped(tmp_path):
    """Another worker on the directory renames and removes files while this
    one lists them: a name whose file is gone by its stat (here a dangling
    link, of a block and of a temporary file) is skipped, not fatal."""
    tokens = list(range(BLOCK_TOKENS))
    written(tmp_path, 1 << 30, tokens, kv_cache(len(tokens)))
    (tmp_path / ("0" * 64 + ".kv")).symlink_to(tmp_path / "gone.kv")
    (tmp_path / ("1" * 64 + ".1234.tmp")).symlink_to(tmp_path / "gone.tmp")
    disk = DiskCache(tmp_path, 1 << 30, IDENTITY)
    assert disk.restore(tokens, 0)[1] == BLOCK_TOKENS
