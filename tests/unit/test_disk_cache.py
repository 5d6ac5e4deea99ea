"""The disk tier's blocks: written whole, read back only under the same chain
of keys, evicted least recently used first, dropped when damaged."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import time

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from worker.disk_cache import BLOCK_TOKENS, MAGIC, DiskCache, chain_keys, layout_of, open_directory

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


LAYOUT = layout_of(kv_cache(1))


def written(directory, budget: int, tokens: list[int], cache: list, identity: bytes = IDENTITY) -> DiskCache:
    disk = DiskCache(directory, budget, identity, layout_of(cache))
    disk.save(tokens, cache)
    disk.close()  # everything queued is on disk
    return disk


def failing(monkeypatch, call: str, suffix: str, code: int) -> None:
    """os.<call> fails with `code` (EIO: a disk that fails to answer; ENOSPC: a full one) for the paths
    ending in `suffix`, and works for the rest."""
    real = getattr(os, call)

    def fail(path, *args, **kwargs):
        if str(path).endswith(suffix):
            raise OSError(code, os.strerror(code), str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, call, fail)


def block_files(directory) -> list:
    return list(directory.rglob("*.kv"))


def test_blocks_come_back_as_they_went_in(tmp_path):
    tokens = list(range(3 * BLOCK_TOKENS + 10))
    cache = kv_cache(len(tokens))
    written(tmp_path, 1 << 30, tokens, cache)
    assert len(block_files(tmp_path)) == 3  # whole blocks only
    restored, length = DiskCache(tmp_path, 1 << 30, IDENTITY, LAYOUT).restore(tokens, 0)
    assert length == 3 * BLOCK_TOKENS and restored is not None
    for mine, theirs in zip(restored, cache):
        assert mine.offset == length
        assert mx.array_equal(mine.keys, theirs.keys[..., :length, :])
        assert mx.array_equal(mine.values, theirs.values[..., :length, :])
        assert (mine.keys.dtype, mine.values.dtype) == (mx.bfloat16, mx.float16)
    # Only a chain longer than what the caller already has is worth reading.
    assert DiskCache(tmp_path, 1 << 30, IDENTITY, LAYOUT).restore(tokens, 3 * BLOCK_TOKENS) == (None, 0)


def test_a_block_matches_only_behind_the_same_tokens_and_model(tmp_path):
    tokens = list(range(2 * BLOCK_TOKENS))
    written(tmp_path, 1 << 30, tokens, kv_cache(len(tokens)))
    other_start = [7] + tokens[1:]  # the second block's tokens are the same, its chain is not
    assert DiskCache(tmp_path, 1 << 30, IDENTITY, LAYOUT).restore(other_start, 0) == (None, 0)
    assert DiskCache(tmp_path, 1 << 30, b"model-b", LAYOUT).restore(tokens, 0) == (None, 0)
    _, length = DiskCache(tmp_path, 1 << 30, IDENTITY, LAYOUT).restore(tokens[:BLOCK_TOKENS + 5], 0)
    assert length == BLOCK_TOKENS


def test_a_block_matches_only_in_the_scope_it_was_kept_in(tmp_path):
    """One API key's prompts are no other key's (AddRequest.cache_scope), after a restart too."""
    tokens = list(range(2 * BLOCK_TOKENS))
    disk = DiskCache(tmp_path, 1 << 30, IDENTITY, LAYOUT)
    disk.save(tokens, kv_cache(len(tokens)), "alice")
    disk.close()
    reader = DiskCache(tmp_path, 1 << 30, IDENTITY, LAYOUT)
    assert reader.restore(tokens, 0, "bob") == reader.restore(tokens, 0) == (None, 0)
    assert reader.restore(tokens, 0, "alice")[1] == 2 * BLOCK_TOKENS


def block_bytes(tmp_path, cache) -> int:
    written(tmp_path / "probe", 1 << 30, list(range(BLOCK_TOKENS)), cache)
    return block_files(tmp_path / "probe")[0].stat().st_size


def test_a_chain_longer_than_the_budget_keeps_its_first_blocks(tmp_path):
    tokens = list(range(4 * BLOCK_TOKENS))
    cache = kv_cache(len(tokens))
    block = block_bytes(tmp_path, cache)
    written(tmp_path / "kv", 2 * block, tokens, cache)
    files = block_files(tmp_path / "kv")
    assert len(files) == 2 and sum(f.stat().st_size for f in files) <= 2 * block
    assert DiskCache(tmp_path / "kv", 2 * block, IDENTITY, LAYOUT).restore(tokens, 0)[1] == 2 * BLOCK_TOKENS


def test_eviction_trims_a_chain_from_its_end(tmp_path):
    """A chain read back keeps its first blocks longest: evicting one of them
    would leave the rest of the chain on disk, counted, and out of reach."""
    used, other = list(range(3 * BLOCK_TOKENS)), list(range(5000, 5000 + 2 * BLOCK_TOKENS))
    cache = kv_cache(len(used))
    block = block_bytes(tmp_path, cache)
    written(tmp_path / "kv", 4 * block, used, cache)
    disk = DiskCache(tmp_path / "kv", 4 * block, IDENTITY, LAYOUT)
    assert disk.restore(used, 0)[1] == 3 * BLOCK_TOKENS
    disk.save(other, cache)  # one block of `used` must go
    disk.close()
    assert len(block_files(tmp_path / "kv")) == 4
    assert DiskCache(tmp_path / "kv", 4 * block, IDENTITY, LAYOUT).restore(used, 0)[1] == 2 * BLOCK_TOKENS


def test_a_chain_written_after_another_is_evicted_from_its_end_too(tmp_path):
    """Written, not read back: blocks are counted in the chain's order, and its
    first one must still be the last of it to go."""
    first, second = list(range(3 * BLOCK_TOKENS)), list(range(5000, 5000 + 2 * BLOCK_TOKENS))
    cache = kv_cache(len(first))
    block = block_bytes(tmp_path, cache)
    disk = DiskCache(tmp_path / "kv", 4 * block, IDENTITY, LAYOUT)
    disk.save(first, cache)
    disk.save(second, cache)  # one block of `first` must go
    disk.close()
    assert DiskCache(tmp_path / "kv", 4 * block, IDENTITY, LAYOUT).restore(first, 0)[1] == 2 * BLOCK_TOKENS


@pytest.mark.parametrize("start", [0, 1000, 2000, 3000])  # other tokens, other keys: their names sort otherwise
def test_the_order_of_a_chain_outlives_the_worker(tmp_path, start):
    """After a restart (the order read from the files' times, which blocks written a moment apart
    would share) a chain still loses its last blocks first."""
    first, second = list(range(start, start + 3 * BLOCK_TOKENS)), list(range(5000, 5000 + BLOCK_TOKENS))
    cache = kv_cache(len(first))
    block = block_bytes(tmp_path, cache)
    written(tmp_path / "kv", 3 * block, first, cache)
    written(tmp_path / "kv", 3 * block, second, cache)  # a new worker: one block of `first` must go
    assert DiskCache(tmp_path / "kv", 3 * block, IDENTITY, LAYOUT).restore(first, 0)[1] == 2 * BLOCK_TOKENS


def test_a_chain_broken_by_a_failed_write_writes_no_more_of_itself(tmp_path, monkeypatch):
    """The blocks after one that could not be written are out of reach: written, they would take room."""
    tokens = list(range(4 * BLOCK_TOKENS))
    cache = kv_cache(len(tokens))
    replace, calls = os.replace, []

    def second_fails(source, target):
        calls.append(target)
        if len(calls) == 2:
            raise OSError(errno.EIO, "injected")
        replace(source, target)

    monkeypatch.setattr(os, "replace", second_fails)
    written(tmp_path / "kv", 1 << 30, tokens, cache)
    assert len(calls) == 2 and len(block_files(tmp_path / "kv")) == 1
    assert DiskCache(tmp_path / "kv", 1 << 30, IDENTITY, LAYOUT).restore(tokens, 0)[1] == BLOCK_TOKENS


def test_a_directory_removed_while_the_worker_runs_is_made_again(tmp_path):
    tokens = list(range(2 * BLOCK_TOKENS))
    cache = kv_cache(len(tokens))
    disk = DiskCache(open_directory(tmp_path / "kv"), 1 << 30, IDENTITY, LAYOUT)
    shutil.rmtree(tmp_path / "kv")
    disk.save(tokens, cache)
    disk.close()
    assert len(block_files(tmp_path / "kv")) == 2


def test_models_sharing_a_directory_keep_to_their_own_blocks(tmp_path):
    """One model's writes never evict another's blocks, nor count them against its budget."""
    tokens = list(range(2 * BLOCK_TOKENS))
    cache = kv_cache(len(tokens))
    block = block_bytes(tmp_path, cache)
    written(tmp_path / "kv", 2 * block, tokens, cache)
    assert written(tmp_path / "kv", 2 * block, tokens, cache, identity=b"model-b").nbytes == 2 * block
    assert len(block_files(tmp_path / "kv")) == 4
    assert DiskCache(tmp_path / "kv", 2 * block, IDENTITY, LAYOUT).restore(tokens, 0)[1] == 2 * BLOCK_TOKENS


def test_a_directory_that_cannot_serve_says_why(tmp_path):
    made = open_directory(tmp_path / "new" / "kv")
    assert made.is_dir() and made.stat().st_mode & 0o777 == 0o700
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is not a directory"):
        open_directory(tmp_path / "file")
    with pytest.raises(OSError):
        open_directory(tmp_path / "file" / "kv")
    # Blocks of the layout before each model had a directory of its own are nobody's now; an operator's
    # own files that end in .kv are not blocks.
    (made / ("0" * 64 + ".kv")).write_bytes(MAGIC + b"old")
    (made / ("1" * 64 + ".kv")).write_bytes(b"someone else's")
    (made / "notes.kv").write_bytes(MAGIC)
    open_directory(made)
    assert sorted(p.name for p in made.iterdir()) == ["1" * 64 + ".kv", "notes.kv"]


def garbage(path, _tokens) -> None:
    path.write_bytes(b"not a block at all")


def truncated(path, _tokens) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def of_another_layout(path, tokens) -> None:
    """A sound file (its checksum holds) whose arrays are not its chain's shape."""
    c = KVCache()
    c.update_and_fetch(mx.zeros((1, 1, len(tokens), 8)), mx.zeros((1, 1, len(tokens), 8)))
    other = written(path.parent.parent.parent / "other", 1 << 30, tokens, [c]).directory
    path.write_bytes((other / path.name).read_bytes())


