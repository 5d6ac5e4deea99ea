"""The worker's serving loop, on the main thread (worker/start.py starts it).

Each turn: stop if a drain is over, greet the gateway until welcomed, take
every waiting message (without blocking while there is work) and apply aborts
then adds, embed a piece of the oldest embeddings request (as many inputs as
the step's budget for side work holds, or a part of an input longer than
that), run one engine step, and send one StepOutput for the whole batch. An
embeddings request of thousands of inputs, or of one input of a whole
context, so goes in pieces between steps: the running streams keep their
pace, and the step counter that tells the gateway the worker is not hung
keeps moving.
Messages that arrive during a step are read at once, so that nothing is sent
for a request aborted meanwhile, and applied at the start of the next turn.

A drain (on SIGTERM or SIGINT): the worker tells the gateway it is Draining,
runs its requests for up to --drain-s, then hands back the unfinished ones in
its Goodbye, for the gateway to resume on the next worker, and exits 0.

In a worker that is an mx.distributed group (worker/collective.py), this loop
runs on rank 0, which broadcasts each turn's engine input; every other rank
runs a Follower, which applies the same input and steps the same batch.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import zmq

from protocol import (
    Abort,
    AddRequest,
    Draining,
    Embed,
    Embeddings,
    Error,
    Goodbye,
    Heartbeat,
    Hello,
    ProtocolError,
    Refused,
    StepOutput,
    ToWorker,
    Welcome,
    decode_to_worker,
    encode,
)
from protocol.worker_settings import WorkerSettings
from worker.audit import AffinityAudit
from worker.collective import IDLE_SLOT_S, GroupStep, RankChannel, tokens_checksum
from worker.embed import Embedder, EmbedPiece
from worker.engine import Engine, InvalidRequest
from worker.footprint import memory_stats
from worker.heartbeat import HeartbeatThread
from worker.sampling import GREEDY_BELOW
from worker.transport import connect
from worker.vision import chunk_size, fitted_cost

log = logging.getLogger("mlxd.worker")

IDLE_POLL_MS = 100
HELLO_RETRY_S = 0.25


class GatewayRefused(Exception):
    pass


@dataclass
class EmbeddingJob:
    """An embeddings request being embedded a piece a turn."""

    request: Embed
    vectors: np.ndarray | None = None  # a row per input, filled as pieces are done
    embedded: int = 0  # inputs done
    read: int = 0  # tokens of the next input read already (in parts)

    def next_piece(self, cost: Callable[[int], float], budget: float, part: Callable[[int], int]) -> EmbedPiece:
        """The next inputs, as many as `budget` holds at `cost` (of an input of
        n tokens), one at least; or, where the next input alone costs more than
        the budget, its next part, of `part(tokens left)` tokens."""
        request_id, inputs = self.request.request_id, self.request.inputs
        first = inputs[self.embedded]
        if self.read or cost(len(first)) > budget:
            end = self.read + part(len(first) - self.read)
            return EmbedPiece(request_id=request_id, inputs=[first[self.read:end]], continues=self.read > 0,
                              ends=end == len(first))
        end = self.embedded + 1
        spent = cost(len(first))
        while end < len(inputs) and spent + cost(len(inputs[end])) <= budget:
            spent += cost(len(inputs[end]))
            end += 1
        return EmbedPiece(request_id=request_id, inputs=inputs[self.embedded:end])

    def done(self, piece: EmbedPiece, vectors: list[np.ndarray]) -> bool:
        """Take a piece's vectors (one per input it ended); whether every input is embedded now."""
        if vectors:
            if self.vectors is None:
                self.vectors = np.empty((len(self.request.inputs), len(vectors[0])), "<f4")
            self.vectors[self.embedded:self.embedded + len(vectors)] = vectors
            self.embedded += len(vectors)
        self.read = 0 if piece.ends else self.read + len(piece.inputs[-1])
        return self.embedded == len(self.request.inputs)


