"""What the ranks of a worker that is an mx.distributed group say to each
other, over MLX's own collectives (ring over TCP, JACCL over Thunderbolt).

Rank 0 alone talks to the gateway. At every point where its engine takes
input, it broadcasts what the engine is to apply (a GroupStep); every rank
applies the same GroupStep and runs the same batched step of the sharded
model, so the ranks' engines stay identical: the same requests, caches and
batch. Main thread only, on every rank.
"""

from __future__ import annotations

import os
import socket
import zlib

import mlx.core as mx
import msgspec
import numpy as np
from mlx_lm.generate import generation_stream

from protocol import Abort, AddRequest, KVFootprint, Rank, RequestOutput
from worker.embed import EmbedPiece

# The first collective of a broadcast carries this many bytes: a step's usual
# input (nothing, or an abort) fits, and only a new prompt needs a second one.
HEADER_BYTES = 256
LENGTH_BYTES = 4
# While the group has no work, rank 0 waits this long for the gateway's next
# message and the others sleep as long: MLX's collectives spin while they
# wait, so an idle group would otherwise burn a core per rank.
IDLE_SLOT_S = 0.025


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


class RankState(msgspec.Struct, frozen=True):
    """One rank's facts, gathered once after loading."""

    rank: Rank
    weights_bytes: int
    kv_footprint: KVFootprint
    # Each rank loads the model from its own host's files and runs it with its own install and
    # flags: digests of what must be alike, by part (worker.start.rank_setup).
    setup: dict[str, str]
    prefix_cache_bytes: int  # --prefix-cache-bytes: rank 0's sizes every rank's (prefix_cache_budget)


_step_encoder = msgspec.msgpack.Encoder()
_step_decoder = msgspec.msgpack.Decoder(GroupStep)
_state_decoder = msgspec.msgpack.Decoder(RankState)


class RankChannel:
    """This rank's end of the group's control traffic."""

    def __init__(self, group: mx.distributed.Group) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()

    def _all_sum(self, data: np.ndarray) -> np.ndarray:
        # A rank's collectives must reach the wire in the same order on every
        # rank: the model's run on mlx-lm's generation stream, which may still
        # be computing the step it started asynchronously. Wait for it first.
        mx.synchronize(generation_stream)
        return np.array(mx.distributed.all_sum(mx.array(data), group=self.group, stream=mx.cpu))

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
        return _step_decoder.decode(self.broadcast(_step_encoder.encode(step) if step is not None else b""))

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

    def gather(self, state: RankState) -> list[RankState]:
        """Every rank's state, in rank order, on every rank."""
        data = _step_encoder.encode(state)
        lengths = self._all_sum(np.eye(self.size, dtype=np.int64)[self.rank] * len(data))
        width = int(lengths.max())
        mine = np.zeros((self.size, width), np.uint8)
        mine[self.rank, :len(data)] = np.frombuffer(data, np.uint8)
        rows = self._all_sum(mine)
        return [_state_decoder.decode(rows[r, :lengths[r]].tobytes()) for r in range(self.size)]


def this_rank(rank: int) -> Rank:
    return Rank(rank=rank, host=socket.gethostname(), pid=os.getpid())


def group_differences(states: list[RankState]) -> str:
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