@pytest.mark.parametrize("damage", [garbage, truncated, of_another_layout])
def test_a_damaged_or_foreign_block_ends_the_chain_and_is_removed(tmp_path, damage):
    tokens = list(range(3 * BLOCK_TOKENS))
    disk = written(tmp_path / "kv", 1 << 30, tokens, kv_cache(len(tokens)))
    chain = [disk.directory / f"{key}.kv" for key in chain_keys(IDENTITY, tokens)]
    damage(chain[1], tokens)
    restored, length = DiskCache(tmp_path / "kv", 1 << 30, IDENTITY, LAYOUT).restore(tokens, 0)
    assert length == BLOCK_TOKENS and restored is not None and restored[0].keys.shape[2] == BLOCK_TOKENS
    assert not chain[1].exists() and chain[0].exists()


def test_workers_sharing_a_directory_read_each_others_blocks(tmp_path):
    tokens = list(range(2 * BLOCK_TOKENS))
    reader = DiskCache(tmp_path, 1 << 30, IDENTITY, LAYOUT)  # started before the other wrote anything
    written(tmp_path, 1 << 30, tokens, kv_cache(len(tokens)))
    _, length = reader.restore(tokens, 0)
    assert length == 2 * BLOCK_TOKENS
    assert reader.nbytes == sum(f.stat().st_size for f in block_files(tmp_path))