def input_seconds(timed: Sequence[tuple[int, float]]) -> Callable[[int], float]:
    """What embedding an input of n tokens takes, from the latest inputs' tokens
    and seconds: a forward pass's own cost (on a GPU, about a decode step's,
    whatever its length) and its cost per token, fitted; unbounded while none
    is timed (a piece then holds one input)."""
    cost = fitted_cost(timed)
    if cost is None:
        return lambda n: math.inf
    fixed, per_token = cost
    return lambda n: fixed + per_token * n


class EngineRunner:
    """What every rank does with a turn's engine input. Only rank 0 (a Worker)
    has a gateway to send to."""

    def __init__(self, engine: Engine, embedder: Embedder | None, channel: RankChannel | None) -> None:
        self.engine = engine
        self.embedder = embedder  # None: the model cannot embed
        self.channel = channel  # None: a worker of one process
        self.checksum = 0  # of the tokens the last step drew, in a group
        self.pieces = 0  # embedding pieces done: progress, as steps are
        self.embed_timed: deque[tuple[int, float]] = deque(maxlen=16)  # the latest inputs' tokens and seconds

    def send(self, message) -> None:
        """A rank other than 0 has no one to tell: rank 0 tells the gateway the same."""

    def apply(self, step: GroupStep, buffers: Sequence[Sequence[memoryview]] = ()) -> None:
        """Aborts, then adds (`buffers`: each add's tensors' bytes, which rank
        0 alone has; a group serves no images), then embeddings."""
        aborted = [r for a in step.aborts for r in a.request_ids]
        if aborted:
            self.engine.abort(aborted)
            log.debug("aborted %s after step %d", " ".join(aborted), self.engine.steps)
        for add, tensors in zip(step.adds, buffers or [()] * len(step.adds), strict=True):
            try:
                self.engine.add(add, tensors)
            except InvalidRequest as e:
                self.send(Error(add.request_id, str(e)))
            except Exception as e:  # a request the engine could not take must not take the others' worker down
                if self.channel is not None:
                    raise  # but a group's ranks would part ways, as for a step
                log.exception("could not add request %s", add.request_id)
                self.send(Error(add.request_id, f"the worker could not take the request: {e}"))
        for piece in step.embeds:
            self.embedded(piece, self._embed(piece))
        if not step.embeds and self.embedder is not None:
            self.embedder.close()  # an input left in part: its request was aborted

    def _embed(self, piece: EmbedPiece) -> list[np.ndarray] | Exception:
        """Between steps: the running requests wait for it, as for a prefill
        chunk. The vectors of the inputs that end in this piece."""
        assert self.embedder is not None  # rank 0 refuses embeddings a model cannot make
        try:
            vectors = []
            last = len(piece.inputs) - 1
            for i, token_ids in enumerate(piece.inputs):  # each timed: what sizes the next pieces
                started = time.perf_counter()
                vector = self.embedder.read(token_ids, piece.continues and i == 0, piece.ends or i < last)
                self.embed_timed.append((len(token_ids), time.perf_counter() - started))
                if vector is not None:
                    vectors.append(vector)
            return vectors
        except Exception as e:  # a failed embedding must not take the running requests' worker down
            if self.channel is not None:
                raise  # but a group's ranks would part ways inside the model's collectives, as for a step
            log.exception("embedding failed")
            return e
        finally:
            self.pieces += 1

    def embedded(self, piece: EmbedPiece, result: list[np.ndarray] | Exception) -> None:
        """A rank other than 0 has no one to tell: rank 0 answers the request."""


