"""One encoder, one decoder per direction. msgpack via msgspec; never pickle."""

from __future__ import annotations

import msgspec

from protocol.messages import FromWorker, ToWorker

_encoder = msgspec.msgpack.Encoder()
_to_worker = msgspec.msgpack.Decoder(ToWorker)
_from_worker = msgspec.msgpack.Decoder(FromWorker)


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version."""


def encode(message: ToWorker | FromWorker) -> bytes:
    return _encoder.encode(message)


def decode_to_worker(frame: bytes) -> ToWorker:
    try:
        return _to_worker.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(str(e)) from None


def decode_from_worker(frame: bytes) -> FromWorker:
    try:
        return _from_worker.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(str(e)) from None


def hello_version(frame: bytes) -> int | None:
    """The protocol version a Hello of any version declares, else None.

    Used when a frame does not decode, to tell a peer of another protocol
    version from garbage.
    """
    try:
        raw = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return None
    if isinstance(raw, list) and len(raw) > 1 and raw[0] == "hello" and isinstance(raw[1], int):
        return raw[1]
    return None