def test_a_chain_another_worker_wrote_is_evicted_from_its_end_too(tmp_path):
    """Read back by a worker that did not write it, the chain enters its count
    first to last: the touch must come after, or its first block went first."""
    used, other = list(range(4 * BLOCK_TOKENS)), list(range(5000, 5000 + BLOCK_TOKENS))
    cache = kv_cache(len(used))
    block = block_bytes(tmp_path, cache)
    reader = DiskCache(tmp_path / "kv", 4 * block, IDENTITY, LAYOUT)  # started before the other wrote anything
    written(tmp_path / "kv", 4 * block, used, cache)
    assert reader.restore(used, 0)[1] == 4 * BLOCK_TOKENS
    reader.save(other, cache)  # one block of `used` must go
    reader.close()
    assert DiskCache(tmp_path / "kv", 4 * block, IDENTITY, LAYOUT).restore(used, 0)[1] == 3 * BLOCK_TOKENS


def test_a_disk_that_fails_to_answer_is_a_miss(tmp_path, monkeypatch):
    """EIO (a failing external disk, a stale network mount) from looking a block up ended the worker."""
    tokens = list(range(2 * BLOCK_TOKENS))
    written(tmp_path, 1 << 30, tokens, kv_cache(len(tokens)))
    disk = DiskCache(tmp_path, 1 << 30, IDENTITY, LAYOUT)
    failing(monkeypatch, "stat", ".kv", errno.EIO)
    assert disk.restore(tokens, 0) == (None, 0)


