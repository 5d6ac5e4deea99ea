"""/v1/chat/completions, /v1/completions and /v1/models.

A request's path: decode and validate the body -> wait (bounded) for a ready
worker -> check the model name -> tokenize off the event loop -> AddRequest to
the worker -> Deltas from the link -> SSE chunks or one JSON body. Leaving
early for any reason (disconnect, error) aborts the request in the worker.
"""

from __future__ import annotations

import asyncio
import time
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

    # ---- endpoints ----------------------------------------------------------

    async def models(self, _request: Request) -> Response:
        names = self.settings.served_model_name or self._served_names(await self._worker())
        body = ModelList([Model(id=name, created=self.started) for name in names])
        return Response(_json.encode(body), media_type="application/json")

    async def chat_completions(self, request: Request) -> Response:
        body: ChatCompletionRequest = decode_body(await request.body(), ChatCompletionRequest)
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
        body: CompletionRequest = decode_body(await request.body(), CompletionRequest)
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
        room = context - len(prompt)
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
        try:
            self.link.submit(stream)
        except WorkerUnavailable as e:
            raise _unavailable(str(e)) from None
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                self._stream_events(stream, output, include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await self._complete(request, stream, output)

    async def _stream_events(self, stream: RequestStream, output, include_usage: bool) -> AsyncIterator[bytes]:
        try:
            if (first := output.first_chunk()) is not None:
                yield sse(first)
            async for delta in stream.deltas():
                if delta.error is not None:
                    yield sse(error_body(delta.error, "server_error"))
                    break
                if delta.text:
                    yield sse(output.chunk(delta.text, None))
                if delta.finish_reason is not None:
                    yield sse(output.chunk(None, delta.finish_reason))
            if include_usage:
                yield sse(output.usage_chunk(_usage(stream)))
            yield DONE
        finally:
            if not stream.finished:
                self.link.abort(stream.request_id)

    async def _complete(self, request: Request, stream: RequestStream, output) -> Response:
        collecting = asyncio.ensure_future(_collect(stream))
        disconnected = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({collecting, disconnected}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnected.cancel()
            if not collecting.done():
                collecting.cancel()
                self.link.abort(stream.request_id)
        if not collecting.done():
            return Response(status_code=499)  # nobody is listening
        text, finish_reason = collecting.result()
        return Response(
            _json.encode(output.response(text, finish_reason, _usage(stream))), media_type="application/json"
        )


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


async def _collect(stream: RequestStream) -> tuple[str, str]:
    parts = []
    async for delta in stream.deltas():
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
