"""One encoder, one decoder per direction. msgpack via msgspec; never pickle."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import msgspec

from protocol.messages import AddRequest, FromWorker, Tensor, ToWorker

_encoder = msgspec.msgpack.Encoder()
_to_worker = msgspec.msgpack.Decoder(ToWorker)
_from_worker = msgspec.msgpack.Decoder(FromWorker)


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version."""


def encode(message: ToWorker | FromWorker) -> bytes:
    return _encoder.encode(message)


# The dtypes a processor's arrays come in, and their sizes in bytes.
TENSOR_DTYPES = {"float32": 4, "float16": 2, "int64": 8, "int32": 4, "uint8": 1, "bool": 1}


def images_key(buffers: Sequence[Any]) -> int:
    """A stand-in token for every image placeholder position in prefix-cache
    keys: negative (no real token id is), and derived from the bytes of the
    request's tensors, so prompts with the same text but other images never
    share KV state."""
    h = hashlib.sha256()
    for b in buffers:
        data = memoryview(b).cast("B")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return -1 - int.from_bytes(h.digest()[:7], "little")


def scoped_images_key(key: int, scope: str) -> int:
    """The images_key() of a request in a prefix-cache scope
    (AddRequest.cache_scope): another scope's KV state and vision features of
    the same images are not its (a hit would show in its time to the first token)."""
    if not scope:
        return key
    digest = hashlib.sha256(key.to_bytes(8, "little", signed=True) + scope.encode()).digest()
    return -1 - int.from_bytes(digest[:7], "little")


def files_digest(files: dict[str, bytes]) -> bytes:
    """One digest of named files' contents, whatever their order: a worker's
    tokenizer files, by which the gateway shares one load and the worker files
    its identity."""
    digest = hashlib.sha256()
    for name, data in sorted(files.items()):
        digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return digest.digest()


def tensor_nbytes(tensor: Tensor) -> int:
    n = TENSOR_DTYPES[tensor.dtype]
    for dim in tensor.shape:
        n *= dim
    return n


def encode_frames(message: ToWorker, buffers: Sequence[Any] = ()) -> list[Any]:
    """A message and the raw buffers of its tensors, as the frames of one
    multipart ZeroMQ message. Buffers go as they are: no copy, no encoding."""
    return [encode(message), *buffers]


def decode_to_worker(frames: Sequence[Any]) -> tuple[ToWorker, list[memoryview]]:
    """A message and the buffers of its tensors, each checked against its
    declared shape and dtype."""
    try:
        message = _to_worker.decode(frames[0])
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(str(e)) from None
    tensors = message.tensors if isinstance(message, AddRequest) else []
    buffers = [memoryview(f) for f in frames[1:]]
    if len(buffers) != len(tensors):
        raise ProtocolError(f"a {type(message).__name__} declaring {len(tensors)} tensors came with "
                            f"{len(buffers)} buffer frames")
    for tensor, buffer in zip(tensors, buffers):
        if tensor.dtype not in TENSOR_DTYPES or any(d < 0 for d in tensor.shape):
            raise ProtocolError(f"tensor {tensor.name!r}: unusable dtype {tensor.dtype!r} or shape {tensor.shape}")
        if buffer.nbytes != tensor_nbytes(tensor):
            raise ProtocolError(f"tensor {tensor.name!r} of shape {tensor.shape} ({tensor.dtype}) needs "
                                f"{tensor_nbytes(tensor)} bytes; its frame has {buffer.nbytes}")
    return message, buffers


def decode_from_worker(frame: bytes) -> FromWorker:
    try:
        message: FromWorker = _from_worker.decode(frame)
        return message
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