def test_a_block_that_fails_to_queue_gives_its_room_back(tmp_path, monkeypatch):
    """An error evaluating a block (out of memory) left its reservation of the write queue held for good:
    a few of them, and nothing was written again."""
    tokens = list(range(BLOCK_TOKENS))
    disk = DiskCache(tmp_path, 1 << 30, IDENTITY, LAYOUT)
    evaluate = mx.eval

    def failing(*arrays):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(mx, "eval", failing)
    with pytest.raises(RuntimeError):
        disk.save(tokens, kv_cache(len(tokens)))
    monkeypatch.setattr(mx, "eval", evaluate)
    disk.save(tokens, kv_cache(len(tokens)))
    disk.close()
    assert len(block_files(tmp_path)) == 1


def test_a_file_gone_while_a_worker_starts_is_skipped(tmp_path):
    """Another worker on the directory renames and removes files while this
    one lists them: a name whose file is gone by its stat (here a dangling
    link, of a block and of a temporary file) is skipped, not fatal."""
    tokens = list(range(BLOCK_TOKENS))
    directory = written(tmp_path, 1 << 30, tokens, kv_cache(len(tokens))).directory
    (directory / ("0" * 64 + ".kv")).symlink_to(tmp_path / "gone.kv")
    (directory / ("1" * 64 + ".1234.tmp")).symlink_to(tmp_path / "gone.tmp")
    disk = DiskCache(tmp_path, 1 << 30, IDENTITY, LAYOUT)
    assert disk.restore(tokens, 0)[1] == BLOCK_TOKENS


def test_the_directories_are_this_users_own_and_never_a_link(tmp_path):
    """A directory someone else could write, or a link planted where one goes, would let them plant
    blocks, or turn the worker's chmod, writes and removals onto their own choice of files."""
    shared = tmp_path / "shared"  # /tmp, say: refused, never closed to everyone else
    shared.mkdir()
    shared.chmod(0o1777)
    with pytest.raises(ValueError, match="writable by other users"):
        open_directory(shared)
    assert shared.stat().st_mode & 0o7777 == 0o1777
    readable = tmp_path / "readable"  # an operator's mkdir: left as it is, the model's directories in it are 0700
    readable.mkdir()
    readable.chmod(0o755)
    assert open_directory(readable).stat().st_mode & 0o777 == 0o755
    assert written(readable, 1 << 30, [], kv_cache(1)).directory.stat().st_mode & 0o777 == 0o700
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="symbolic link"):
        open_directory(tmp_path / "link")
    # The model's own directory in it (named by its identity), planted as a link, a file, or another's.
    model_dir = written(tmp_path / "kv", 1 << 30, [], kv_cache(1)).directory
    model_dir.rmdir()
    model_dir.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="symbolic link"):
        DiskCache(tmp_path / "kv", 1 << 30, IDENTITY, LAYOUT)
    assert (tmp_path / "elsewhere").stat().st_mode & 0o777 != 0o700  # never chmodded through the link
    model_dir.unlink()
    model_dir.write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        DiskCache(tmp_path / "kv", 1 << 30, IDENTITY, LAYOUT)
    if os.getuid() == 0:  # root can hand a directory to another user
        model_dir.unlink()
        model_dir.mkdir()
        os.chown(model_dir, 65534, 65534)
        with pytest.raises(ValueError, match="another user"):
            DiskCache(tmp_path / "kv", 1 << 30, IDENTITY, LAYOUT)


