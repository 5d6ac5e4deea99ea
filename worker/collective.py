"""What the ranks of a worker that is an mx.distributed group say to each
other, over MLX's own collectives (ring over TCP, JACCL over Thunderbolt).

Rank 0 alone talks to the gateway. At every point where its engine takes
input, it broadcasts what the engine is to apply (a GroupStep); every rank
applies the same GroupStep and runs the same batched step of the sharded
model, so the ranks' engines stay identical: the same requests, caches and
batch. Main thread only, on every rank.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import zlib
from typing import TypeVar

import mlx.core as mx
import msgspec
import numpy as np
from mlx_lm.generate import generation_stream

from protocol import Abort, AddRequest, KVFootprint, Rank, RequestOutput
from worker.embed import EmbedPiece

log = logging.getLogger("mlxd.worker.group")

# The first collective of a broadcast carries this many bytes: a step's usual
# input (nothing, or an abort) fits, and only a new prompt needs a second one.
HEADER_BYTES = 256
LENGTH_BYTES = 4
# While the group has no work, rank 0 waits this long for the gateway's next
# message and the others sleep as long: MLX's collectives spin while they
# wait, so an idle group would otherwise burn a core per rank.
IDLE_SLOT_S = 0.025


class GroupLost(RuntimeError):
    """Another rank of the group is gone: MLX failed an exchange, or handed back garbage."""


class GroupStep(msgspec.Struct, kw_only=True):
    """What every rank's engine applies before its next step, in this order."""

    aborts: list[Abort] = []
    adds: list[AddRequest] = []
    embeds: list[EmbedPiece] = []
    stop: bool = False  # rank 0 is done: the group exits
    # Of the tokens rank 0's last step drew and the requests it ended
    # (tokens_checksum): a rank that drew others holds another history in its
    # shard of the KV cache, and one that ended others runs another batch.
    checksum: int = 0


def tokens_checksum(outputs: list[RequestOutput]) -> int:
    return zlib.crc32(_step_encoder.encode([(o.request_id, o.token_ids, o.finish_reason) for o in outputs]))


class RankSetup(msgspec.Struct, frozen=True):
    """One rank's setup, gathered as soon as its model is loaded: before
    anything runs the sharded model, whose collectives ranks of other shapes
    would not meet."""

    rank: Rank
    # Each rank loads the model from its own host's files and runs it with its own install and
    # flags: digests of what must be alike, by part (worker.start.rank_setup).
    setup: dict[str, str]
    failure: str = ""  # why this rank could not load the model (then no setup)


class RankState(msgspec.Struct, frozen=True):
    """One rank's facts, gathered once the ranks are known to be alike."""

    weights_bytes: int
    kv_footprint: KVFootprint
    prefix_cache_bytes: int  # --prefix-cache-bytes: rank 0's sizes every rank's (prefix_cache_budget)


_step_encoder = msgspec.msgpack.Encoder()
_step_decoder = msgspec.msgpack.Decoder(GroupStep)
T = TypeVar("T", RankSetup, RankState)


