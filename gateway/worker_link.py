"""The gateway's end of the ZeroMQ link: handshake, dispatch, worker state.

The gateway binds a ROUTER socket; each worker connects a DEALER whose
identity carries its epoch, so messages from a worker that has been replaced
are recognised and ignored.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio

from gateway.generation import Delta, RequestStream
from gateway.tokenizer import Tokenizer, files_digest
from protocol import (
    PROTOCOL_VERSION,
    Abort,
    AddRequest,
    AffinityReport,
    Error,
    Goodbye,
    Heartbeat,
    Hello,
    ProtocolError,
    Refused,
    StepOutput,
    Welcome,
    decode_from_worker,
    encode,
    hello_version,
)

log = logging.getLogger("mlxd.gateway.link")


class WorkerUnavailable(Exception):
    pass


@dataclass
class WorkerState:
    identity: bytes
    hello: Hello
    tokenizer: Tokenizer
    last_seen: float
    steps: int = 0
    running: int = 0
    waiting: int = 0
    affinity: AffinityReport | None = None


def ensure_private_dir(path: Path) -> None:
    """Create `path` 0700, refusing one that is a symlink, not ours, or open to others."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise RuntimeError(f"{path} is not a plain directory; refusing to put the worker socket there")
    if st.st_uid != os.getuid():
        raise RuntimeError(f"{path} belongs to uid {st.st_uid}, not to this user")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)