def test_a_link_planted_at_the_temporary_name_is_not_written_through(tmp_path):
    tokens = list(range(BLOCK_TOKENS))
    disk = DiskCache(tmp_path, 1 << 30, IDENTITY, LAYOUT)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (disk.directory / f"{chain_keys(IDENTITY, tokens)[0]}.{os.getpid()}.tmp").symlink_to(victim)
    disk.save(tokens, kv_cache(len(tokens)))
    disk.close()
    assert victim.read_text() == "precious"
    assert DiskCache(tmp_path, 1 << 30, IDENTITY, LAYOUT).restore(tokens, 0)[1] == BLOCK_TOKENS


def test_a_fifo_at_a_blocks_name_ends_the_chain_at_once(tmp_path):
    """Its read never ended: the main thread, and every stream, waited on it."""
    tokens = list(range(2 * BLOCK_TOKENS))
    disk = written(tmp_path, 1 << 30, tokens, kv_cache(len(tokens)))
    second = disk.directory / f"{chain_keys(IDENTITY, tokens)[1]}.kv"
    second.unlink()
    os.mkfifo(second)
    assert DiskCache(tmp_path, 1 << 30, IDENTITY, LAYOUT).restore(tokens, 0)[1] == BLOCK_TOKENS
    assert not second.exists()


def test_a_sound_block_of_another_layout_is_never_restored(tmp_path):
    """Checked only against its chain's first block, a first block of another model's layout (its checksum
    holds) was restored: fewer layers gave wrong answers, other head sizes failed every request in the step."""
    tokens = list(range(2 * BLOCK_TOKENS))
    disk = written(tmp_path / "kv", 1 << 30, tokens, kv_cache(len(tokens)))
    for layers, other in ((3, kv_cache(len(tokens), layers=3)), (2, kv_cache(len(tokens), layers=2, seed=1))):
        if layers == 2:  # the same layers, another head size
            for c in other:
                c.keys = mx.concatenate([c.keys, c.keys], axis=-1)
        foreign = written(tmp_path / f"other{layers}", 1 << 30, tokens, other).directory
        for key in chain_keys(IDENTITY, tokens):
            shutil.copy(foreign / f"{key}.kv", disk.directory / f"{key}.kv")
        assert DiskCache(tmp_path / "kv", 1 << 30, IDENTITY, LAYOUT).restore(tokens, 0) == (None, 0)
        assert not (disk.directory / f"{chain_keys(IDENTITY, tokens)[0]}.kv").exists()


def test_a_smaller_budget_is_kept_from_the_start(tmp_path):
    """Restarted with a smaller --prefix-cache-disk-bytes, the directory stayed over it until a write."""
    tokens = list(range(4 * BLOCK_TOKENS))
    cache = kv_cache(len(tokens))
    block = block_bytes(tmp_path, cache)
    written(tmp_path / "kv", 1 << 30, tokens, cache)
    smaller = DiskCache(tmp_path / "kv", 2 * block, IDENTITY, LAYOUT)
    assert smaller.nbytes <= 2 * block and len(block_files(tmp_path / "kv")) == 2
    assert smaller.restore(tokens, 0)[1] == 2 * BLOCK_TOKENS  # the chain's first blocks stayed


def test_a_write_a_crash_cut_short_is_removed_when_the_next_worker_starts(tmp_path):
    disk = DiskCache(tmp_path, 1 << 30, IDENTITY, LAYOUT)
    ended = subprocess.Popen(["true"])
    dead = ended.pid if ended.wait() == 0 else None
    cut_short = disk.directory / f"{'a' * 64}.{dead}.tmp"
    writing = disk.directory / f"{'b' * 64}.{os.getppid()}.tmp"  # a live worker's, still being written
    cut_short.write_bytes(b"half")
    writing.write_bytes(b"half")
    DiskCache(tmp_path, 1 << 30, IDENTITY, LAYOUT)
    assert not cut_short.exists() and writing.exists()


