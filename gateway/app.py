"""The Starlette application: routes, error handlers, and the link's lifetime."""

from __future__ import annotations

import contextlib
import logging

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.errors import APIError, api_error_handler, http_error_handler, internal_error_handler
from gateway.openai_api import OpenAIAPI
from gateway.settings import GatewaySettings
from gateway.worker_link import WorkerLink

log = logging.getLogger("mlxd.gateway")


def create_app(settings: GatewaySettings, on_startup=None, on_shutdown=None) -> Starlette:
    """on_startup/on_shutdown: async callables run once the link is bound / before it closes
    (`mlxd serve` starts and stops its worker there)."""
    link = WorkerLink(settings.worker_endpoint, worker_timeout_s=settings.worker_timeout_s)
    api = OpenAIAPI(link, settings)

    async def health(_request: Request) -> Response:
        body = {"status": "ok", "worker": link.status()}
        return Response(msgspec.json.encode(body), media_type="application/json")

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await link.start()
        if on_startup:
            await on_startup()
        try:
            yield
        finally:
            if on_shutdown:
                await on_shutdown()
            await link.close()

    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", api.models, methods=["GET"]),
            Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
            Route("/v1/completions", api.completions, methods=["POST"]),
        ],
        exception_handlers={
            APIError: api_error_handler,
            HTTPException: http_error_handler,
            Exception: internal_error_handler,
        },
        lifespan=lifespan,
    )
    app.state.link = link
    return app
