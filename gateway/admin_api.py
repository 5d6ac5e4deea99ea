"""/admin/models/{name}/load and /unload: an operator's hand on the pool (gateway/pool.py).

Behind the API keys, or the --admin-key keys when there are any (gateway/security.py).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import APIError
from gateway.responses import MsgspecResponse
from gateway.serving import Serving


class AdminAPI:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    def _model(self, request: Request) -> str:
        """The pool's model the path names (404 for another)."""
        name = request.path_params["model"]
        pool = self.serving.pool
        if pool.find(name) is None:
            served = ", ".join(pool.models) or "none: this gateway's workers connect on their own"
            raise APIError(404, f"'{name}' is not a model this server loads and unloads (those are: {served})",
                           type="not_found_error", param="model", code="model_not_found")
        return name

    async def load(self, request: Request) -> Response:
        """Load the model, unloading idle ones to make room; answers once it is ready (503 past --worker-wait-s)."""
        name = self._model(request)
        lease, _ = await self.serving.lease(name, retry_failed=True)
        lease.release()
        return MsgspecResponse({"model": name, "status": self.serving.pool.status(name)})

    async def unload(self, request: Request) -> Response:
        """Unload the model now if it is idle (200), else once its running requests end (202)."""
        name = self._model(request)
        pool = self.serving.pool
        if await pool.unload(name):
            return MsgspecResponse({"model": name, "status": pool.status(name)})
        holding = pool.find(name)
        return MsgspecResponse({"model": name, "status": "unloading", "requests": holding.users if holding else 0}, 202)
