"""The gateway's ZeroMQ end of the worker link: one ROUTER socket, its frames in
and out, and word of connections that close.

The gateway binds; workers connect a DEALER each (plus one for their heartbeat
thread), whose identity names the worker. An ipc endpoint lives in a private
(0700) directory and is refused while another gateway listens on it; a tcp
endpoint needs CURVE (gateway/curve.py).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from gateway.curve import secure_server
from protocol import ToWorker, encode_frames
from protocol.endpoints import runtime_dir
from protocol.private_dir import own_directory

log = logging.getLogger("mlxd.gateway.link")


class EndpointInUse(Exception):
    """Another gateway already listens on the worker endpoint."""


def ipc_listener_alive(path: str) -> bool:
    """Whether something accepts connections on this Unix socket. ZeroMQ
    would silently take over the path of a live one (a second gateway would
    steal the first one's workers); a stale file left by a crash is fine."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True


# A plain int: `&` with pyzmq's enum member makes a new enum member every time
# (1 µs against 0.09 µs; a few times per worker step).
_POLLIN = int(zmq.POLLIN)


class _Reader:
    """Hands every message waiting on a plain ZeroMQ socket to a callback, on
    the event loop, whenever the socket's descriptor signals.

    pyzmq's asyncio sockets make and resolve futures for every message, and a
    task awaiting each message costs a task switch more; here the loop's own
    callback for the descriptor takes the messages. That is one step's
    message from the worker each time, most of the gateway's wakes."""

    def __init__(self, socket: zmq.Socket, handle: Callable[[list[bytes]], None]) -> None:
        self._socket = socket
        self._handle = handle
        self._loop = asyncio.get_running_loop()
        self._stopped = False
        self._loop.add_reader(socket.FD, self.drain)
        # ZeroMQ signals a message's arrival only to a reader that has found
        # the socket empty since: look once now, or the first may never wake it.
        self.drain_soon()

    def drain(self) -> None:
        """Hand over each message that is in (none once stopped: a drain may
        have been scheduled before)."""
        # Reading EVENTS also lets ZeroMQ process what woke the descriptor
        # (which otherwise stays readable); it signals a change, not a state.
        while not self._stopped and int(self._socket.getsockopt(zmq.EVENTS)) & _POLLIN:
            frames = self._socket.recv_multipart(zmq.NOBLOCK)
            try:
                self._handle(frames)
            except Exception:  # one bad message must not stop the others: nothing would call again for them
                log.exception("handling a message from a worker failed")

    def drain_soon(self) -> None:
        """Drain once the caller is done: also after a send, which may have
        taken the descriptor's signal of a message that arrived meanwhile."""
        self._loop.call_soon(self.drain)

    def stop(self) -> None:
        self._stopped = True
        self._loop.remove_reader(self._socket.FD)


# The largest frame a worker sends: a Hello with its tokenizer's and
# processor's files (tens of MB for the largest vocabularies), or embeddings
# (2,048 vectors of 8,192 floats: 64 MiB). A peer sending more is disconnected.
MAX_FRAME_BYTES = 128 << 20


class Transport:
    def __init__(self, endpoint: str, curve_secret_key: str | None = None,
                 curve_authorized_keys: str | None = None) -> None:
        self.endpoint = endpoint
        self._curve = (curve_secret_key, curve_authorized_keys)
        self._authenticator: ThreadAuthenticator | None = None
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # A ROUTER silently drops what exceeds its high-water mark; nothing
        # here may be dropped, so there is none.
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        # A send to a peer whose connection is gone fails (EHOSTUNREACH)
        # instead of vanishing: that is how a closed connection is tied to
        # its worker (see closed_connection).
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # ZeroMQ reads a whole frame before CURVE has checked who sent it: a
        # peer on the network without a key could make it hold gigabytes.
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._frames: _Reader | None = None
        self._closes: _Reader | None = None
        self._closed: asyncio.Queue[None] = asyncio.Queue()

    @property
    def ipc(self) -> bool:
        return self.endpoint.startswith("ipc://")

    def bind(self) -> None:
        """Take the endpoint, before serving. Raises EndpointInUse if another
        gateway has it, RuntimeError for an unsafe socket directory, CurveError
        for tcp without usable keys."""
        if self.ipc:
            path = self.endpoint[len("ipc://") :]
            directory = Path(path).parent
            try:
                # Only the default directory is made private here: one the operator names (their home,
                # a shared runtime directory) is refused if others may write to it, never changed.
                own_directory(directory, parents=True, tighten=directory == runtime_dir())
            except ValueError as e:
                raise RuntimeError(f"refusing to put the worker socket there: {e}") from None
            if ipc_listener_alive(path):
                raise EndpointInUse(f"another gateway is already listening on {self.endpoint}")
        elif self.endpoint.startswith("tcp://"):
            self._authenticator = secure_server(self._context, self._socket, *self._curve)
        try:
            self._socket.bind(self.endpoint)
        except zmq.ZMQError as e:
            if e.errno == errno.EADDRINUSE:
                raise EndpointInUse(f"{self.endpoint} is already in use") from None
            raise RuntimeError(f"cannot listen on --worker-endpoint {self.endpoint}: {e}") from None

    def send(self, identity: bytes, message: ToWorker, buffers: Sequence[Any] = ()) -> bool:
        """Send a message (and its tensors' buffers); False when the peer's
        connection is gone. Never blocks (no high-water mark): the send is
        done, or failed, on return."""
        try:
            self._socket.send_multipart([identity, *encode_frames(message, buffers)], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as error:
            if error.errno != errno.EHOSTUNREACH:
                raise
            return False
        finally:
            if self._frames is not None:
                self._frames.drain_soon()
        return True

    def listen(self, handle: Callable[[bytes, bytes], None]) -> None:
        """From now on, call handle(identity, frame) for each message from a
        worker, from the event loop, as it arrives."""
        self._frames = _Reader(self._socket, lambda frames: handle(frames[0], frames[1]))

    def stop_listening(self) -> None:
        """No more messages from workers (the first step of closing)."""
        if self._frames is not None:
            self._frames.stop()

    async def closed_connection(self) -> None:
        """Returns when a worker's connection closes. Which one it was, ZeroMQ
        does not say: a send to it then fails (see send)."""
        if self._closes is None:
            self._closes = _Reader(self._monitor, lambda _: self._closed.put_nowait(None))
        await self._closed.get()

    def close(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
        self._socket.disable_monitor()
        for receiver in (self._frames, self._closes):
            if receiver is not None:
                receiver.stop()
        self._monitor.close()
        self._socket.close()
        self._context.term()
