"""/v1/chat/completions, /v1/completions and /v1/models.

A request's path: decode and validate the body -> wait (bounded) for a ready
worker -> check the model name -> tokenize off the event loop -> AddRequest to
the worker -> Deltas from the link -> SSE chunks or one JSON body. Leaving
early for any reason (disconnect, error) aborts the request in the worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
import uuid
from collections.abc import AsyncIterator

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from gateway.errors import APIError, decode_body, error_body
from gateway.generation import RequestStream
from gateway.openai_schema import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    Completion,
    CompletionChoice,
    CompletionRequest,
    GenerationRequest,
    ImagePart,
    Model,
    ModelList,
    Usage,
)
from gateway.settings import GatewaySettings
from gateway.tokenizer import PromptError
from gateway.worker_link import WorkerLink, WorkerState, WorkerUnavailable
from protocol import Sampling

log = logging.getLogger("mlxd.gateway.api")
_json = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


def sse(payload) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"


class OpenAIAPI:
    def __init__(self, link: WorkerLink, settings: GatewaySettings) -> None:
        self.link = link
        self.settings = settings
        self.started = int(time.time())
        self.draining = False  # set on SIGTERM: no new requests
        self.admission = Admission(settings.max_inflight, settings.max_inflight_per_key)

    # ---- shared steps -------------------------------------------------------

    async def _worker(self) -> WorkerState:
        if self.draining:
            raise _unavailable("the server is shutting down")
        try:
            return await self.link.ready_worker(self.settings.worker_wait_s)
        except WorkerUnavailable as e:
            raise _unavailable(str(e)) from None

    def _served_names(self, worker: WorkerState) -> list[str]:
        return self.settings.served_model_name or [worker.hello.model]

    def _check_model(self, name: str, worker: WorkerState) -> None:
        names = self._served_names(worker)
        if name not in names:
            raise APIError(
                404,
                f"The model '{name}' does not exist. This server serves: {', '.join(names)}.",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )

    @staticmethod
    def _check_common(body: GenerationRequest) -> None:
        if body.n not in (None, 1):
            raise APIError(400, "n > 1 is not supported yet", param="n", code="unsupported_value")
        if any(not s for s in body.stop_strings()):
            raise APIError(400, "stop strings must not be empty", param="stop")

    async def _tokenize(self, fn, *args) -> list[int]:
        try:
            return await asyncio.to_thread(fn, *args)
        except PromptError as e:
            raise APIError(400, str(e), param="messages") from None

    async def _read_body(self, request: Request) -> bytes:
        """The body, within --max-body-bytes (413) and --body-timeout-s (408)."""
        limit = self.settings.max_body_bytes
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        chunks: list[bytes] = []
        size = 0

        async def read() -> None:
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
                chunks.append(chunk)

        try:
            await asyncio.wait_for(read(), self.settings.body_timeout_s)
        except TimeoutError:
            raise APIError(
                408, f"the request body did not arrive within {self.settings.body_timeout_s:g}s", code="timeout"
            ) from None
        return b"".join(chunks)

    # ---- endpoints ----------------------------------------------------------

    async def models(self, _request: Request) -> Response:
        names = self.settings.served_model_name or self._served_names(await self._worker())
        body = ModelList([Model(id=name, created=self.started) for name in names])
        return Response(_json.encode(body), media_type="application/json")

    async def chat_completions(self, request: Request) -> Response:
        body: ChatCompletionRequest = decode_body(await self._read_body(request), ChatCompletionRequest)
        self._check_common(body)
        for i, m in enumerate(body.messages):
            if m.role != "assistant" and m.content is None:
                raise APIError(400, f"messages[{i}] ({m.role}) needs content", param=f"messages[{i}].content")
            for j, part in enumerate(m.content if isinstance(m.content, list) else []):
                if isinstance(part, ImagePart):
                    raise APIError(
                        400,
                        "image inputs are not supported: the served model is text-only",
                        param=f"messages[{i}].content[{j}]",
                        code="unsupported_content",
                    )
        worker = await self._worker()
        self._check_model(body.model, worker)
        messages = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages
        ]
        prompt = await self._tokenize(worker.tokenizer.encode_chat, messages)
        max_tokens = body.max_completion_tokens or body.max_tokens
        output = ChatOutput(f"chatcmpl-{uuid.uuid4().hex}", body.model)
        return await self._generate(request, body, prompt, max_tokens, worker, output, "messages")

    async def completions(self, request: Request) -> Response:
        body: CompletionRequest = decode_body(await self._read_body(request), CompletionRequest)
        self._check_common(body)
        prompt_in = body.prompt
        if isinstance(prompt_in, list) and len(prompt_in) == 1 and isinstance(prompt_in[0], str):
            prompt_in = prompt_in[0]
        if isinstance(prompt_in, list) and not all(isinstance(t, int) for t in prompt_in):
            raise APIError(400, "a list of several prompts is not supported; send one request per prompt", param="prompt")
        worker = await self._worker()
        self._check_model(body.model, worker)
        if isinstance(prompt_in, str):
            prompt = await self._tokenize(worker.tokenizer.encode_text, prompt_in)
        else:
            vocab = worker.hello.vocab_size
            bad = next((t for t in prompt_in if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="prompt")
            prompt = prompt_in
        output = CompletionOutput(f"cmpl-{uuid.uuid4().hex}", body.model)
        return await self._generate(request, body, prompt, body.max_tokens, worker, output, "prompt")

    # ---- generation ---------------------------------------------------------

    async def _generate(self, request, body, prompt, max_tokens, worker, output, prompt_param) -> Response:
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
        if limit is not None and max_tokens is not None and max_tokens > limit:
            raise APIError(
                400, f"max_tokens is {max_tokens}; this server allows at most {limit}", param="max_tokens"
            )
        room = min(context - len(prompt), limit or context)
        sampling = Sampling(
            max_tokens=min(max_tokens or room, room),
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=body.top_p or 1.0,
            top_k=max(body.top_k or 0, 0),
            min_p=body.min_p or 0.0,
            seed=body.seed,
            ignore_eos=body.ignore_eos,
        )
        stream = RequestStream(output.id, prompt, sampling, worker.tokenizer, body.stop_strings())
        release = self.admission.admit(request.scope["state"]["client_id"])
        try:
            self.link.submit(stream)
        except WorkerUnavailable as e:
            release()
            raise _unavailable(str(e)) from None
        if self.settings.log_prompts:
            log.info("%s prompt: %r", output.id, worker.tokenizer.decode(prompt))
        timeout = self.settings.request_timeout_s
        deadline = asyncio.get_running_loop().time() + timeout if timeout else None
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def close() -> None:
                release()
                if not stream.finished:
                    self.link.abort(stream.request_id)

            return EventStream(self._stream_events(stream, output, include_usage, deadline), close)
        try:
            return await self._complete(request, stream, output, deadline)
        finally:
            release()

    async def _stream_events(self, stream: RequestStream, output, include_usage, deadline) -> AsyncIterator[bytes]:
        sent = []
        try:
            if (first := output.first_chunk()) is not None:
                yield sse(first)
            try:
                async for delta in stream.deltas(deadline):
                    if delta.error is not None:
                        yield sse(error_body(delta.error, "server_error"))
                        break
                    if delta.text:
                        yield sse(output.chunk(delta.text, None))
                        if self.settings.log_prompts:
                            sent.append(delta.text)
                    if delta.finish_reason is not None:
                        yield sse(output.chunk(None, delta.finish_reason))
            except TimeoutError:
                yield sse(error_body(_timed_out(self.settings.request_timeout_s), "timeout", code="timeout"))
            if include_usage:
                yield sse(output.usage_chunk(_usage(stream)))
            yield DONE
        finally:
            if self.settings.log_prompts:
                log.info("%s completion: %r", stream.request_id, "".join(sent))

    async def _complete(self, request: Request, stream: RequestStream, output, deadline) -> Response:
        collecting = asyncio.ensure_future(_collect(stream, deadline))
        disconnected = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({collecting, disconnected}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnected.cancel()
            collecting.cancel()
            if not stream.finished:
                self.link.abort(stream.request_id)
        if not collecting.done() or collecting.cancelled():
            return Response(status_code=499)  # nobody is listening
        if isinstance(collecting.exception(), TimeoutError):
            raise APIError(504, _timed_out(self.settings.request_timeout_s), type="timeout", code="timeout")
        text, finish_reason = collecting.result()
        if self.settings.log_prompts:
            log.info("%s completion: %r", stream.request_id, text)
        return Response(
            _json.encode(output.response(text, finish_reason, _usage(stream))), media_type="application/json"
        )


class EventStream(StreamingResponse):
    """SSE whose `close` runs however the response ends, even when the client
    leaves before the first event (when the body iterator never started, and
    so never ran its own cleanup)."""

    def __init__(self, events: AsyncIterator[bytes], close) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._close = close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._close()


class Admission:
    """Requests in flight, in total and per client (API key, or address without keys).

    Decided before any 200 is sent: over a limit is a status code, never an
    error inside a started response.
    """

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


class _Output:
    """Builds one request's response bodies; one subclass per endpoint."""

    def __init__(self, request_id: str, model: str) -> None:
        self.id = request_id
        self.model = model
        self.created = int(time.time())