def test_a_full_disk_lowers_the_budget_for_a_while(tmp_path, monkeypatch):
    """It lowered it for good: room made later (by another model, or by hand) was never used again."""
    tokens = list(range(2 * BLOCK_TOKENS))
    cache = kv_cache(len(tokens))
    disk = DiskCache(tmp_path, 1 << 30, IDENTITY, LAYOUT)
    failing(monkeypatch, "open", ".tmp", errno.ENOSPC)
    disk.save(tokens[:BLOCK_TOKENS], cache)
    disk.close()
    assert disk.budget == 0
    monkeypatch.undo()
    monkeypatch.setattr("worker.disk_cache.FULL_DISK_RETRY_S", 0.0)
    disk = DiskCache(tmp_path, 1 << 30, IDENTITY, LAYOUT)
    disk._full_at, disk.budget = time.monotonic() - 1, 0  # as the full disk left it
    disk.save(tokens, cache)
    disk.close()
    assert disk.budget == 1 << 30 and len(block_files(tmp_path)) == 2


def test_a_chain_another_worker_wrote_is_not_evicted_while_it_is_read(tmp_path):
    """Counted as it was read, the chain's own first block (the least recently used until the chain was
    touched) made room for the rest: the blocks after it were out of reach, and the next request missed."""
    tokens = list(range(4 * BLOCK_TOKENS))
    cache = kv_cache(len(tokens))
    block = block_bytes(tmp_path, cache)
    reader = DiskCache(tmp_path / "kv", 3 * block, IDENTITY, LAYOUT)  # a replica, started before the other wrote
    written(tmp_path / "kv", 1 << 30, tokens, cache)  # more than the reader's budget holds
    assert reader.restore(tokens, 0)[1] == 4 * BLOCK_TOKENS
    assert reader.restore(tokens, 0)[1] == 3 * BLOCK_TOKENS  # the chain lost its end, not its start


def test_a_sound_block_is_read_whatever_the_budget(tmp_path):
    """Its size was checked against the budget: a full disk's budget of 0 had every block read as damaged,
    and removed."""
    tokens = list(range(BLOCK_TOKENS))
    written(tmp_path, 1 << 30, tokens, kv_cache(len(tokens)))
    reader = DiskCache(tmp_path, 1 << 30, IDENTITY, LAYOUT)
    reader.budget = 0
    assert reader.restore(tokens, 0)[1] == BLOCK_TOKENS


def test_a_link_at_a_blocks_name_is_removed_as_a_damaged_block_is(tmp_path):
    tokens = list(range(2 * BLOCK_TOKENS))
    disk = written(tmp_path, 1 << 30, tokens, kv_cache(len(tokens)))
    second = disk.directory / f"{chain_keys(IDENTITY, tokens)[1]}.kv"
    second.rename(tmp_path / "elsewhere.kv")
    second.symlink_to(tmp_path / "elsewhere.kv")
    assert DiskCache(tmp_path, 1 << 30, IDENTITY, LAYOUT).restore(tokens, 0)[1] == BLOCK_TOKENS
    assert not second.is_symlink() and (tmp_path / "elsewhere.kv").exists()


def test_an_mrope_models_own_blocks_come_back(tmp_path):
    """Its cache after a token is mRoPE's RopeKVCache: taken for no layout at all, its blocks were written
    and never read back."""
    from worker.vision import RopeKVCache

    tokens = list(range(BLOCK_TOKENS))
    layout = layout_of([RopeKVCache.of(c) for c in kv_cache(1)])
    assert layout == LAYOUT
    disk = DiskCache(tmp_path, 1 << 30, IDENTITY, layout)
    disk.save(tokens, kv_cache(len(tokens)))
    disk.save(list(range(1000, 1000 + BLOCK_TOKENS)), kv_cache(BLOCK_TOKENS, layers=3))  # not its layout: not kept
    disk.close()
    assert len(block_files(tmp_path)) == 1
    assert DiskCache(tmp_path, 1 << 30, IDENTITY, layout).restore(tokens, 0)[1] == BLOCK_TOKENS


def test_a_block_that_cannot_be_read_stays(tmp_path, monkeypatch):
    """A disk that fails to answer (EIO) is a miss; the block, sound for all it says, is not removed."""
    tokens = list(range(BLOCK_TOKENS))
    disk = written(tmp_path, 1 << 30, tokens, kv_cache(len(tokens)))
    block = disk.directory / f"{chain_keys(IDENTITY, tokens)[0]}.kv"
    failing(monkeypatch, "open", ".kv", errno.EIO)
    assert DiskCache(tmp_path, 1 << 30, IDENTITY, LAYOUT).restore(tokens, 0) == (None, 0)
    assert block.exists()
