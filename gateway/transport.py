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
import os
import socket
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from gateway.curve import secure_server
from protocol import ToWorker, encode_frames


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


class _Receiver:
    """Frames from a plain ZeroMQ socket, awaited on the event loop.

    pyzmq's asyncio sockets make and resolve futures for every message;
    here a message that is waiting is taken at once, and the loop only
    watches the socket's descriptor while there is none. That halves the
    CPU the gateway spends per message from the worker (one per step)."""

    def __init__(self, socket: zmq.Socket) -> None:
        self._socket = socket
        self._waiting = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(socket.FD, self.signalled)

    def _message_in(self) -> bool:
        # Reading EVENTS also lets ZeroMQ process what woke the descriptor
        # (which otherwise stays readable).
        return bool(int(self._socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

    def signalled(self) -> None:
        """Wake the reader if a message is in. Also called after a send: the
        send may have taken the descriptor's signal of an arriving message."""
        if self._message_in():
            self._waiting.set()

    async def recv_multipart(self) -> list[bytes]:
        while True:
            try:
                return self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                pass
            self._waiting.clear()
            if not self._message_in():  # the descriptor signals a change, not a state
                await self._waiting.wait()

    def stop(self) -> None:
        self._loop.remove_reader(self._socket.FD)


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
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._frames: _Receiver | None = None
        self._closes: _Receiver | None = None

    @property
    def ipc(self) -> bool:
        return self.endpoint.startswith("ipc://")

    def bind(self) -> None:
        """Take the endpoint, before serving. Raises EndpointInUse if another
        gateway has it, RuntimeError for an unsafe socket directory, CurveError
        for tcp without usable keys."""
        if self.ipc:
            path = self.endpoint[len("ipc://") :]
            ensure_private_dir(Path(path).parent)
            if ipc_listener_alive(path):
                raise EndpointInUse(f"another gateway is already listening on {self.endpoint}")
        elif self.endpoint.startswith("tcp://"):
            self._authenticator = secure_server(self._context, self._socket, *self._curve)
        try:
            self._socket.bind(self.endpoint)
        except zmq.ZMQError as e:
            if e.errno == errno.EADDRINUSE:
                raise EndpointInUse(f"{self.endpoint} is already in use") from None
            raise

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
                self._frames.signalled()
        return True

    async def receive(self) -> tuple[bytes, bytes]:
        """The next (identity, frame) from a worker."""
        if self._frames is None:
            self._frames = _Receiver(self._socket)
        identity, frame = await self._frames.recv_multipart()
        return identity, frame

    async def closed_connection(self) -> None:
        """Returns when a worker's connection closes. Which one it was, ZeroMQ
        does not say: a send to it then fails (see send)."""
        if self._closes is None:
            self._closes = _Receiver(self._monitor)
        await self._closes.recv_multipart()

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