class WorkerLink:
    def __init__(self, endpoint: str, *, worker_timeout_s: float) -> None:
        self.endpoint = endpoint
        self.worker_timeout_s = worker_timeout_s
        self.worker: WorkerState | None = None
        self.requests: dict[str, RequestStream] = {}
        self._ready = asyncio.Event()
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._detokenizer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlxd-detok")
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        if self.endpoint.startswith("ipc://"):
            ensure_private_dir(Path(self.endpoint[len("ipc://") :]).parent)
        self._socket.bind(self.endpoint)
        self._tasks = [
            asyncio.create_task(self._receive_loop(), name="mlxd-link-receive"),
            asyncio.create_task(self._watchdog(), name="mlxd-link-watchdog"),
        ]
        log.info("waiting for a worker on %s", self.endpoint)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._fail_all("the gateway is shutting down")
        self._socket.close()
        self._context.term()
        self._detokenizer.shutdown(wait=False)

    # ---- used by the HTTP handlers -----------------------------------------

    async def ready_worker(self, timeout_s: float) -> WorkerState:
        try:
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        except TimeoutError:
            raise WorkerUnavailable(f"no worker became ready within {timeout_s:g}s") from None
        assert self.worker is not None
        return self.worker

    def submit(self, stream: RequestStream, request: AddRequest) -> None:
        if self.worker is None:
            raise WorkerUnavailable("the worker went away")
        self.requests[stream.request_id] = stream
        self._send(self.worker.identity, request)

    def abort(self, request_id: str) -> None:
        """Forget the request and tell the worker to drop it. Idempotent."""
        if self.requests.pop(request_id, None) is not None and self.worker is not None:
            self._send(self.worker.identity, Abort([request_id]))

    def status(self) -> dict:
        w = self.worker
        if w is None:
            return {"ready": False}
        state = {
            "ready": True,
            "pid": w.hello.pid,
            "epoch": w.hello.epoch,
            "model": w.hello.model,
            "context_length": w.hello.context_length,
            "capacity": w.hello.capacity,
            "running": w.running,
            "waiting": w.waiting,
            "steps": w.steps,
        }
        if w.affinity is not None:
            state["affinity"] = {
                "evaluations": w.affinity.evaluations,
                "off_main_thread": w.affinity.off_main_thread,
            }
        return state

    # ---- the link itself ---------------------------------------------------

    def _send(self, identity: bytes, message) -> None:
        # ROUTER sends never block: a message to a vanished peer is dropped.
        self._socket.send_multipart([identity, encode(message)], copy=False)

    async def _receive_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            identity, frame = await self._socket.recv_multipart()
            try:
                message = decode_from_worker(frame)
            except ProtocolError as e:
                self._reject(identity, frame, e)
                continue
            if isinstance(message, Hello):
                await self._accept(identity, message)
                continue
            w = self.worker
            if w is None or identity != w.identity:
                continue  # a replaced worker's leftovers
            w.last_seen = time.monotonic()
            if isinstance(message, StepOutput):
                rendered = await loop.run_in_executor(self._detokenizer, self._render, message)
                self._deliver(rendered)
            elif isinstance(message, Heartbeat):
                w.steps, w.running, w.waiting = message.step, message.running, message.waiting
                w.affinity = message.affinity
            elif isinstance(message, Error):
                self._on_error(message)
            elif isinstance(message, Goodbye):
                self._lose_worker(f"the worker said goodbye: {message.reason}")

    def _reject(self, identity: bytes, frame: bytes, error: ProtocolError) -> None:
        version = hello_version(frame)
        if version is not None and version != PROTOCOL_VERSION:
            reason = (
                f"protocol version mismatch: the gateway speaks version {PROTOCOL_VERSION}, "
                f"the worker speaks version {version}"
            )
            log.error("refused a worker: %s", reason)
            self._send(identity, Refused(reason))
        else:
            log.warning("ignored an unreadable message from a worker: %s", error)

    async def _accept(self, identity: bytes, hello: Hello) -> None:
        if hello.protocol_version != PROTOCOL_VERSION:
            reason = (
                f"protocol version mismatch: the gateway speaks version {PROTOCOL_VERSION}, "
                f"the worker speaks version {hello.protocol_version}"
            )
            log.error("refused a worker: %s", reason)
            self._send(identity, Refused(reason))
            return
        w = self.worker
        if w is not None and w.identity == identity:
            self._send(identity, Welcome(hello.epoch))  # our Welcome crossed its retry
            return
        if w is not None and hello.epoch < w.hello.epoch:
            log.warning("ignored a Hello from an older worker (epoch %d)", hello.epoch)
            return
        if w is not None and w.tokenizer.digest == files_digest(hello.tokenizer_files):
            tokenizer = w.tokenizer
        else:
            tokenizer = await asyncio.to_thread(Tokenizer, hello.tokenizer_files)
        if w is not None:
            self._lose_worker("replaced by a newer worker")
        self.worker = WorkerState(identity, hello, tokenizer, last_seen=time.monotonic())
        self._send(identity, Welcome(hello.epoch))
        self._ready.set()
        log.info(
            "worker ready: pid %d, epoch %d, model %s, context %d, capacity %d",
            hello.pid, hello.epoch, hello.model, hello.context_length, hello.capacity,
        )

    def _render(self, step: StepOutput) -> list[tuple[RequestStream, Delta]]:
        """Detokenizer thread: text for every request in one step."""
        rendered = []
        for output in step.outputs:
            stream = self.requests.get(output.request_id)
            if stream is not None and (delta := stream.render(output)) is not None:
                rendered.append((stream, delta))
        return rendered

    def _deliver(self, rendered: list[tuple[RequestStream, Delta]]) -> None:
        for stream, delta in rendered:
            stream.queue.put_nowait(delta)
            if delta.finish_reason is not None:
                if delta.abort_worker:
                    self.abort(stream.request_id)
                else:
                    self.requests.pop(stream.request_id, None)

    def _on_error(self, error: Error) -> None:
        if error.request_id is None:
            log.warning("the worker could not read a message: %s", error.message)
            return
        stream = self.requests.pop(error.request_id, None)
        if stream is not None:
            stream.queue.put_nowait(stream.fail(f"the worker rejected the request: {error.message}", 500))

    def _fail_all(self, message: str) -> None:
        requests, self.requests = self.requests, {}
        for stream in requests.values():
            stream.queue.put_nowait(stream.fail(message, 503))

    def _lose_worker(self, why: str) -> None:
        if self.worker is None:
            return
        log.warning("worker (pid %d) lost: %s", self.worker.hello.pid, why)
        self.worker = None
        self._ready.clear()
        self._fail_all(f"the worker was lost: {why}")

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.worker_timeout_s / 4))
            w = self.worker
            if w is not None and time.monotonic() - w.last_seen > self.worker_timeout_s:
                self._lose_worker(f"no message for {self.worker_timeout_s:g}s")
