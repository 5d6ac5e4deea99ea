"""Every message round-trips; unreadable frames are rejected, never guessed at."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import (
    PROTOCOL_VERSION,
    Abort,
    AddRequest,
    AffinityReport,
    Draining,
    Error,
    Goodbye,
    Heartbeat,
    Hello,
    ProtocolError,
    Refused,
    RequestOutput,
    Sampling,
    StepOutput,
    Tensor,
    Welcome,
    decode_from_worker,
    decode_to_worker,
    encode,
    encode_frames,
    hello_version,
)

TO_WORKER = [
    Welcome(epoch=7),
    Refused("protocol version mismatch"),
    AddRequest("cmpl-1", [1, 2, 3], Sampling(max_tokens=5)),
    AddRequest(
        "chatcmpl-2",
        [9],
        Sampling(max_tokens=1, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=-3,
                 ignore_eos=True),
    ),
    Abort(["a", "b"]),
]
FROM_WORKER = [
    Hello(PROTOCOL_VERSION, 123, 456, "model", 2048, 384, 32, [2], {"tokenizer.json": b"{}"}),
    StepOutput(3, [RequestOutput("a", [5]), RequestOutput("b", [2], "stop"), RequestOutput("c", [7], "length")]),
    Heartbeat(123, 10, 2, 1),
    Heartbeat(123, 10, 2, 1, AffinityReport(100, 0)),
    Draining("the worker is stopping"),
    Error("cmpl-1", "token id 999 is outside the vocabulary"),
    Error(None, "unreadable message"),
    Goodbye("shutting down"),
    Goodbye("shutting down", ["cmpl-1", "chatcmpl-2"]),
]


@pytest.mark.parametrize("message", TO_WORKER, ids=lambda m: type(m).__name__)
def test_to_worker_round_trip(message):
    assert decode_to_worker([encode(message)]) == (message, [])


@pytest.mark.parametrize("message", FROM_WORKER, ids=lambda m: type(m).__name__)
def test_from_worker_round_trip(message):
    assert decode_from_worker(encode(message)) == message


@given(
    request_id=st.text(max_size=40),
    prompt=st.lists(st.integers(0, 2**31), min_size=1, max_size=50),
    max_tokens=st.integers(1, 2**31),
    temperature=st.floats(0, 2),
    seed=st.none() | st.integers(-(2**63), 2**63 - 1),
)
def test_add_request_round_trip_property(request_id, prompt, max_tokens, temperature, seed):
    message = AddRequest(request_id, prompt, Sampling(max_tokens=max_tokens, temperature=temperature, seed=seed))
    assert decode_to_worker([encode(message)]) == (message, [])


def test_tensors_travel_as_raw_frames():
    pixels = np.arange(2 * 3 * 4 * 4, dtype=np.float32).reshape(2, 3, 4, 4)
    sizes = np.array([[4, 4], [4, 4]], dtype=np.int64)
    message = AddRequest("r", [1, 9, 9, 2], Sampling(max_tokens=3),
                         [Tensor("pixel_values", [2, 3, 4, 4], "float32"), Tensor("image_sizes", [2, 2], "int64")])
    frames = encode_frames(message, [pixels, sizes])
    assert frames[1] is pixels  # no copy, no encoding
    decoded, buffers = decode_to_worker([memoryview(f).cast("B") for f in frames])
    assert decoded == message
    assert np.array_equal(np.frombuffer(buffers[0], np.float32).reshape(2, 3, 4, 4), pixels)
    assert np.array_equal(np.frombuffer(buffers[1], np.int64).reshape(2, 2), sizes)


@pytest.mark.parametrize(
    "tensors, buffers",
    [
        ([Tensor("pixel_values", [2, 2], "float32")], []),  # a frame missing
        ([], [b"\0" * 16]),  # a frame too many
        ([Tensor("pixel_values", [2, 2], "float32")], [b"\0" * 15]),  # short
        ([Tensor("pixel_values", [2, 2], "complex128")], [b"\0" * 64]),  # no such dtype here
        ([Tensor("pixel_values", [-2, -2], "float32")], [b"\0" * 16]),
    ],
)
def test_tensor_frames_that_do_not_match_are_refused(tensors, buffers):
    with pytest.raises(ProtocolError):
        decode_to_worker(encode_frames(AddRequest("r", [1], Sampling(max_tokens=1), tensors), buffers))


def test_directions_do_not_mix():
    with pytest.raises(ProtocolError):
        decode_to_worker([encode(Heartbeat(1, 1, 0, 0))])
    with pytest.raises(ProtocolError):
        decode_from_worker(encode(Abort(["x"])))


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1",  # a byte msgpack never uses
        msgspec.msgpack.encode(["launch_missiles", 1]),
        msgspec.msgpack.encode({"type": "add"}),
        msgspec.msgpack.encode(["add", "id", "not a list", [5]]),
        encode(AddRequest("x", [1, 2], Sampling(max_tokens=3)))[:-3],  # truncated
    ],
)
def test_unreadable_frames_raise_protocol_error(frame):
    with pytest.raises(ProtocolError):
        decode_to_worker([frame])


def test_nothing_is_pickled():
    frame = encode(AddRequest("x", [1], Sampling(max_tokens=1)))
    assert msgspec.msgpack.decode(frame)[0] == "add"
    assert b"\x80\x04" not in frame[:2]  # no pickle protocol header


def test_hello_version_is_readable_across_versions():
    # A future worker's Hello, with fields this version does not know.
    future = msgspec.msgpack.encode(["hello", PROTOCOL_VERSION + 1, 1, 2, "m", {"new": "field"}])
    with pytest.raises(ProtocolError):
        decode_from_worker(future)
    assert hello_version(future) == PROTOCOL_VERSION + 1
    assert hello_version(encode(FROM_WORKER[0])) == PROTOCOL_VERSION
    assert hello_version(b"garbage") is None
    assert hello_version(encode(Goodbye("x"))) is None


def test_the_images_key_the_gateway_sends_is_the_workers_own():
    """The gateway hashes the arrays it made; the worker would hash the frames it received."""
    import numpy as np

    from protocol.codec import images_key

    arrays = [np.arange(12, dtype=np.float32).reshape(3, 4), np.array([[1, 2, 2]], dtype=np.int64)]
    frames = [bytes(a.tobytes()) for a in arrays]
    assert images_key(arrays) == images_key([memoryview(f) for f in frames]) < 0
    assert images_key(arrays) != images_key([arrays[0]])
