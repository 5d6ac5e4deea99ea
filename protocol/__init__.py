"""Messages the gateway and the worker exchange, and their encoding.

Pure data: no sockets, no MLX, no Starlette. Both sides import this package and
never each other.
"""

from protocol.codec import (
    ProtocolError,
    decode_from_worker,
    decode_to_worker,
    encode,
    encode_frames,
    hello_version,
)
from protocol.messages import (
    EXIT_LOAD_FAILED,
    PROTOCOL_VERSION,
    Abort,
    AddRequest,
    AffinityReport,
    Draining,
    Error,
    FromWorker,
    Goodbye,
    Heartbeat,
    Hello,
    LoadFailed,
    PrefixCacheStats,
    Refused,
    RequestOutput,
    Sampling,
    StepOutput,
    Tensor,
    TokenLogprob,
    ToWorker,
    Welcome,
)

__all__ = [
    "EXIT_LOAD_FAILED",
    "PROTOCOL_VERSION",
    "AddRequest",
    "Abort",
    "AffinityReport",
    "Draining",
    "Error",
    "FromWorker",
    "Goodbye",
    "Heartbeat",
    "Hello",
    "LoadFailed",
    "PrefixCacheStats",
    "ProtocolError",
    "Refused",
    "RequestOutput",
    "Sampling",
    "StepOutput",
    "Tensor",
    "TokenLogprob",
    "ToWorker",
    "Welcome",
    "decode_from_worker",
    "decode_to_worker",
    "encode",
    "encode_frames",
    "hello_version",
]