class RankChannel:
    """This rank's end of the group's control traffic."""

    def __init__(self, group: mx.distributed.Group) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self._exchanging_since: float | None = None  # set while this rank waits at an exchange

    def watch(self, stall_s: float) -> None:
        """End this process once an exchange has waited `stall_s` for the
        other ranks: one of them is gone. From the first exchange after the
        model is loaded on (ranks load at their own pace); a thread of its
        own, which never calls MLX. When a rank dies, MLX's ring backend
        leaves some of the others waiting in a collective for good, alive,
        so that their service never starts them again and the group never
        forms anew."""
        threading.Thread(target=self._watch, args=(stall_s,), name="mlxd-group-watch", daemon=True).start()
        log.info("rank %d of %d serving: it exits should another rank keep it waiting %gs", self.rank, self.size,
                 stall_s)

    def _watch(self, stall_s: float) -> None:
        while True:
            time.sleep(min(1.0, stall_s / 4))
            since = self._exchanging_since
            if since is not None and (waited := time.monotonic() - since) > stall_s:
                log.error("rank %d waited %.0fs for the other ranks of its group (--group-stall-s): one is gone; "
                          "exiting", self.rank, waited)
                logging.shutdown()
                os._exit(1)

    def _all_sum(self, data: np.ndarray) -> np.ndarray:
        # A rank's collectives must reach the wire in the same order on every
        # rank: the model's run on mlx-lm's generation stream, which may still
        # be computing the step it started asynchronously. Wait for it first.
        mx.synchronize(generation_stream)
        self._exchanging_since = time.monotonic()
        try:
            return np.array(mx.distributed.all_sum(mx.array(data), group=self.group, stream=mx.cpu))
        except RuntimeError as e:  # "[ring] connection to a peer was lost"
            raise GroupLost(f"rank {self.rank}: the group's exchange failed ({e}): another rank is gone") from None
        finally:
            self._exchanging_since = None

    def broadcast(self, data: bytes = b"") -> bytes:
        """Rank 0's `data` on every rank (the others pass nothing): a sum in
        which only rank 0's bytes are not zero."""
        header = np.zeros(HEADER_BYTES, np.uint8)
        if self.rank == 0:
            header[:LENGTH_BYTES] = np.frombuffer(len(data).to_bytes(LENGTH_BYTES, "little"), np.uint8)
            if len(data) <= HEADER_BYTES - LENGTH_BYTES:
                header[LENGTH_BYTES:LENGTH_BYTES + len(data)] = np.frombuffer(data, np.uint8)
        header = self._all_sum(header)
        length = int.from_bytes(header[:LENGTH_BYTES].tobytes(), "little")
        if length <= HEADER_BYTES - LENGTH_BYTES:
            return header[LENGTH_BYTES:LENGTH_BYTES + length].tobytes()
        body = np.frombuffer(data, np.uint8) if self.rank == 0 else np.zeros(length, np.uint8)
        return self._all_sum(body).tobytes()

    def share(self, step: GroupStep | None = None) -> GroupStep:
        """Rank 0 passes the step its engine is about to apply; every rank gets it."""
        shared = self.broadcast(_step_encoder.encode(step) if step is not None else b"")
        try:
            return _step_decoder.decode(shared)
        except msgspec.DecodeError:  # what MLX's ring hands back once a rank is gone
            raise GroupLost(f"rank {self.rank}: the group's step came garbled: another rank is gone") from None

    def common_prefix(self, reused: int, trimmable: bool) -> int:
        """The prompt prefix every rank reuses for a new request, from the
        length this rank's prefix cache found and whether its cache can be
        cut shorter: the shortest any rank found, if every rank that found
        more can cut to it; else none."""
        found = np.zeros((self.size, 2), np.int64)
        found[self.rank] = (reused, trimmable)
        found = self._all_sum(found)
        shortest = int(found[:, 0].min())
        return shortest if all(cut for length, cut in found if length > shortest) else 0

    def meet_load_barrier(self) -> None:
        """Meet the other ranks at the barrier that ends their load (mlx-lm's
        sharded_load), which this rank's failed load never reached: they then
        gather setups with it and hear why it failed, not that it is gone."""
        mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu, group=self.group))

    def gather(self, state: T) -> list[T]:
        """Every rank's `state` (a RankSetup or a RankState), in rank order, on every rank."""
        data = _step_encoder.encode(state)
        lengths = self._all_sum(np.eye(self.size, dtype=np.int64)[self.rank] * len(data))
        if lengths.min() < 0 or lengths.max() > 1 << 24:
            raise GroupLost(f"rank {self.rank}: the ranks' setups came garbled: another rank is gone")
        mine = np.zeros((self.size, int(lengths.max())), np.uint8)
        mine[self.rank, :len(data)] = np.frombuffer(data, np.uint8)
        rows = self._all_sum(mine)
        try:
            return [msgspec.msgpack.decode(rows[r, :lengths[r]].tobytes(), type=type(state)) for r in range(self.size)]
        except msgspec.DecodeError:
            raise GroupLost(f"rank {self.rank}: the ranks' setups came garbled: another rank is gone") from None


def this_rank(rank: int) -> Rank:
    return Rank(rank=rank, host=socket.gethostname(), pid=os.getpid())


def group_differences(states: list[RankSetup]) -> str:
    """The parts of their setup in which the ranks differ, with each host's
    digest of each; empty if none."""
    differing = []
    for part in dict.fromkeys(part for s in states for part in s.setup):
        digests = [s.setup.get(part, "none") for s in states]
        if len(set(digests)) > 1:
            hosts = ", ".join(f"{s.rank.host} {digest[:12]}" for s, digest in zip(states, digests))
            differing.append(f"{part} ({hosts})")
    return "; ".join(differing)


def prefix_cache_budget(states: list[RankState], rank: int, context_length: int) -> int:
    """A rank's prefix-cache budget: rank 0's, scaled by what a cached
    sequence costs on this rank against rank 0, at the length where it costs
    this rank the most (short ones weigh fixed-size state, long ones full
    attention), for the ranks' caches to keep and drop mostly the same
    prompts; common_prefix settles where they differ. Every rank has a cache
    if rank 0 has one."""
    budget = states[0].prefix_cache_bytes
    if not budget:
        return 0
    mine, first = states[rank].kv_footprint, states[0].kv_footprint
    lengths = {1, context_length, *(min(window, context_length) for _, window in (*mine.windowed, *first.windowed))}
    share = max(mine.bytes_for(n) / max(first.bytes_for(n), 1) for n in lengths)
    return max(1, int(budget * share))


def summed_footprint(states: list[RankState]) -> KVFootprint:
    """The group's KV bytes per request: each rank holds its shard's."""
    footprints = [s.kv_footprint for s in states]
    windowed = tuple(w for f in footprints for w in f.windowed)
    return KVFootprint(sum(f.per_token for f in footprints), windowed, sum(f.fixed for f in footprints))
