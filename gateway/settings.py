from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from protocol.endpoints import default_worker_endpoint


class GatewaySettings(msgspec.Struct, kw_only=True):
    host: Annotated[str, Meta(description="address to listen on")] = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535, description="TCP port to listen on")] = 8000
    worker_endpoint: Annotated[
        str, Meta(description="ZeroMQ endpoint the gateway binds and workers connect to")
    ] = default_worker_endpoint()
    served_model_name: Annotated[
        list[str], Meta(description="name clients use for the model (default: the worker's --model)")
    ] = []
    worker_wait_s: Annotated[
        float, Meta(ge=0, description="how long a request waits for a ready worker before a 503")
    ] = 30.0
    worker_timeout_s: Annotated[
        float, Meta(gt=0, description="a worker with no heartbeat this long is unresponsive (not ready)")
    ] = 5.0
    hung_worker_s: Annotated[
        float,
        Meta(
            gt=0,
            description="a worker whose step counter stalls this long while requests run (or that stays "
            "unresponsive this long) is hung; `mlxd serve` then kills and restarts it",
        ),
    ] = 60.0
    drain_s: Annotated[
        float, Meta(ge=0, description="on SIGTERM, how long open streams may finish before they are ended")
    ] = 10.0
    log_level: Annotated[str, Meta(description="debug, info, warning or error")] = "info"
