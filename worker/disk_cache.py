"""KV state on disk: the prefix cache's second tier, which outlives the worker.

A prompt's KV state is kept in blocks of BLOCK_TOKENS tokens, one file each,
named by a chained key: the SHA-256 of the block before's key (for the first
block, the identity of the model, its tokenizer and chat template) and the
block's token ids. A file so matches only the same tokens from the prompt's
start under the same model. After a restart, or once the RAM tier has let a
prefix go, the longest chain of blocks on disk is read back before the rest is
prefilled.

Each model's blocks live in a directory of their own under the cache
directory (named by its identity), so that models sharing a cache directory
neither count nor evict each other's files; replicas of one model share it.

The main thread copies a block's arrays to bytes (MLX stays on it); a writer
thread, which never calls MLX, writes each file (0600, in a 0700 directory,
under a temporary name first), first removing the least recently used files
that would leave the budget short. A chain is read back deepest block
first and its first block last, so that it is the most recently used:
eviction trims a chain from its end, never leaving blocks no chain can reach.
Reading checks a header, a checksum and the arrays' layout against the
model's own: a corrupt, truncated or foreign file is removed, and the chain
ends before it. Only regular files named as blocks are read, counted or
removed, and the directories must be this user's own, never a symbolic link:
a directory another user could write would let them plant blocks, or links
that turn the worker's writes and removals onto other files. The files of a chain are read,
checked and put together by reader threads (no MLX either), since the main
thread waits for them. A disk that fills up lowers the budget to what it
holds; a file that cannot be removed or written is logged, never fatal.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import math
import os
import queue
import stat
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import msgspec
import numpy as np
from mlx_lm.models.cache import KVCache

from protocol.private_dir import own_directory

log = logging.getLogger("mlxd.worker")

BLOCK_TOKENS = 256
# Bytes of blocks waiting for the writer; beyond it a block stays in RAM only
# (the disk is behind, and the queue must not grow without bound).
QUEUE_BYTES = 256 << 20
MAGIC = b"mlxd-kv1"
SUFFIX = ".kv"
KEY_GLOB = "[0-9a-f]" * 64  # a block's key; its file is KEY + SUFFIX, one being written KEY.PID.tmp
FULL_DISK_RETRY_S = 60.0  # after a full disk lowered the budget, how soon a write tries the whole budget again
READERS = min(8, os.cpu_count() or 1)
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
ITEM_BYTES = {name: dtype.size for name, dtype in DTYPES.items()}  # for the reader threads, which keep off MLX


class CorruptBlock(ValueError):
    pass


class BlockLayout(msgspec.Struct, array_like=True):
    """What a block file's payload holds: each layer's keys, then its values."""

    shapes: list[list[int]]
    dtypes: list[str]


def chain_keys(identity: bytes, tokens: Sequence[int]) -> list[str]:
    """The key of each whole block of `tokens`, in order."""
    keys, parent = [], hashlib.sha256(identity).digest()
    for start in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        parent = hashlib.sha256(parent + np.asarray(tokens[start:start + BLOCK_TOKENS], np.int64).tobytes()).digest()
        keys.append(parent.hex())
    return keys


def _dtype_name(array: mx.array) -> str:
    return str(array.dtype).rsplit(".", 1)[1]


def _layout(arrays: list[mx.array]) -> bytes:
    return msgspec.msgpack.encode(BlockLayout([list(a.shape) for a in arrays], [_dtype_name(a) for a in arrays]))


def layout_of(cache: list) -> BlockLayout | None:
    """The layout of the model's blocks, read off its cache after a token
    (worker.footprint.probe_cache); None for a cache the tier cannot keep
    (layers other than KVCache's, or a kind of it, such as mRoPE models'
    RopeKVCache: it then keeps nothing)."""
    if not cache or not all(isinstance(c, KVCache) for c in cache):
        return None
    arrays = [a for c in cache for a in (c.keys, c.values)]
    return BlockLayout([[*a.shape[:2], BLOCK_TOKENS, a.shape[3]] for a in arrays], [_dtype_name(a) for a in arrays])


def block_payload(arrays: list[mx.array], layout: bytes) -> list[bytes]:
    """A block's payload in pieces: the layout's length, the layout (_layout's
    of the arrays), each array's bytes. On the main thread, which alone calls MLX."""
    return [struct.pack("<I", len(layout)), layout, *(np.asarray(a.view(mx.uint8)).tobytes() for a in arrays)]


