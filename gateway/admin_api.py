"""/admin/models/{name}/load, /unload, /pin, /unpin and /admin/workers/{pid}/restart:
an operator's hand on the pool (gateway/pool.py) and its workers.

Behind the API keys, or the --admin-key keys when there are any (gateway/security.py).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import APIError
from gateway.responses import MsgspecResponse
from gateway.serving import Serving
from gateway.supervisor import WorkerSupervisor


class AdminAPI:
    def __init__(self, serving: Serving, supervisors: list[WorkerSupervisor]) -> None:
        self.serving = serving
        self.supervisors = supervisors

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
        self.serving.pool.call_off_unload(name)  # one asked before this load; one asked while it loads stands
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

    async def pin(self, request: Request) -> Response:
        return await self._pin(request, True)

    async def unpin(self, request: Request) -> Response:
        return await self._pin(request, False)

    async def _pin(self, request: Request, pinned: bool) -> Response:
        name = self._model(request)
        pool = self.serving.pool
        try:
            pool.pin(name, pinned)
        except ValueError as e:
            raise APIError(409, str(e), code="too_many_pinned") from None
        return MsgspecResponse({"model": name, "pinned": pinned, "status": pool.status(name)})

    async def restart(self, request: Request) -> Response:
        """Restart a worker this gateway started: it drains (its streams resume on the next one) and starts again."""
        pid = request.path_params["pid"]
        supervisor = next((s for s in self.supervisors if s.process is not None and s.process.pid == pid), None)
        if supervisor is None or supervisor.process is None or supervisor.process.returncode is not None:
            raise APIError(404, f"no worker with pid {pid} runs under this gateway (a worker that connected on its "
                           "own is restarted where it was started)", type="not_found_error", code="worker_not_found")
        if not supervisor.restart():
            raise APIError(409, f"worker pid {pid} is stopping (the server drains, or its model unloads): it is not "
                                "started again", code="worker_stopping")
        return MsgspecResponse({"pid": pid, "restarting": True}, 202)
