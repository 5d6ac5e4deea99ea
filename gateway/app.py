"""The Starlette application: routes, error handlers, the link's lifetime, draining."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import threading
from collections.abc import Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.admin_api import AdminAPI
from gateway.admission import Admitted
from gateway.anthropic_api import AnthropicAPI
from gateway.curve import CurveError
from gateway.embeddings_api import EmbeddingsAPI
from gateway.errors import APIError, api_error_handler, http_error_handler, internal_error_handler
from gateway.health import worker_status, workers_status
from gateway.ledger import default_memory_budget
from gateway.metrics import RequestCounter
from gateway.ollama_api import OllamaAPI
from gateway.openai_api import OpenAIAPI
from gateway.openai_responses import ResponsesAPI, ResponseStore
from gateway.ops import LogTail, OpsAPI
from gateway.pool import ModelPool, Unavailable
from gateway.responses import MsgspecResponse
from gateway.security import Cors, Guard, KeyRing, check_bind_policy
from gateway.serving import Serving
from gateway.settings import GatewaySettings, PoolSettings
from gateway.supervisor import local_pids
from gateway.tokenizer import transformers_module
from gateway.transport import EndpointInUse
from gateway.worker_link import WorkerLink
from protocol.units import parse_duration, parse_size
from protocol.worker_settings import WorkerSettings

log = logging.getLogger("mlxd.gateway")


def freeze_heap() -> None:
    """Once, when the first tokenizer has loaded: freeze the heap. transformers'
    modules, mlxd's and the tokenizer are some 90,000 objects that live as long
    as the process, and each full garbage collection walked them all while no
    stream moved (80-90 ms in tests/bench/gc_pauses); frozen, collections walk
    only what came after. Only once: later, what requests in flight hold would
    be frozen too, and a cycle of it never freed."""
    if not gc.get_freeze_count():
        gc.collect()  # what loading left as garbage is not kept for good
        gc.freeze()


def create_app(settings: GatewaySettings, worker_settings: Sequence[WorkerSettings] = (),
               pool_settings: PoolSettings | None = None) -> Starlette:
    """The gateway. With worker_settings (`mlxd serve`), it also runs a pool of
    workers of its own, a model each (gateway/pool.py).

    Raises SystemExit, with the reason, for what makes serving impossible or
    unsafe: no API key beyond loopback, a worker endpoint in use or unsafe.
    """
    try:
        keys = KeyRing(settings.api_key, settings.api_key_file)
    except OSError as e:
        raise SystemExit(f"mlxd: cannot read --api-key-file {settings.api_key_file}: {e.strerror}") from None
    except ValueError as e:
        raise SystemExit(f"mlxd: --api-key-file {e}: a server told to use keys does not serve without any "
                         "(to serve without keys, leave --api-key-file out)") from None
    check_bind_policy(settings, keys.enabled)
    link = WorkerLink(
        settings.worker_endpoint,
        worker_timeout_s=settings.worker_timeout_s,
        hung_worker_s=settings.hung_worker_s,
        worker_wait_s=settings.worker_wait_s,
        curve_secret_key=settings.curve_secret_key,
        curve_authorized_keys=settings.curve_authorized_keys,
        served_model_name=settings.served_model_name,
        on_tokenizer=freeze_heap,
    )
    try:
        link.bind()
    except (EndpointInUse, CurveError, RuntimeError) as e:
        raise SystemExit(f"mlxd: {e}; stop that gateway first, or give this one another --worker-endpoint"
                         if isinstance(e, EndpointInUse) else f"mlxd: {e}") from None
    pool_settings = pool_settings or PoolSettings()
    try:
        pool = ModelPool(
            link, worker_settings,
            budget=parse_size(pool_settings.memory_budget) if pool_settings.memory_budget else default_memory_budget(),
            max_loaded=pool_settings.max_loaded_models,
            keep_alive_s=parse_duration(pool_settings.keep_alive),
            pinned=pool_settings.pin,
            preload=pool_settings.preload,
            served_model_name=settings.served_model_name if worker_settings else (),
            stop_timeout_s=settings.drain_s + 5,
        )
    except ValueError as e:
        raise SystemExit(f"mlxd: {e}") from None
    supervisors = pool.supervisors

    def kill_unhealthy(pid: int) -> None:
        """A hung or unresponsive worker is killed (and so restarted) by the supervisor that started it."""
        for s in supervisors:
            s.kill(pid)

    link.on_unhealthy = kill_unhealthy
    supervisor = supervisors[0] if supervisors else None  # what /health describes as `supervisor`
    serving = Serving(link, settings, pool)
    api = OpenAIAPI(serving)
    anthropic = AnthropicAPI(serving)
    admin = AdminAPI(serving, supervisors)
    log_tail = LogTail()
    ops = OpsAPI(serving, supervisors, log_tail)
    embeddings = EmbeddingsAPI(serving)
    ollama = OllamaAPI(serving, embeddings)
    responses = ResponsesAPI(serving, ResponseStore(settings.responses_store_max, settings.responses_store_ttl_s,
                                                     settings.responses_store_bytes))

    async def health(request: Request) -> Response:
        status = "draining" if serving.draining else "ok"
        if not request.scope["state"]["authenticated"]:
            # Open to all, so that probes need no key; details only with one.
            return MsgspecResponse({"status": status, "worker": {"ready": link.ready}})
        body: dict = {"status": status, "worker": worker_status(link),
                      "workers": workers_status(link, local_pids(supervisors))}
        if supervisor is not None:
            body["supervisor"] = supervisor.status()
            body["supervisors"] = [s.status() for s in supervisors]
            body["pool"] = pool.ledger()
        return MsgspecResponse(body)

    async def cancel(request: Request) -> Response:
        request_id = request.path_params["request_id"]
        serving.cancel(request, request_id)
        return MsgspecResponse({"id": request_id, "cancelled": True})

    async def metrics(_request: Request) -> Response:  # behind the keys (security.Guard)
        text = serving.metrics.render(worker_status(link), workers_status(link, local_pids(supervisors)),
                                      sum(s.restarts for s in supervisors), pool.ledger() if pool.models else None)
        return Response(text, media_type="text/plain; version=0.0.4")

    async def ready(_request: Request) -> Response:
        if (pool.ready if pool.models else link.ready) and not serving.draining:
            return MsgspecResponse({"ready": True})
        # Why: the models that keep it from being ready (the oldest worker's state said little beside others).
        why = {"draining": True} if serving.draining else {"models": pool.not_ready()} if pool.models \
            else {"worker": worker_status(link)["state"]}
        return MsgspecResponse({"ready": False, **why}, 503, {"Retry-After": "1"})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        log.addHandler(log_tail)
        ops.history.start()
        await link.start()
        pool.on_fatal = app.state.fail
        try:
            await pool.start()
        except Unavailable as e:
            app.state.fail(str(e))
        app.state.loop = asyncio.get_running_loop()
        # The tokenizers' library, imported while the workers start (each a second or more): the first
        # worker's Hello, which needs it, finds it ready. A daemon: a server that stops meanwhile need
        # not wait for it.
        threading.Thread(target=transformers_module, name="mlxd-import-transformers", daemon=True).start()
        if settings.api_key_file:
            app.state.loop.add_signal_handler(signal.SIGHUP, reload_keys)
        try:
            yield
        finally:
            await pool.stop()
            await link.close()
            await ops.history.stop()
            log.removeHandler(log_tail)

    def reload_keys() -> None:
        try:
            keys.reload()
        except (OSError, ValueError) as e:
            log.error("SIGHUP: could not reload the API keys from %s (%s); keeping the keys loaded before",
                      settings.api_key_file, e)

    def begin_drain() -> None:
        """On the first SIGTERM/SIGINT (from the signal handler): refuse new
        requests, keep the worker (no restarts) while open streams run for
        --drain-s, then end them with an error event."""
        serving.draining = True
        pool.stop_restarting()
        loop = getattr(app.state, "loop", None)
        if loop is None:
            return  # not serving yet: nothing to drain
        log.info("draining: open requests have %gs to finish (send the signal again to stop now)", settings.drain_s)
        loop.call_soon_threadsafe(loop.call_later, settings.drain_s, serving.end_all, "the server is shutting down")

    def stop_now() -> None:
        """On a second SIGTERM/SIGINT: end every open request at once."""
        log.info("stopping now: ending %d open requests", len(serving.running))
        if (loop := getattr(app.state, "loop", None)) is not None:
            loop.call_soon_threadsafe(serving.end_all, "the server is shutting down")

    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/ready", ready, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/v1/models", api.models, methods=["GET"]),
            Route("/v1/models/{model:path}", api.model, methods=["GET"]),
            Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
            Route("/v1/completions", api.completions, methods=["POST"]),
            Route("/v1/embeddings", embeddings.create, methods=["POST"]),
            Route("/v1/responses", responses.create, methods=["POST"]),
            Route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"]),
            Route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"]),
            Route("/v1/responses/{response_id}", responses.not_offered, methods=["POST"]),  # compact, input_tokens
            Route("/v1/responses/{response_id}/{action}", responses.not_offered, methods=["GET", "POST"]),
            Route("/v1/messages", anthropic.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", anthropic.count_tokens, methods=["POST"]),
            Route("/v1/requests/{request_id}/cancel", cancel, methods=["POST"]),
            Route("/", ollama.running, methods=["GET"]),  # and HEAD, as every GET route
            Route("/api/version", ollama.version, methods=["GET"]),
            Route("/api/tags", ollama.tags, methods=["GET"]),
            Route("/api/ps", ollama.ps, methods=["GET"]),
            Route("/api/show", ollama.show, methods=["POST"]),
            Route("/api/chat", ollama.chat, methods=["POST"]),
            Route("/api/generate", ollama.generate, methods=["POST"]),
            Route("/api/embed", ollama.embed, methods=["POST"]),
            Route("/api/embeddings", ollama.embeddings_v1, methods=["POST"]),
            *[Route(f"/api/{action}", ollama.manage, methods=["POST"]) for action in ("pull", "push", "create", "copy")],
            Route("/api/delete", ollama.manage, methods=["DELETE"]),
            Route("/api/blobs/{digest}", ollama.manage, methods=["HEAD", "POST"]),
            Route("/admin/models/{model:path}/load", admin.load, methods=["POST"]),
            Route("/admin/models/{model:path}/unload", admin.unload, methods=["POST"]),
            Route("/admin/models/{model:path}/pin", admin.pin, methods=["POST"]),
            Route("/admin/models/{model:path}/unpin", admin.unpin, methods=["POST"]),
            Route("/admin/workers/{pid:int}/restart", admin.restart, methods=["POST"]),
            Route("/admin/state", ops.state, methods=["GET"]),
            Route("/admin", ops.show, methods=["GET"]),
        ],
        exception_handlers={
            APIError: api_error_handler,
            HTTPException: http_error_handler,
            Exception: internal_error_handler,
        },
        middleware=[
            # Outermost first: CORS answers browser preflights before any key check.
            Middleware(Cors, settings=settings),
            Middleware(RequestCounter, metrics=serving.metrics),
            Middleware(Guard, settings=settings, keys=keys, keep_alive_s=pool.keep_alive_s),
            Middleware(Admitted, admission=serving.admission),
        ],
        lifespan=lifespan,
    )
    app.state.link = link
    app.state.supervisors = supervisors
    app.state.begin_drain = begin_drain
    app.state.stop_now = stop_now
    return app
