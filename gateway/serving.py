"""What every API endpoint does around a generation, whatever its dialect.

Read the body within limits, wait (bounded) for a ready worker, check the
model name, tokenize off the event loop, check the context, admit the request
(in-flight limits, decided before any 200), submit its streams to the worker,
and make sure that however it ends — finished, client gone, timed out — the
worker is told and the admission released.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.errors import APIError, openai_error_type
from gateway.generation import Delta, RequestGroup, RequestStream, TokenInfo
from gateway.images import ImageLoader, ImageSource
from gateway.metrics import Metrics
from gateway.parsing import ToolCall
from gateway.settings import GatewaySettings
from gateway.tokenizer import Prompt, PromptError
from gateway.worker_link import WorkerLink, WorkerState, WorkerUnavailable
from protocol import Sampling

log = logging.getLogger("mlxd.gateway.api")
T = TypeVar("T")


def nonempty_stops(stops: list[str], param: str) -> list[str]:
    """A request's stop strings; an empty one (which would end every request at once) is a 400."""
    if any(not s for s in stops):
        raise APIError(400, f"{param}: stop strings must not be empty", param=param)
    return stops


def unavailable(message: str) -> APIError:
    return APIError(503, message, type="service_unavailable", code="worker_unavailable", headers={"Retry-After": "5"})


class Admission:
    """Requests in flight, in total and per client (API key, or address without keys)."""

    def __init__(self, total: int, per_client: int) -> None:
        self.limit_total = total
        self.limit_per_client = per_client
        self.total = 0
        self.by_client: Counter[str] = Counter()

    def admit(self, client_id: str):
        """Count the request in; return the function that counts it out (once)."""
        if self.by_client[client_id] >= self.limit_per_client:
            raise APIError(
                429, f"too many requests in flight for this client (limit {self.limit_per_client})",
                type="requests", code="rate_limit_exceeded", headers={"Retry-After": "1"},
            )
        if self.total >= self.limit_total:
            raise APIError(
                503, f"the server is at its limit of {self.limit_total} requests in flight",
                type="service_unavailable", code="overloaded", headers={"Retry-After": "1"},
            )
        self.total += 1
        self.by_client[client_id] += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.total -= 1
                self.by_client[client_id] -= 1
                if not self.by_client[client_id]:
                    del self.by_client[client_id]

        return release


class Generation:
    """One admitted API request running in the worker: its streams, its deadline, its cleanup."""

    def __init__(self, group: RequestGroup, link: WorkerLink, release, deadline: float | None,
                 metrics: Metrics, arrived: float, client_id: str, on_close=None) -> None:
        self.group = group
        self.client_id = client_id
        self._on_close = on_close
        self.deadline = deadline
        self._link = link
        self._release = release
        self._metrics = metrics
        self._arrived = arrived
        self._closed = False

    async def deltas(self):
        """The group's Deltas, timed for /metrics (time to first token, inter-token latency)."""
        last: dict[int, float] = {}
        async for delta in self.group.deltas(self.deadline):
            if delta.text or delta.reasoning or delta.tool_calls:
                now = time.monotonic()
                if delta.index in last:
                    self._metrics.inter_token_latency.observe(now - last[delta.index])
                else:
                    self._metrics.time_to_first_token.observe(now - self._arrived)
                last[delta.index] = now
            yield delta

    def close(self) -> None:
        """However the request ended: free its admission, abort what still runs. Idempotent."""
        self._release()
        for stream in self.group.streams:
            if not stream.finished:
                self._link.abort(stream.request_id)
        if not self._closed:
            self._closed = True
            self._metrics.prompt_tokens += self.group.prompt_tokens
            self._metrics.generation_tokens += self.group.completion_tokens
            if self._on_close is not None:
                self._on_close()

    def cancel(self) -> None:
        """POST /v1/requests/{id}/cancel: abort every unfinished stream; the
        client gets an error event (streaming) or a 499."""
        for stream in self.group.streams:
            if not stream.finished:
                self._link.abort(stream.request_id)
                self.group.queue.put_nowait(stream.fail("the request was cancelled", 499))


