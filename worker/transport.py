"""The worker's sockets: DEALERs to the gateway, CURVE-encrypted over tcp://."""

from __future__ import annotations

import zmq
import zmq.auth

from protocol.curve_keys import load_secret_key
from protocol.worker_settings import WorkerSettings


class TransportError(Exception):
    pass


def connect(context: zmq.Context, settings: WorkerSettings, identity: str) -> zmq.Socket:
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.IDENTITY, identity.encode())
    # Never queue messages for a gateway that is not there yet: a Hello
    # sent into the void would arrive stale.
    socket.setsockopt(zmq.IMMEDIATE, 1)
    # No high-water mark: at the default one ZeroMQ would drop step outputs
    # (tokens) while the gateway is slow to read them.
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    if settings.worker_endpoint.startswith("tcp://"):
        if not settings.curve_secret_key or not settings.curve_server_key:
            raise TransportError(
                "a tcp:// gateway endpoint must be encrypted: give the worker --curve-secret-key FILE "
                "(its own .key_secret) and --curve-server-key FILE (the gateway's .key)"
            )
        try:
            public, secret = load_secret_key(settings.curve_secret_key)
            server_public, _ = zmq.auth.load_certificate(settings.curve_server_key)
        except ValueError as e:
            raise TransportError(str(e)) from None
        except OSError as e:
            raise TransportError(f"cannot read the CURVE keys: {e}") from None
        socket.curve_secretkey = secret
        socket.curve_publickey = public
        socket.curve_serverkey = server_public
    try:
        socket.connect(settings.worker_endpoint)
    except zmq.ZMQError as e:
        raise TransportError(f"cannot connect to --worker-endpoint {settings.worker_endpoint}: {e}") from None
    return socket