def block_file(payload: list[bytes]) -> list[bytes]:
    """A block file in pieces: MAGIC, the SHA-256 of the payload, the payload."""
    digest = hashlib.sha256()
    for part in payload:
        digest.update(part)
    return [MAGIC, digest.digest(), *payload]


class Block(NamedTuple):
    """A block file's contents, checked."""

    layout: BlockLayout
    arrays: list[np.ndarray]  # each as bytes (its last axis widened by the item size), viewing the file's
    file_bytes: int


def file_bytes(layout: BlockLayout) -> int:
    """The size of a block file of this layout."""
    arrays = sum(math.prod(shape) * ITEM_BYTES[name] for shape, name in zip(layout.shapes, layout.dtypes))
    return _header_bytes(msgspec.msgpack.encode(layout)) + arrays


def read_block(path: Path, size: int) -> Block:
    """A block file's contents after its checks (`size`: a block's of the
    model's layout). No MLX: the reader threads run it. A symbolic link, a
    FIFO (whose read would never end) or a device is no block."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CorruptBlock("a symbolic link") from None
        raise
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CorruptBlock("not a regular file")
        if info.st_size != size:
            raise CorruptBlock(f"{info.st_size} bytes, where this model's blocks have {size}")
        data = f.read()
    if len(data) < len(MAGIC) + 36 or not data.startswith(MAGIC):
        raise CorruptBlock("not a block file")
    digest, body = data[len(MAGIC):len(MAGIC) + 32], memoryview(data)[len(MAGIC) + 32:]
    if hashlib.sha256(body).digest() != digest:
        raise CorruptBlock("checksum mismatch")
    (size,) = struct.unpack_from("<I", body)
    try:
        layout = msgspec.msgpack.decode(body[4:4 + size], type=BlockLayout)
        offset, arrays = 4 + size, []
        for shape, name in zip(layout.shapes, layout.dtypes, strict=True):
            if len(shape) != 4 or shape[2] != BLOCK_TOKENS or min(shape) < 0:
                raise ValueError(f"not a block's KV shape: {shape}")
            width = ITEM_BYTES[name]
            nbytes = math.prod(shape) * width
            arrays.append(np.frombuffer(body, np.uint8, nbytes, offset).reshape(*shape[:3], shape[3] * width))
            offset += nbytes
    except (msgspec.DecodeError, KeyError, ValueError) as e:
        raise CorruptBlock(str(e)) from None
    if offset != len(body):
        raise CorruptBlock("payload size mismatch")
    return Block(layout, arrays, len(data))


def open_directory(directory: Path) -> Path:
    """The cache directory, made (0700) if it is not there; an OSError or
    ValueError that says why one cannot serve: not a directory, a symbolic
    link, not this user's, not writable. Run before the model loads: a worker
    that cannot use its directory fails at once with the reason, not after a load."""
    directory = own_directory(directory.expanduser(), parents=True, tighten=False)
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"{directory} is not writable")
    # Blocks of the layout before each model had its own directory: named by their key, starting with MAGIC
    # (an operator's own files that happen to end in .kv stay).
    for path, _ in _stats(directory, KEY_GLOB + SUFFIX):
        with contextlib.suppress(OSError), path.open("rb") as f:
            if f.read(len(MAGIC)) == MAGIC:
                path.unlink(missing_ok=True)
    return directory


class DiskCache:
    def __init__(self, directory: Path, budget_bytes: int, identity: bytes, layout: BlockLayout | None) -> None:
        """directory: one open_directory made ready; the model's blocks go in a
        directory of their own in it (ValueError or OSError if it cannot be
        this user's own); layout: the model's (layout_of)."""
        self.directory = own_directory(directory / hashlib.sha256(identity).hexdigest()[:32], parents=True)
        self.budget = self.whole_budget = budget_bytes
        self.identity = identity
        self.layout = layout
        self._full_at: float | None = None  # when a full disk lowered the budget
        self.restored_tokens = 0
        # Block keys on disk, least recently used first, with their sizes; the
        # writer thread and the main thread share it under the lock, and files
        # are removed under it too, so that a key counted is a file there.
        self._lock = threading.Lock()
        self._files: OrderedDict[str, int] = OrderedDict()
        found = sorted((info.st_mtime_ns, path.stem, info.st_size)
                       for path, info in _stats(self.directory, KEY_GLOB + SUFFIX))
        for _, key, size in found:
            self._files[key] = size
        for path, info in _stats(self.directory, KEY_GLOB + ".*.tmp"):
            if _cut_short(path, info):
                path.unlink(missing_ok=True)
        self.nbytes = sum(self._files.values())
        with self._lock:
            self._make_room(0)  # a budget lowered since the files were written
        # Key, payload, queued bytes, the keys of the blocks before it: the writer seals and writes it.
        self._pending: queue.Queue[tuple[str, list[bytes], int, list[str]] | None] = queue.Queue()
        self._queued_bytes = 0
        self._queued: set[str] = set()  # keys handed to the writer, not on disk yet
        self._writer = threading.Thread(target=self._write_loop, name="mlxd-disk-cache", daemon=True)
        self._writer.start()
        # Reading a chain back is the main thread's wait: its files are read,
        # checked and put in place by several threads (none calls MLX).
        self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="mlxd-disk-read")

    def restore(self, tokens: Sequence[int], beyond: int, scope: str = "") -> tuple[list[KVCache] | None, int]:
        """The KV state of the longest chain of blocks on disk that starts
        `tokens` and is longer than `beyond` tokens, and its length; (None, 0)
        when none is. Nothing is read unless the chain is longer: the RAM
        tier usually holds as much, and a read is the main thread's time.
        `scope`: whose blocks (AddRequest.cache_scope)."""
        if self.layout is None:
            return None, 0
        keys = chain_keys(self._root(scope), tokens)
        if len(keys) * BLOCK_TOKENS <= beyond:  # RAM holds as much: the disk's copy is kept fresh, off this thread
            self._readers.submit(self._touch, keys)
            return None, 0
        chain = []
        for key in keys:
            with self._lock:
                known = key in self._files
            # os.path: a disk that fails to answer (EIO, EACCES) is a miss, not an error that ends the worker
            if not os.path.exists(self._path(key)):
                if known:
                    self._forget(key)
                break  # not on disk (another worker on this directory may have written one that is)
            chain.append((key, known))
        if len(chain) * BLOCK_TOKENS <= beyond:
            self._touch([key for key, _ in chain])
            return None, 0
        blocks = self._read_chain(chain)
        # Once read, in the chain's order: blocks another worker wrote enter this one's count first to last,
        # so the touch must follow for the first to be the most recent (eviction trims a chain's end).
        self._touch([key for key, _ in chain[:len(blocks)]])
        with self._lock:
            self._make_room(0)  # blocks another worker wrote, counted now (the chain just read is the most recent)
        length = len(blocks) * BLOCK_TOKENS
        if length <= beyond:
            return None, 0
        arrays = self._assemble(blocks)
        cache = []
        for layer_keys, layer_values in zip(arrays[::2], arrays[1::2]):
            c = KVCache()
            c.keys, c.values, c.offset = layer_keys, layer_values, length
            cache.append(c)
        self.restored_tokens += length
        return cache, length

    def _read_chain(self, chain: list[tuple[str, bool]]) -> list[Block]:
        """The arrays of the chain's blocks, read and checked by the reader
        threads, up to the first that fails its checks (it is removed) or
        cannot be read (a disk that fails to answer: it stays)."""
        assert self.layout is not None
        size = file_bytes(self.layout)
        reads = [self._readers.submit(read_block, self._path(key), size) for key, _ in chain]
        blocks: list[Block] = []
        for (key, known), read in zip(chain, reads):
            try:
                block = read.result()
                if block.layout != self.layout:  # sound, but another model's: never restored as this one's
                    raise CorruptBlock("its layout is not this model's")
            except (OSError, CorruptBlock) as e:
                log.warning("%s prefix-cache block %s: %s", "dropping" if isinstance(e, CorruptBlock) else
                            "cannot read", self._path(key).name, e)
                if isinstance(e, CorruptBlock):
                    self._forget(key)
                for later in reads:
                    later.cancel()
                break
            blocks.append(block)
            if not known:
                with self._lock:
                    if os.path.exists(self._path(key)):  # another worker on the directory may have removed it since
                        self._count(key, block.file_bytes)
        return blocks

    def _assemble(self, blocks: list[Block]) -> list[mx.array]:
        """Each of the blocks' arrays whole, for the whole chain: the reader
        threads copy every block into its place, then MLX takes one copy of each."""
        layout = blocks[0].layout
        whole = [np.empty((*a.shape[:2], len(blocks) * BLOCK_TOKENS, a.shape[3]), np.uint8) for a in blocks[0].arrays]

        def place(index: int) -> None:
            for target, array in zip(whole, blocks[index].arrays):
                target[:, :, index * BLOCK_TOKENS:(index + 1) * BLOCK_TOKENS] = array

        list(self._readers.map(place, range(len(blocks))))
        blocks.clear()  # the files' contents
        return [mx.array(a).view(DTYPES[name]) for a, name in zip(whole, layout.dtypes, strict=True)]

    def save(self, tokens: Sequence[int], cache: list, scope: str = "") -> None:
        """Queue for writing the blocks of `tokens` not on disk yet, from
        `cache` (their KV state), in `scope` (AddRequest.cache_scope). Only
        plain KV caches are kept: a window, a recurrent state or quantized
        keys cannot be cut into blocks here."""
        if not cache or any(type(c) is not KVCache for c in cache) or layout_of(cache) != self.layout:
            return
        with self._lock:
            if self._full_at is not None and time.monotonic() - self._full_at > FULL_DISK_RETRY_S:
                self.budget, self._full_at = self.whole_budget, None  # room may have been made since
        keys = chain_keys(self._root(scope), tokens[:min(c.offset for c in cache)])
        for index, key in enumerate(keys):
            start, end = index * BLOCK_TOKENS, (index + 1) * BLOCK_TOKENS
            arrays = [mx.contiguous(a[..., start:end, :]) for c in cache for a in (c.keys, c.values)]
            size, layout = sum(a.nbytes for a in arrays), _layout(arrays)
            if end // BLOCK_TOKENS * (size + _header_bytes(layout)) > self.budget:
                return  # blocks past what the budget holds of the chain would evict its own first ones
            with self._lock:
                if key in self._files or key in self._queued:
                    continue
                if self._queued_bytes + size > QUEUE_BYTES:
                    return
                self._queued_bytes += size
                self._queued.add(key)
            try:
                mx.eval(arrays)
                payload = block_payload(arrays, layout)
            except BaseException:  # the writer, which gives a reservation back, will never see this one
                with self._lock:
                    self._queued_bytes -= size
                    self._queued.discard(key)
                raise
            self._pending.put((key, payload, size, keys[:index]))

    def _root(self, scope: str) -> bytes:
        """What a chain of `scope` starts from: the model's identity, and the
        scope's name where there is one (the blocks of no scope stay as they were)."""
        return self.identity + b"\0" + scope.encode() if scope else self.identity

    def close(self) -> None:
        """Write what is queued, then stop the writer and the readers."""
        self._pending.put(None)
        self._writer.join()
        self._readers.shutdown()

    def _path(self, key: str) -> Path:
        return self.directory / (key + SUFFIX)

    def _count(self, key: str, size: int) -> None:
        """A file on disk, most recently used; under the lock. It may be
        counted already: a restore can find a block another worker wrote
        while this one's writer writes the same."""
        self.nbytes += size - self._files.pop(key, 0)
        self._files[key] = size

    def _touch(self, keys: list[str]) -> None:
        """The blocks of a chain used now, the first one last (the most
        recently used: eviction takes a chain's last blocks first), on disk
        too, where the order outlives the worker: each block a microsecond
        older than the one before it, since touches a moment apart get the
        same time (a restart would order them by name)."""
        now = time.time_ns()
        for age, key in reversed(list(enumerate(keys))):
            with self._lock:
                if key in self._files:
                    self._files.move_to_end(key)
            try:
                os.utime(self._path(key), ns=(now - age * 1000,) * 2, follow_symlinks=False)
            except OSError:
                pass  # not on disk (yet, or any more): a read ends the chain there

    def _forget(self, key: str) -> None:
        with self._lock:
            self.nbytes -= self._files.pop(key, 0)
            self._remove(key)

    def _remove(self, key: str) -> None:
        """Under the lock (see __init__)."""
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as e:
            log.warning("could not remove prefix-cache block %s: %s", self._path(key).name, e)

    def _make_room(self, size: int) -> None:
        """Remove the least recently used files until `size` more bytes fit the budget; under the lock."""
        while self._files and self.nbytes + size > self.budget:
            old, old_size = self._files.popitem(last=False)
            self.nbytes -= old_size
            self._remove(old)

    def _write_loop(self) -> None:
        while (item := self._pending.get()) is not None:
            key, payload, size, before = item
            try:
                self._write(key, block_file(payload), before)
            except Exception:  # the writer must outlive any one block: the queue's bytes wait on it
                log.exception("could not write prefix-cache block %s", key)
            finally:
                with self._lock:
                    self._queued_bytes -= size
                    self._queued.discard(key)

    def _write(self, key: str, parts: list[bytes], before: list[str]) -> None:
        path, file_bytes = self._path(key), sum(map(len, parts))
        temporary = path.with_suffix(f".{os.getpid()}.tmp")  # replicas of a model may share the directory
        # A block whose chain broke before it (a write failed) is one no lookup reaches: its room
        # would go to the chain's own first blocks.
        if not all(earlier in self._files or self._path(earlier).exists() for earlier in before):
            return
        with self._lock:
            self._make_room(file_bytes)
        try:
            own_directory(self.directory, parents=True)  # removed by hand while the worker runs
            temporary.unlink(missing_ok=True)  # an earlier worker's of the same pid: its write is over
            # A new file, never one there already: a link planted at the name is not followed.
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.writelines(parts)
            os.replace(temporary, path)
        except OSError as e:
            temporary.unlink(missing_ok=True)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                with self._lock:
                    self.budget = self.nbytes  # what this disk holds: later blocks take the oldest's room
                    self._full_at = time.monotonic()
                log.warning("the disk under %s is full: its prefix-cache budget is now %d bytes",
                            self.directory, self.budget)
            else:
                log.warning("could not write prefix-cache block %s: %s", path.name, e)
            return
        with self._lock:
            self._count(key, file_bytes)
        self._touch([*before, key])  # the chain's first block the most recently used, this one the least


def _header_bytes(layout: bytes) -> int:
    """What a block file holds besides its arrays (see block_file and block_payload)."""
    return len(MAGIC) + 32 + 4 + len(layout)


def _stats(directory: Path, pattern: str) -> list[tuple[Path, os.stat_result]]:
    """The regular files matching `pattern` and their stat, but for those
    gone meanwhile (another worker on the directory renames and removes files)."""
    found = []
    for path in directory.glob(pattern):
        try:
            info = path.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISREG(info.st_mode):
            found.append((path, info))
    return found


def _cut_short(path: Path, info: os.stat_result) -> bool:
    """A block's temporary file whose write will never finish: its worker
    (the pid in its name) is not running on this machine (a crash cut it
    short), or it is an hour old."""
    if time.time() - info.st_mtime > 3600:
        return True
    try:
        pid = int(path.suffixes[-2][1:])
        if pid == os.getpid():  # an earlier worker's, of the same pid: this one has written nothing yet
            return True
        os.kill(pid, 0)
    except (ValueError, IndexError, ProcessLookupError):
        return True
    except PermissionError:  # another user's process: alive
        return False
    return False