class ChatOutput(_Output):
    def _chunk(self, choices, usage=None) -> ChatCompletionChunk:
        return ChatCompletionChunk(self.id, self.created, self.model, choices, usage)

    def first_chunk(self) -> ChatCompletionChunk:
        return self._chunk([ChatChunkChoice(0, ChatDelta(role="assistant", content=""))])

    def chunk(self, text: str | None, finish_reason: str | None) -> ChatCompletionChunk:
        return self._chunk([ChatChunkChoice(0, ChatDelta(content=text), finish_reason)])

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return self._chunk([], usage)

    def response(self, text: str, finish_reason: str, usage: Usage) -> ChatCompletion:
        return ChatCompletion(
            self.id, self.created, self.model, [ChatChoice(0, AssistantMessage(text), finish_reason)], usage
        )


class CompletionOutput(_Output):
    def first_chunk(self) -> None:
        return None

    def chunk(self, text: str | None, finish_reason: str | None) -> Completion:
        return Completion(self.id, self.created, self.model, [CompletionChoice(0, text or "", finish_reason)])

    def usage_chunk(self, usage: Usage) -> Completion:
        return Completion(self.id, self.created, self.model, [], usage)

    def response(self, text: str, finish_reason: str, usage: Usage) -> Completion:
        return Completion(self.id, self.created, self.model, [CompletionChoice(0, text, finish_reason)], usage)


def _usage(stream: RequestStream) -> Usage:
    return Usage(stream.prompt_tokens, stream.completion_tokens, stream.prompt_tokens + stream.completion_tokens)


def _unavailable(message: str) -> APIError:
    return APIError(503, message, type="service_unavailable", code="worker_unavailable", headers={"Retry-After": "5"})


def _timed_out(timeout_s: float) -> str:
    return f"the request ran longer than the server's limit of {timeout_s:g}s and was stopped"


async def _collect(stream: RequestStream, deadline: float | None) -> tuple[str, str]:
    parts = []
    async for delta in stream.deltas(deadline):
        if delta.error is not None:
            if delta.error_status == 503:
                raise _unavailable(delta.error)
            raise APIError(delta.error_status, delta.error, type="server_error")
        parts.append(delta.text)
        finish_reason = delta.finish_reason
    return "".join(parts), finish_reason


async def _client_gone(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
