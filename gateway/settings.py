"""The gateway's settings: every `mlxd gateway` flag, with its default and its limits."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from protocol.endpoints import default_worker_endpoint
from protocol.log_file import LogSettings

# Shorter keep-alives would cost CPU (a timer a stream) and bandwidth for nothing:
# clients' idle timeouts are seconds to minutes.
MIN_KEEPALIVE_S = 0.1


class GatewaySettings(LogSettings, kw_only=True):
    host: Annotated[str, Meta(description="address to listen on")] = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535, description="TCP port to listen on")] = 8000
    worker_endpoint: Annotated[
        str, Meta(description="ZeroMQ endpoint the gateway binds and workers connect to")
    ] = default_worker_endpoint()
    served_model_name: Annotated[
        list[str], Meta(description="name clients use for the model (default: the worker's --model)")
    ] = []
    model_alias: Annotated[
        list[Annotated[str, Meta(pattern=r"^[^=]+=[^=]+$")]],
        Meta(description="PATTERN=NAME: a request for a model matching the glob PATTERN (e.g. 'claude-*') "
                         "is served by the served model NAME; /v1/models lists only served names"),
    ] = []
    worker_wait_s: Annotated[
        float, Meta(ge=0, description="how long a request waits for a ready worker, and then for room for its KV state, before a 503")
    ] = 30.0
    worker_timeout_s: Annotated[
        float, Meta(gt=0, description="a worker with no heartbeat this long is unresponsive (not ready)")
    ] = 5.0
    hung_worker_s: Annotated[
        float,
        Meta(
            gt=0,
            description="a worker whose step counter stalls this long while requests run or wait to be "
            "prefilled, using less than half a core meanwhile (ten times as long if it uses more: a long step "
            "on MLX's CPU backend), is hung; one that stays hung or unresponsive this long more is given up "
            "on (its streams move to another worker); `mlxd serve` kills a hung or given-up worker and "
            "restarts it",
        ),
    ] = 60.0
    drain_s: Annotated[
        float, Meta(ge=0, description="on SIGTERM, how long open streams may finish before they are ended")
    ] = 10.0
    # ---- security (docs/security.md) ----
    api_key: Annotated[
        list[str],
        Meta(description="an API key clients must send (Bearer or x-api-key)", extra={"env": "MLXD_API_KEYS"}),
    ] = []
    api_key_file: Annotated[
        str | None, Meta(description="a file of API keys, one per line; re-read on SIGHUP")
    ] = None
    metrics_key: Annotated[
        list[str],
        Meta(description="a key that may read /metrics only (for a scraper); API keys may read it too",
             extra={"env": "MLXD_METRICS_KEYS"}),
    ] = []
    admin_key: Annotated[
        list[str],
        Meta(description="a key for /admin/* (the ops page's state, loading, unloading and pinning models, "
                         "restarting workers); without one, API keys may use it",
             extra={"env": "MLXD_ADMIN_KEYS"}),
    ] = []
    share_prefix_cache: Annotated[
        bool, Meta(description="let the API keys reuse each other's prompts in the prefix cache (by default each key "
                               "has a cache of its own: how much of a prompt another key's holds would show in "
                               "cached_tokens and in the time to the first token)")
    ] = False
    insecure_no_auth: Annotated[
        bool, Meta(description="allow listening beyond loopback without API keys (dangerous)")
    ] = False
    allowed_host: Annotated[
        list[str], Meta(description="a Host name to accept without keys besides localhost, and beyond loopback the "
                                    "machine's addresses and own name (DNS-rebinding guard)")
    ] = []
    cors_origin: Annotated[list[str], Meta(description="a browser origin allowed by CORS (default: local apps' only)")] = []
    max_body_bytes: Annotated[int, Meta(ge=1, description="largest request body accepted (413 beyond)")] = 8 << 20
    body_timeout_s: Annotated[float, Meta(gt=0, description="time a client has to send a request's headers (the connection is closed beyond) and its body (408 beyond)")] = 30.0
    request_timeout_s: Annotated[
        float, Meta(ge=0, description="longest a generation may run before it is aborted; 0: no limit")
    ] = 600.0
    stream_keepalive_s: Annotated[
        float, Meta(ge=0, description="a stream with nothing to send for this long sends a keep-alive (Anthropic's "
                                      "ping, Responses' response.in_progress, an SSE comment on the other OpenAI "
                                      "streams), so that clients and proxies with an idle timeout wait through a "
                                      f"long prefill; 0: none, else at least {MIN_KEEPALIVE_S}")
    ] = 15.0
    max_tokens_limit: Annotated[
        Annotated[int, Meta(ge=1)] | None, Meta(description="largest max_tokens a request may ask for (400 beyond)")
    ] = None
    max_inflight: Annotated[int, Meta(ge=1, description="requests in flight in total (503 beyond)")] = 256
    max_inflight_per_key: Annotated[
        int, Meta(ge=1, description="requests in flight per API key, or per client address without keys (429 beyond)")
    ] = 64
    # ---- image inputs (vision models) ----
    allow_image_hosts: Annotated[
        list[str],
        Meta(description="a host (or host:port) whose http(s) image URLs the gateway may fetch (default: none; "
                         "images must be inline)", extra={"env": "MLXD_ALLOW_IMAGE_HOSTS"}),
    ] = []
    image_fetch_timeout_s: Annotated[float, Meta(gt=0, description="time an image URL has to arrive (400 beyond)")] = 10.0
    max_images_per_request: Annotated[int, Meta(ge=0, description="images one request may carry (400 beyond)")] = 8
    max_image_pixels: Annotated[
        int, Meta(ge=1, description="width x height of one image (413 beyond)")
    ] = 25_000_000
    max_image_bytes: Annotated[int, Meta(ge=1, description="encoded size of one image (413 beyond)")] = 10 << 20
    max_request_image_bytes: Annotated[
        int, Meta(ge=1, description="encoded size of all of a request's images (413 beyond)")
    ] = 20 << 20
    responses_store_max: Annotated[
        int, Meta(ge=0, description="responses kept for previous_response_id and GET /v1/responses/{id} "
                                    "(the oldest go first; 0 keeps none)")
    ] = 1000
    responses_store_ttl_s: Annotated[float, Meta(gt=0, description="how long a stored response is kept")] = 3600.0
    responses_store_bytes: Annotated[
        int, Meta(ge=0, description="memory the stored responses may hold (their conversations, images, "
                                    "instructions and tools)")
    ] = 256 << 20
    log_prompts: Annotated[bool, Meta(description="log prompts and completions (never logged otherwise)")] = False
    curve_secret_key: Annotated[
        str | None, Meta(description="the gateway's CURVE secret key file (`mlxd keys generate`); needed for tcp://")
    ] = None
    curve_authorized_keys: Annotated[
        str | None, Meta(description="a directory of the public key files of the workers allowed to connect")
    ] = None

    def __post_init__(self) -> None:
        if 0 < self.stream_keepalive_s < MIN_KEEPALIVE_S:
            raise ValueError(f"--stream-keepalive-s / MLXD_STREAM_KEEPALIVE_S: 0 (none) or at least "
                             f"{MIN_KEEPALIVE_S}, not {self.stream_keepalive_s}")


def check_model_names(settings: GatewaySettings, models: int) -> None:
    """A ValueError for --served-model-name with several models: every worker
    would announce that one name, and the models be taken for replicas of one."""
    if models > 1 and settings.served_model_name:
        raise ValueError("--served-model-name names the one model; with several, give each --model as NAME=SOURCE")


class PoolSettings(msgspec.Struct, kw_only=True):
    """`mlxd serve`'s models: when they load and unload, and in what memory (docs/operations.md)."""

    preload: Annotated[
        bool, Meta(description="load every model at start (as many as fit) rather than on its first request")
    ] = False
    keep_alive: Annotated[
        str, Meta(description="how long an idle model stays loaded: 30s, 5m, 1h; -1 forever; 0 unloads it as soon "
                              "as it is idle (a request's `keep_alive` field overrides it for that model)")
    ] = "5m"
    pin: Annotated[
        list[str], Meta(description="a model NAME that loads at start and is never unloaded to make room or when idle")
    ] = []
    max_loaded_models: Annotated[int, Meta(ge=1, description="models loaded at once")] = 3
    memory_budget: Annotated[
        str | None,
        Meta(description="memory the loaded models may use, e.g. 48G: weights, prefix caches and each running "
                         "request's KV state (default: on macOS the GPU's working set, 3/4 of memory, less 2 GiB; "
                         "elsewhere half the memory)"),
    ] = None