class EventStream(StreamingResponse):
    """SSE that closes its Generation however the response ends, even when the
    client leaves before the first event (when the body iterator never started
    and so never ran its own cleanup)."""

    def __init__(self, events, generation: Generation) -> None:
        super().__init__(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self._generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._generation.close()


class Serving:
    def __init__(self, link: WorkerLink, settings: GatewaySettings, configured_model: str | None = None) -> None:
        self.link = link
        self.settings = settings
        # The model name the worker `mlxd serve` starts will announce.
        self.configured_model = configured_model
        self.started = int(time.time())
        self.draining = False  # set on SIGTERM: no new requests
        self.admission = Admission(settings.max_inflight, settings.max_inflight_per_key)
        self.metrics = Metrics()
        self.images = ImageLoader(settings)
        self.generations: dict[str, Generation] = {}  # by the id the client sees, for cancellation

    async def read_body(self, request: Request) -> bytes:
        """The body, within --max-body-bytes (413) and --body-timeout-s (408)."""
        limit = self.settings.max_body_bytes
        too_large = APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise too_large
        chunks: list[bytes] = []
        size = 0

        async def read() -> None:
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)

        try:
            await asyncio.wait_for(read(), self.settings.body_timeout_s)
        except TimeoutError:
            raise APIError(
                408, f"the request body did not arrive within {self.settings.body_timeout_s:g}s", code="timeout"
            ) from None
        return b"".join(chunks)

    async def ready_worker(self) -> WorkerState:
        if self.draining:
            raise unavailable("the server is shutting down")
        try:
            return await self.link.ready_worker(self.settings.worker_wait_s)
        except WorkerUnavailable as e:
            raise unavailable(str(e)) from None

    def served_names(self, worker: WorkerState) -> list[str]:
        return self.settings.served_model_name or [worker.hello.model]

    def model_names(self) -> list[str]:
        """The names clients may use, known without waiting for a worker: the
        configured ones, else the current worker's or the one `mlxd serve` starts."""
        if self.link.worker is not None:
            return self.served_names(self.link.worker)
        return self.settings.served_model_name or ([self.configured_model] if self.configured_model else [])

    async def worker_for(self, model: str) -> WorkerState:
        """A ready worker serving `model` (404 for a name this server does not serve)."""
        worker = await self.ready_worker()
        names = self.served_names(worker)
        if model not in names:
            raise APIError(
                404,
                f"The model '{model}' does not exist. This server serves: {', '.join(names)}.",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )
        return worker

    async def tokenize(self, fn: Callable[..., T], *args: Any, param: str = "messages") -> T:
        """fn(*args) in a thread; a PromptError is the client's 400."""
        try:
            return await asyncio.to_thread(fn, *args)
        except PromptError as e:
            raise APIError(400, str(e), param=param) from None

    async def chat_prompt(self, worker: WorkerState, messages: list[dict], tools: list[dict] | None,
                          template_kwargs: dict | None, images: list[ImageSource]) -> Prompt:
        """A chat request's prompt; `images` are its image parts, in order."""
        if images and not worker.hello.vision:
            raise APIError(400, "image inputs are not supported: the served model is text-only",
                           param=images[0].param, code="unsupported_content")
        decoded = await self.images.load(images) if images else None
        return await self.tokenize(worker.tokenizer.chat_prompt, messages, tools, template_kwargs, decoded)

    def max_tokens(self, prompt: list[int], requested: int | None, worker: WorkerState, prompt_param: str,
                   max_tokens_param: str = "max_tokens") -> int:
        """How many tokens the request may generate; 400 when it cannot fit."""
        context = worker.hello.context_length
        if not prompt:
            raise APIError(400, "the prompt is empty", param=prompt_param)
        if len(prompt) >= context:
            raise APIError(
                400,
                f"This model's maximum context length is {context} tokens; the prompt has {len(prompt)} tokens.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        limit = self.settings.max_tokens_limit
        if limit is not None and requested is not None and requested > limit:
            raise APIError(400, f"{max_tokens_param} is {requested}; this server allows at most {limit}",
                           param=max_tokens_param)
        room = min(context - len(prompt), limit or context)
        return min(requested or room, room)

    def start(self, request: Request, worker: WorkerState, request_id: str, prompt: Prompt,
              samplings: list[Sampling], stop: list[str], parsers=None) -> Generation:
        """Admit the request and submit one stream per sampling to the worker.

        parsers: a function making each stream's (reasoning splitter, tool-call parser), either None.
        """
        client_id = request.scope["state"]["client_id"]
        release = self.admission.admit(client_id)
        ids = [request_id] if len(samplings) == 1 else [f"{request_id}-{i}" for i in range(len(samplings))]
        queue: asyncio.Queue[Delta] = asyncio.Queue()
        streams = []
        for index, (rid, sampling) in enumerate(zip(ids, samplings)):
            reasoning, tools = parsers() if parsers else (None, None)
            streams.append(RequestStream(rid, queue, prompt.token_ids, sampling, worker.tokenizer, stop, index,
                                         reasoning, tools, images=(prompt.tensors, prompt.arrays)))
        group = RequestGroup(streams, queue)
        timeout = self.settings.request_timeout_s
        deadline = asyncio.get_running_loop().time() + timeout if timeout else None
        arrived = request.scope["state"].get("arrived", time.monotonic())
        generation = Generation(group, self.link, release, deadline, self.metrics, arrived, client_id,
                                on_close=lambda: self.generations.pop(request_id, None))
        self.generations[request_id] = generation
        try:
            for stream in group.streams:
                self.link.submit(stream)
        except WorkerUnavailable as e:
            generation.close()
            raise unavailable(str(e)) from None
        if self.settings.log_prompts:
            log.info("%s prompt: %r", request_id, worker.tokenizer.decode(prompt.token_ids))
        return generation

    def cancel(self, request: Request, request_id: str) -> None:
        """Cancel a running request of this client; 404 if there is none by that id."""
        generation = self.generations.get(request_id)
        if generation is None or generation.client_id != request.scope["state"]["client_id"]:
            raise APIError(404, f"no running request {request_id!r}", type="not_found_error", param="id")
        generation.cancel()

    def timed_out(self) -> str:
        return f"the request ran longer than the server's limit of {self.settings.request_timeout_s:g}s and was stopped"

    def log_completion(self, request_id: str, texts: list[str]) -> None:
        if self.settings.log_prompts:
            log.info("%s completion: %r", request_id, texts if len(texts) > 1 else texts[0])


@dataclass
class Choice:
    """One choice of a finished non-streaming request."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    stop_string: str | None = None
    logprobs: list[TokenInfo] = field(default_factory=list)


async def collect(request: Request, generation: Generation, serving: Serving) -> list[Choice] | None:
    """Every choice's whole text; None if the client left first (the request is then aborted)."""
    collecting = asyncio.ensure_future(_collect(generation))
    disconnected = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({collecting, disconnected}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnected.cancel()
        collecting.cancel()
        generation.close()
    if not collecting.done() or collecting.cancelled():
        return None
    if isinstance(collecting.exception(), TimeoutError):
        raise APIError(504, serving.timed_out(), type="timeout", code="timeout")
    return collecting.result()


async def _collect(generation: Generation) -> list[Choice]:
    choices = [Choice() for _ in generation.group.streams]
    async for delta in generation.deltas():
        if delta.error is not None:
            if delta.error_status == 503:
                raise unavailable(delta.error)
            raise APIError(delta.error_status, delta.error, type=openai_error_type(delta.error_status))
        choice = choices[delta.index]
        choice.text += delta.text
        choice.reasoning += delta.reasoning
        choice.tool_calls += delta.tool_calls
        choice.logprobs += delta.logprobs
        if delta.finish_reason is not None:
            choice.finish_reason, choice.stop_string = delta.finish_reason, delta.stop_string
    return choices


async def _client_gone(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