class Follower(EngineRunner):
    """A rank other than 0: rank 0's turns, mirrored. Every rank's engine
    holds the same requests, so has_work is alike on all of them and the
    ranks meet at the same collectives in the same order."""

    def __init__(self, engine: Engine, embedder: Embedder | None, channel: RankChannel) -> None:
        super().__init__(engine, embedder, channel)
        self.group = channel

    def run(self) -> int:
        step = GroupStep()
        while True:
            # As long as rank 0 waits for the gateway, which it does not while it embeds.
            if not self.engine.has_work and not step.embeds:
                time.sleep(IDLE_SLOT_S)
            step = self.group.share()
            if step.stop:
                return 0
            if step.checksum != self.checksum:  # garbage would follow: the group restarts, its requests resume
                raise RuntimeError(f"rank {self.group.rank} drew other tokens than rank 0 in step {self.engine.steps}")
            self.apply(step)
            if self.engine.has_work:
                # A failure ends this rank, and so the group: the ranks would part ways.
                self.checksum = tokens_checksum(self.engine.step())


class Worker(EngineRunner):
    def __init__(self, settings: WorkerSettings, engine: Engine, hello: Hello, audit: AffinityAudit | None,
                 embedder: Embedder | None = None, channel: RankChannel | None = None):
        super().__init__(engine, embedder, channel)
        self.settings = settings
        self.hello = hello
        self.audit = audit
        self.welcomed = False
        self.drain_deadline: float | None = None
        self.handed_back: list[str] = []
        self._announced_drain = False
        self._next_hello = 0.0
        self._late: list = []  # messages read during the last step, for the next turn
        self._embedding: deque[EmbeddingJob] = deque()  # in the order they came
        self.memory = memory_stats()  # read by the main thread after each step, sent by the heartbeat's
        self._context = zmq.Context()
        self.socket = connect(self._context, settings, f"worker-{hello.epoch}")
        self.socket.setsockopt(zmq.LINGER, 1000)
        # A gateway restarted (launchd's kickstart) knows nothing of this worker:
        # when the connection drops, the Hello goes out again until welcomed.
        self._connection = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    def send(self, message) -> None:
        try:
            self.socket.send(encode(message), zmq.NOBLOCK)
        except zmq.Again:
            log.debug("gateway not reachable; dropped a %s message", type(message).__name__)

    def receive(self, timeout_ms: int) -> list:
        """Every message waiting now, each with the buffers of its tensors
        (an AddRequest's images), blocking up to timeout_ms for the first."""
        messages: list[tuple[ToWorker, list[memoryview]]] = []
        if not self.socket.poll(timeout_ms):
            return messages
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return messages
            try:
                messages.append(decode_to_worker([f.buffer for f in frames]))
            except ProtocolError as e:
                log.warning("rejected an unreadable message: %s", e)
                self.send(Error(None, f"unreadable message: {e}"))

    def handle(self, messages: list) -> None:
        """This turn's messages: the handshake's handled here, the engine's
        input applied (by every rank of a group)."""
        step = GroupStep(checksum=self.checksum)
        buffers = []
        # Aborts first (the engine applies them before the adds): a request
        # added and then aborted in the same batch of messages never reaches
        # the engine; one aborted and then added again (resumed) does.
        last_abort = {r: i for i, (m, _) in enumerate(messages) if isinstance(m, Abort) for r in m.request_ids}
        aborted = set(last_abort)
        if aborted:
            step.aborts.append(Abort(sorted(aborted)))
            self._embedding = deque(job for job in self._embedding if job.request.request_id not in aborted)
        for i, (message, tensors) in enumerate(messages):
            match message:
                case AddRequest(request_id=request_id) if last_abort.get(request_id, -1) > i:
                    pass
                case AddRequest(request_id=request_id) if self.drain_deadline is not None:
                    self.handed_back.append(request_id)  # crossed our Draining on the wire
                case AddRequest():
                    step.adds.append(self._seeded(message))
                    buffers.append(tensors)
                case Embed(request_id=request_id) if self.embedder is None:
                    self.send(Error(request_id, "this model cannot embed (a vision model, or one whose "
                                                "sentence-transformers files ask for pooling mlxd does not do: "
                                                "the worker's log says which)"))
                case Embed(request_id=request_id, inputs=[]):
                    self.send(Error(request_id, "no inputs to embed"))
                case Embed(request_id=request_id, inputs=inputs) if not all(
                        i and min(i) >= 0 and max(i) < self.engine.vocab_size for i in inputs):
                    # The gateway checks them; an id past the embedding table would end the process (MLX).
                    self.send(Error(request_id, f"an input is empty or holds a token id outside the vocabulary "
                                                f"(size {self.engine.vocab_size})"))
                case Embed(request_id=request_id) if request_id not in aborted:
                    self._embedding.append(EmbeddingJob(message))
                case Welcome(epoch=epoch) if epoch == self.hello.epoch and not self.welcomed:
                    self.welcomed = True  # a Welcome may come once per Hello sent
                    log.info("welcomed by the gateway")
                case Refused(reason=reason):
                    raise GatewayRefused(reason)
        if self._embedding:
            step.embeds.append(self._next_piece())
        if self.channel is not None:
            self.channel.share(step)
        self.apply(step, buffers)

    def _next_piece(self) -> EmbedPiece:
        """The oldest embeddings request's next inputs: what the step's budget
        for side work holds at the latest inputs' pace, or with nothing
        decoding, inputs worth a prefill chunk of tokens; a longer input in
        parts sized as a prompt's chunks are (worker.vision.chunk_size)."""
        job = self._embedding[0]
        budget = self.engine.side_work_budget()
        chunk = self.settings.prefill_chunk

        def part(left: int) -> int:
            return chunk_size(budget, self.embed_timed, chunk, left)

        if budget == math.inf:
            return job.next_piece(float, chunk, part)
        return job.next_piece(input_seconds(self.embed_timed), budget, part)

    def embedded(self, piece: EmbedPiece, result: list[np.ndarray] | Exception) -> None:
        job = self._embedding[0]  # the piece is the oldest job's, taken this turn
        if isinstance(result, Exception):
            self._embedding.popleft()
            self.send(Error(piece.request_id, f"embedding failed: {result}", internal=True))
            return
        if job.done(piece, result):
            self._embedding.popleft()
            assert job.vectors is not None
            self.send(Embeddings(piece.request_id, int(job.vectors.shape[1]), job.vectors.tobytes()))

    def _seeded(self, request: AddRequest) -> AddRequest:
        """In a group, a sampled request without a seed gets one of rank 0's
        choosing: every rank draws the same tokens from the same logits."""
        sampling = request.sampling
        if self.channel is None or sampling.temperature < GREEDY_BELOW or sampling.seed is not None:
            return request
        seeded = msgspec.structs.replace(sampling, seed=random.getrandbits(63))
        return msgspec.structs.replace(request, sampling=seeded)

    def step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            if self.channel is not None:
                raise  # a group's ranks would part ways: it goes down as one worker, and its requests resume
            # A failed step must not take the other requests' worker down.
            log.exception("engine step failed; failing every active request")
            for request_id in self.engine.abort_all(failed=True):
                self.send(Error(request_id, f"engine step failed: {e}"))
            return
        finally:  # requests whose own image work failed in the step, whether the rest of it went well or not
            for request_id, why in self.engine.failed:
                self.send(Error(request_id, why))
            self.engine.failed.clear()
        if self.channel is not None:
            self.checksum = tokens_checksum(outputs)
        self.memory = memory_stats()
        self._late = self.receive(0)
        aborted = {r for m, _ in self._late if isinstance(m, Abort) for r in m.request_ids}
        outputs = [o for o in outputs if o.request_id not in aborted]
        if outputs:
            self.send(StepOutput(self.engine.steps, outputs))

    def heartbeat(self) -> Heartbeat:
        """Heartbeat thread: a snapshot of plain counters, no MLX."""
        return Heartbeat(
            epoch=self.hello.epoch,
            # Embedding pieces are progress and work too: a worker embedding is not hung, nor idle.
            step=self.engine.steps + self.pieces,
            running=self.engine.running + len(self._embedding),
            waiting=self.engine.waiting,
            affinity=self.audit.report() if self.audit else None,
            prefix_cache=self.engine.cache_stats(),
            memory=self.memory,
            cpu_s=time.process_time() if self.channel is None else None,
        )

    def drain(self, drain_s: float) -> None:
        """Signal handler: stop admitting; finish or hand back within drain_s."""
        if self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + drain_s

    def run(self) -> int:
        """The busy loop, as named steps: stop when done, greet the gateway,
        take input, run one engine step."""
        heartbeat = HeartbeatThread(
            connect(self._context, self.settings, f"worker-{self.hello.epoch}-heartbeat"),
            self.settings.heartbeat_s,
            self.heartbeat,
        )
        heartbeat.start()
        status, clean = 0, False
        try:
            while self._keep_running():
                self._greet()
                self.handle(self._take_late() + self.receive(self._poll_ms()))
                if self.engine.has_work:
                    self.step()
            clean = True
        except GatewayRefused as e:
            log.error("the gateway refused this worker: %s", e)
            status, clean = 2, True
        finally:
            heartbeat.stop()
            self._say_goodbye(clean)
        if self.channel is not None:  # the other ranks wait at this turn's broadcast: they exit too
            self.channel.share(GroupStep(stop=True))
        return status

    def _take_late(self) -> list:
        late, self._late = self._late, []
        return late

    def _poll_ms(self) -> int:
        """How long this turn waits for the gateway: not at all while there is work."""
        if self.engine.has_work or self._late or self._embedding:
            return 0
        return round(IDLE_SLOT_S * 1000) if self.channel is not None else IDLE_POLL_MS

    def _keep_running(self) -> bool:
        """False once a drain is over: its work finished, or its time is up."""
        if self.settings.parent_pid is not None and os.getppid() != self.settings.parent_pid:
            log.warning("the process that started this worker is gone; stopping")
            self.drain(0)
        if self.drain_deadline is None:
            return True
        if not self._announced_drain:
            self.send(Draining("the worker is stopping"))
            self._announced_drain = True
        return (self.engine.has_work or bool(self._embedding)) and time.monotonic() < self.drain_deadline

    def _greet(self) -> None:
        """Until welcomed, (re)send the Hello: the gateway may not be there yet,
        or be another since the connection dropped (a gateway that only lost
        the connection for a moment answers with the Welcome it gave)."""
        if self._connection.poll(0):
            while self._connection.poll(0):
                self._connection.recv_multipart()
            if self.welcomed:
                log.info("the connection to the gateway dropped; saying Hello again")
            self.welcomed = False
            # Its embeddings requests failed there with the connection: nobody awaits them now.
            self._embedding.clear()
        now = time.monotonic()
        if not self.welcomed and now >= self._next_hello:
            self.send(self.hello)
            self._next_hello = now + HELLO_RETRY_S

    def _say_goodbye(self, clean: bool) -> None:
        """Hand back the requests that never reached the engine (crossed a
        Draining, or read after the last step), and the engine's own after a
        drain or a refusal. After a failure the engine's go back as lost: the
        gateway resumes a request once at most after a loss, and one that
        failed the worker (a group's step fails the group) must not restart
        it without end."""
        if clean:  # what the gateway sent before it read our Draining has not been read yet: never run
            self._late += self.receive(0)
        self.handed_back += [m.request_id for m, _ in self._late if isinstance(m, AddRequest)]
        if clean:
            self.handed_back += self.engine.abort_all()
        if self.handed_back:
            log.info("handing %d unfinished requests back to the gateway", len(self.handed_back))
        self.send(Goodbye("the worker is stopping" if clean else "the worker failed", self.handed_back, clean))
        self.socket.disable_monitor()
        self._connection.close()
        self.socket.close()
        self._context.term()
