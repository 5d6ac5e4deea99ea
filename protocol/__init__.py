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
    PROTOCOL_VERSION,
    AddRequest,
    Abort,
    AffinityReport,
    Draining,
    Error,
    FromWorker,
    Goodbye,
    Heartbeat,
    Hello,
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
