"""CURVE encryption and worker allowlisting for a tcp:// worker endpoint.

A worker on another Mac connects over TCP; the link is then encrypted, and
the gateway accepts only workers whose public keys it lists. Keys are made
with `mlxd keys generate DIR --name NAME` (ZeroMQ certificate files).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from protocol.curve_keys import load_secret_key
from protocol.private_dir import own_directory

log = logging.getLogger("mlxd.gateway.curve")


class CurveError(Exception):
    pass


class WorkerAllowlist:
    """A ZAP credentials provider: allows the listed public keys, logs the rest."""

    def __init__(self, directory: Path) -> None:
        # Not own_directory: an allowlist may be kept by another user (root) and only read here.
        if directory.stat().st_mode & 0o022:
            raise CurveError(f"{directory} is writable by other users, who could authorize a worker of their own "
                             f"there: make it this user's alone (chmod 700 {directory})")
        self.keys = set(zmq.auth.load_certificates(str(directory)))
        if not self.keys:
            raise CurveError(f"no public key files (*.key) in {directory}")

    def callback(self, _domain: str, client_key: bytes) -> bool:
        if client_key in self.keys:
            return True
        log.warning("refused a worker: its CURVE public key %s is not authorized", client_key.decode())
        return False


def secure_server(context: zmq.Context, socket: zmq.Socket, secret_key: str | None,
                  authorized: str | None) -> ThreadAuthenticator:
    """Make `socket` a CURVE server that admits only authorized workers.

    The authenticator answers from a thread of its own, so it is in place
    before the socket binds, even before the event loop runs: a worker that
    connected before it would be let in unchecked."""
    if not secret_key or not authorized:
        raise CurveError(
            "a tcp:// worker endpoint must be encrypted: give the gateway --curve-secret-key FILE and "
            "--curve-authorized-keys DIR (make keys with `mlxd keys generate DIR --name NAME`)"
        )
    try:  # all read before the authenticator's thread starts: a failure must leave none to keep mlxd up
        public, secret = load_secret_key(secret_key)
        allowlist = WorkerAllowlist(Path(authorized))
    except ValueError as e:
        raise CurveError(str(e)) from None
    except OSError as e:
        raise CurveError(f"cannot read the CURVE keys: {e}") from None
    # A plain (not asyncio) context on the same ZeroMQ context, for the thread's sockets.
    authenticator = ThreadAuthenticator(zmq.Context.shadow(context.underlying))
    authenticator.start()
    authenticator.configure_curve_callback("*", credentials_provider=allowlist)
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    socket.curve_server = True
    return authenticator


def generate(directory: Path, name: str) -> tuple[Path, Path]:
    try:
        own_directory(directory, parents=True, tighten=False)  # another user could plant a link where a key goes
    except ValueError as e:
        raise CurveError(str(e)) from None
    # Created private, not made so after: in a directory others can read, they could open it in between.
    umask = os.umask(0o077)
    try:
        public, secret = zmq.auth.create_certificates(str(directory), name)
    finally:
        os.umask(umask)
    Path(public).chmod(0o644)  # to be copied to the other side
    return Path(public), Path(secret)
