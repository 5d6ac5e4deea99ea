"""The one way an API request is served, whatever its dialect.

An API turns its body into a `Plan` (gateway/plan.py) and hands it over with
its `Renderer`, the dialect's hooks. `Serving.respond` then: checks the model
name, takes a lease on the model from the pool (loading it if need be) and
waits (bounded) for a ready worker, tokenizes (a long prompt in a thread),
checks the context, builds the samplings, and runs the request through
`generate` — the async iterator that reserves its KV memory,
submits it, yields its Deltas, and in its `finally` aborts whatever still
runs in the worker and releases the lease — into SSE events or one body,
through the Renderer.
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import math
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Protocol, TypeVar, cast

from starlette.requests import Request
from starlette.responses import Response

from gateway.admission import Admission
from gateway.errors import CANCELLED, APIError, openai_error_type
from gateway.images import ImageLoader
from gateway.metrics import Metrics
from gateway.model_facts import ModelFacts, model_facts
from gateway.output_processor import KEEPALIVE, Delta, RequestGroup, RequestState, TokenInfo
from gateway.parsing import ToolCall, opens_reasoning, reasons, stream_parsers
from gateway.plan import ChatInput, DocumentStart, Plan
from gateway.pool import RETRY_AFTER_S, Lease, ModelPool, Unavailable
from gateway.responses import EventStream, MsgspecResponse
from gateway.security import keep_alive_for
from gateway.settings import GatewaySettings
from gateway.structured import FAMILY_OF_PARSER, Thinking
from gateway.tokenizer import Prompt, PromptError
from gateway.worker_link import WorkerLink, WorkerState, WorkerUnavailable
from protocol.worker_settings import model_source

log = logging.getLogger("mlxd.gateway.api")
# --log-prompts writes here: to the log, and never to the ops page's log tail,
# which every API key may read where no admin key is set.
PROMPTS_LOGGER = "mlxd.gateway.prompts"
prompt_log = logging.getLogger(PROMPTS_LOGGER)
T = TypeVar("T")
# Up to this size a prompt is tokenized on the event loop: the hop to a thread
# and back costs about what tokenizing a thousand characters does, while a long
# agent context would hold the loop (and every stream) for milliseconds.
INLINE_TOKENIZE_BYTES = 4096
# The tag Ollama's clients add to a name that has none.
OLLAMA_DEFAULT_TAG = ":latest"


def unavailable(message: str, code: str = "worker_unavailable") -> APIError:
    return APIError(503, message, type="service_unavailable", code=code, headers={"Retry-After": str(RETRY_AFTER_S)})


def refused(e: Unavailable) -> APIError:
    """The pool's refusal as the client's error: a 503 to retry, or a 400 for a request that never fits."""
    return APIError(400, str(e), code=e.code) if e.never else unavailable(str(e), e.code)


@dataclass
class Choice:
    """One choice of a finished non-streaming request."""

    # Its reasoning, text and calls in the order they came, runs of text whole:
    # the APIs whose answer is a sequence of blocks (Anthropic's, Responses') read them so.
    parts: list[tuple[str, str | ToolCall]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_string: str | None = None
    logprobs: list[TokenInfo] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(cast(str, value) for kind, value in self.parts if kind == "text")

    @property
    def reasoning(self) -> str:
        return "".join(cast(str, value) for kind, value in self.parts if kind == "reasoning")

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [value for _, value in self.parts if isinstance(value, ToolCall)]

    def add(self, delta: Delta) -> None:
        """A Delta's reasoning, then text, then calls."""
        for kind, value in (("reasoning", delta.reasoning), ("text", delta.text)):
            if not value:
                continue
            if self.parts and self.parts[-1][0] == kind:
                self.parts[-1] = (kind, cast(str, self.parts[-1][1]) + value)
            else:
                self.parts.append((kind, value))
        self.parts += [("call", call) for call in delta.tool_calls]
        self.logprobs += delta.logprobs
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_string = delta.finish_reason, delta.stop_string


class Renderer(Protocol):
    """A dialect's hooks: how its API writes one request's output."""

    id: str  # the request's id, as its client sees it
    media_type: str  # of its stream: responses.SSE, or responses.NDJSON

    def opening(self, group: RequestGroup) -> list[bytes]:
        """The events before any Delta."""
        ...

    def delta(self, delta: Delta) -> list[bytes]:
        """The events for one Delta (the first of each choice has no text: it opens the choice)."""
        ...

    def keepalive(self) -> list[bytes]:
        """What a stream sends after --stream-keepalive-s with nothing to send: something its
        clients read past, that still counts as traffic for their idle timers."""
        ...

    def ending(self, group: RequestGroup, error: APIError | None) -> list[bytes]:
        """The last events: after every choice finished, or after an error."""
        ...

    def body(self, choices: list[Choice], group: RequestGroup) -> Any:
        """The body of a non-streaming response."""
        ...


class Serving:
    def __init__(self, link: WorkerLink, settings: GatewaySettings, pool: ModelPool) -> None:
        self.link = link
        self.settings = settings
        self.pool = pool  # the models `mlxd serve` runs (none under `mlxd gateway`)
        self.started = int(time.time())
        self.draining = False  # set on SIGTERM: no new requests
        self.ended: str | None = None  # why end_all ended every request: none may start after it
        self.admission = Admission(settings.max_inflight, settings.max_inflight_per_key)
        self.metrics = Metrics()
        self.images = ImageLoader(settings)
        # Requests being generated, by the id their client sees (for cancel) -> (client id, group).
        self.running: dict[str, tuple[str, RequestGroup]] = {}
        self.leasing = 0  # requests waiting for their model to load or a worker of it to be ready

    async def read_body(self, request: Request) -> bytes:
        """The body, within --max-body-bytes (413) and --body-timeout-s (408)."""
        limit = self.settings.max_body_bytes
        too_large = APIError(413, f"the request body is larger than this server's limit of {limit} bytes (inline "
                                  "images count as their base64, a third larger than their files)",
                             code="request_too_large")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise too_large
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.settings.body_timeout_s):  # no task of its own, as wait_for makes
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise too_large
                    chunks.append(chunk)
            request.scope["state"]["body_bytes"] = size
        except TimeoutError:
            raise APIError(
                408, f"the request body did not arrive within {self.settings.body_timeout_s:g}s", code="timeout"
            ) from None
        return b"".join(chunks)

    def model_names(self) -> list[str]:
        """The names clients may use, known without waiting for a worker: the
        configured ones (--served-model-name, the models `mlxd serve` runs),
        and those of the workers that connected."""
        if self.settings.served_model_name:
            return list(self.settings.served_model_name)
        names = [*self.pool.models, *(n for w in self.link.workers.values() for n in w.names)]
        return list(dict.fromkeys(names))

    def model_facts(self, name: str) -> ModelFacts:
        """What listings say of the served model `name`: what its files say, with what its worker measured
        (its size only where its files are not on this machine: loaded, its weights may be dequantized)."""
        pooled = self.pool.find(name)
        facts = model_facts(model_source(pooled.supervisor.settings)) if pooled is not None else ModelFacts()
        worker = self.link.worker_of(name)
        if worker is not None:
            facts.context_length = worker.hello.context_length
            facts.size = facts.size or worker.hello.weights_bytes
        return facts

    def served_name(self, model: str, names: list[str]) -> str:
        """The served name a request for `model` reaches: `model` itself (an
        Ollama client's `NAME:latest` is NAME), or the name the first
        --model-alias pattern it matches gives, or the one name it is in
        another case (as Ollama finds names); 404 if there is none."""
        if model in names:
            return model
        if model.endswith(OLLAMA_DEFAULT_TAG) and model.removesuffix(OLLAMA_DEFAULT_TAG) in names:
            return model.removesuffix(OLLAMA_DEFAULT_TAG)
        for alias in self.settings.model_alias:
            pattern, _, name = alias.partition("=")
            if fnmatch.fnmatchcase(model, pattern):
                if name in names:
                    return name
                break
        folded = model.casefold()
        alike = [n for n in names if folded in (n.casefold(), n.casefold() + OLLAMA_DEFAULT_TAG)]
        if len(alike) == 1:
            return alike[0]
        raise APIError(
            404,
            f"The model '{model}' does not exist. "
            + (f"This server serves: {', '.join(names)}." if names else "No worker has connected to this server yet."),
            type="not_found_error",
            param="model",
            code="model_not_found",
        )

    async def lease(self, model: str, keep_alive_s: float | None = None, retry_failed: bool = False,
                    request: Request | None = None) -> tuple[Lease, WorkerState]:
        """A lease on `model` (loaded by the pool if need be) and a ready worker
        serving it: 404 for a name this server does not serve; 503 when no
        worker is ready within --worker-wait-s, the pool has no room, or the
        model could not load (retry_failed: try again at once); 403 for a
        `keep_alive` the client's `request` may not set. The caller releases the lease."""
        if request is not None:
            keep_alive_s = keep_alive_for(request, keep_alive_s)
        if self.draining:
            raise unavailable("the server is shutting down")
        names = self.model_names()
        name = self.served_name(model, names) if names else None  # no names known before the first worker
        wait_s = self.settings.worker_wait_s
        deadline = time.monotonic() + wait_s
        self.leasing += 1
        try:
            try:
                lease = (await self.pool.lease(name, keep_alive_s, wait_s, retry_failed) if name
                         else Lease(self.pool, None, None))
            except Unavailable as e:
                raise refused(e) from None
            try:
                worker = await self.link.ready_worker(deadline, wait_s, name,
                                                      lease.model.load_error if lease.model else None)
                if name is None:
                    self.served_name(model, worker.names)
            except BaseException as e:
                lease.release()
                if isinstance(e, WorkerUnavailable):  # its model's load failed meanwhile: as later requests say
                    failed = lease.model is not None and lease.model.load_error() is not None
                    raise unavailable(str(e), "model_load_failed" if failed else "worker_unavailable") from None
                raise
        finally:
            self.leasing -= 1
        return lease, worker

    def max_tokens(self, prompt: list[int], requested: int | None, worker: WorkerState, prompt_param: str,
                   max_tokens_param: str = "max_tokens") -> int:
        """How many tokens the request may generate; 400 when it cannot fit."""
        context = worker.hello.context_length
        if not prompt:
            raise APIError(400, "the prompt is empty", param=prompt_param)
        if len(prompt) >= context:
            raise APIError(
                400,
                # Anthropic's words first: clients (Claude Code) read them to compact the conversation.
                # And OpenAI's, which other clients (LiteLLM) match exactly.
                f"prompt is too long: {len(prompt)} tokens > {context - 1} maximum. This model's maximum context "
                f"length is {context} tokens, one at least left to generate.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        limit = self.settings.max_tokens_limit
        if limit is not None and requested is not None and requested > limit:
            raise APIError(400, f"{max_tokens_param} is {requested}; this server allows at most {limit}",
                           param=max_tokens_param)
        room = min(context - len(prompt), limit or context)
        return min(requested or room, room)


    async def prompt(self, request: Request, worker: WorkerState, plan: Plan) -> Prompt:
        """The plan's prompt as token ids (a 400 for one that cannot be made)."""
        source = plan.prompt
        if isinstance(source, ChatInput) and source.untemplated is not None \
                and not worker.tokenizer.has_chat_template:
            source = source.untemplated  # Ollama's /api/generate: completed as it is, as a raw prompt is
        if isinstance(source, DocumentStart):
            # The tokenizer's own start (its BOS), else what ends a document (an EOS) as a separator.
            return Prompt("", worker.tokenizer.encode_text("") or worker.hello.eos_token_ids[:1])
        if isinstance(source, str):
            return Prompt(source, await tokenize(len(source), worker.tokenizer.encode_text, source,
                                                      param="prompt"))
        if isinstance(source, list):
            vocab = worker.hello.vocab_size
            bad = next((t for t in source if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="prompt")
            return Prompt("", source)
        if source.images and not worker.hello.vision:
            raise APIError(400, "image inputs are not supported: the served model is text-only",
                           param=source.images[0].param, code="unsupported_content")
        decoded = await self.images.load(source.images) if source.images else None
        # Images are processed in a thread, however small the body that named them.
        size = request.scope["state"]["body_bytes"] if decoded is None else math.inf

        async def render(messages: list[dict], images: list | None) -> Prompt:
            return await tokenize(size, worker.tokenizer.chat_prompt, messages, plan.tools, source.template_kwargs,
                                  images, source.continue_final, param=plan.prompt_param)

        prompt = await render(source.messages, decoded)
        if not source.fit_context or len(prompt.token_ids) < worker.hello.context_length:
            return prompt
        return await fitted(source.messages, decoded, worker.hello.context_length, render) or prompt

    async def respond(self, request: Request, plan: Plan, renderer: Renderer) -> Response:
        """Serve one API request: SSE events or one body, written by the renderer.
        A client that leaves before the answer starts (while its model loads,
        while room is made, before a non-streamed answer is whole) ends its
        request there: nothing more is loaded, reserved or generated for it."""
        answer = await unless_client_leaves(request, self._answer(request, plan, renderer))
        return Response(status_code=CANCELLED) if answer is None else answer

    async def _answer(self, request: Request, plan: Plan, renderer: Renderer) -> Response:
        lease, worker = await self.lease(plan.model, plan.keep_alive_s, request=request)
        ready_at = time.monotonic()
        streaming = False  # once a stream is open, its generate releases the lease when it ends
        try:
            prompt = await self.prompt(request, worker, plan)
            cache_scope = "" if self.settings.share_prefix_cache else request.scope["state"].get("key_id") or ""
            group = self._group(worker, plan, prompt, renderer.id, ready_at, cache_scope)
            deltas = self.generate(request, plan, group, renderer.id, worker, lease)
            if plan.stream:
                # Admitted, reserved and submitted before any 200: a refusal is still a 4xx/5xx.
                opening = await anext(deltas)
                streaming = True
                stream = EventStream(self._events(renderer, group, opening, deltas), deltas, renderer.media_type)
                group.cut = stream.cut
                return stream
            try:
                choices = await collect(deltas, len(group.states))
            except TimeoutError:
                raise self.timed_out() from None
        finally:
            if not streaming:
                lease.release()
        self._log_completion(renderer.id, [c.text for c in choices])
        return MsgspecResponse(renderer.body(choices, group))

    def _group(self, worker: WorkerState, plan: Plan, prompt: Prompt, request_id: str,
               ready_at: float, cache_scope: str) -> RequestGroup:
        """One RequestState per choice, with its sampling, stop strings and parsers;
        cache_scope: AddRequest.cache_scope."""
        max_tokens = self.max_tokens(prompt.token_ids, plan.max_tokens, worker, plan.prompt_param,
                                     plan.max_tokens_param)
        family, call_format = worker.tokenizer.tool_family, forced_call_format(worker)
        markers = worker.reasoning_markers
        if plan.thinking_param is not None and not reasons(worker.tokenizer.chat_template, markers):
            raise APIError(400, f'"{plan.model}" does not support thinking', param=plan.thinking_param)
        if plan.tools and plan.tools_param is not None and not takes_tools(worker):
            raise APIError(400, f'"{plan.model}" does not support tools', param=plan.tools_param)
        # A chat's constrained answer comes after the model's reasoning block (Harmony's channels excepted).
        thinking = Thinking(*markers, opened=opens_reasoning(markers, prompt.text)) \
            if markers is not None and family != "harmony" and isinstance(plan.prompt, ChatInput) else None
        grammar = plan.grammar(call_format, worker.tokenizer.added_tokens, thinking)
        samplings = plan.sampling.samplings(worker.sampling, worker.hello.vocab_size, max_tokens, grammar)
        parsers = (stream_parsers(markers, family, prompt.text, plan.parsed_tools(call_format), worker.tool_format)
                   if isinstance(plan.prompt, ChatInput) else None)
        ids = [request_id] if len(samplings) == 1 else [f"{request_id}-{i}" for i in range(len(samplings))]
        queue: asyncio.Queue[Delta] = asyncio.Queue()
        states = []
        for index, (rid, sampling) in enumerate(zip(ids, samplings)):
            states.append(RequestState(rid, queue, prompt.token_ids, sampling, worker.tokenizer, plan.stops, index,
                                       parsers() if parsers else None, images=(prompt.tensors, prompt.arrays, prompt.images_key),
                                       cache_scope=cache_scope))
        if self.settings.log_prompts:
            prompt_log.info("%s prompt: %r", request_id, worker.tokenizer.decode(prompt.token_ids))
        return RequestGroup(states, queue, ready_at)

    async def generate(self, request: Request, plan: Plan, group: RequestGroup, request_id: str,
                       worker: WorkerState, lease: Lease) -> AsyncGenerator[Delta]:
        """Reserve the request's KV memory (503), submit its choices to the
        worker, and yield first an empty Delta opening each choice, then every
        Delta until each choice has its final one.

        However it ends — finished, client gone, timed out, cancelled, failed —
        its `finally` aborts in the worker what still runs there and releases
        the lease. A timeout, a cancel and a drain do that at once too
        (group.stop), since the reader may be held at a send to a client that
        stopped reading.
        """
        client_id = request.scope["state"]["client_id"]
        if self.ended is not None:  # past its lease before the drain began, and past the drain's end now
            raise unavailable(self.ended)

        def stop() -> None:  # the worker's work and the lease, given back at once (again at the end: a no-op)
            self.link.abort([state.request_id for state in group.states if state.running])
            lease.release()

        group.stop = stop
        self.running[request_id] = (client_id, group)
        timeout = self.settings.request_timeout_s
        deadline = asyncio.get_running_loop().time() + timeout if timeout else None
        arrived = request.scope["state"].get("arrived", time.monotonic())
        last: dict[int, float] = {}  # when each choice last had text, for /metrics
        calls: Counter[int] = Counter()  # tool calls returned per choice
        try:
            try:
                await lease.reserve(worker.hello.kv_footprint,
                                    [len(s.prompt) + s.sampling.max_tokens for s in group.states],
                                    wait_s=self.room_wait_s)
                if not lease.released:  # else it ended (a cancel, a drain) while room was made: its error is queued
                    for state in group.states:
                        self.link.submit(state, worker)
                    self.metrics.prompt_tokens += group.prompt_tokens  # a request refused never ran its prompt
            except Unavailable as e:
                raise refused(e) from None
            except WorkerUnavailable as e:
                raise unavailable(str(e)) from None
            for state in group.states:
                yield Delta("", state.index)
            keepalive_s = self.settings.stream_keepalive_s if plan.stream else 0
            async for delta in group.deltas(deadline, keepalive_s or None):
                if delta.text or delta.reasoning or delta.tool_calls:
                    now = time.monotonic()
                    if delta.index in last:
                        self.metrics.inter_token_latency.observe(now - last[delta.index])
                    elif not last:  # the request's first text (of any of its choices): once a request
                        self.metrics.time_to_first_token.observe(now - arrived)
                    last[delta.index] = now
                if delta.tool_calls and not plan.parallel_tool_calls:
                    delta.tool_calls = delta.tool_calls[: max(1 - calls[delta.index], 0)]
                    calls[delta.index] += len(delta.tool_calls)
                yield delta
        finally:
            stop()
            del self.running[request_id]
            self.metrics.generation_tokens += group.completion_tokens

    async def _events(self, renderer: Renderer, group: RequestGroup, opening: Delta,
                      deltas: AsyncIterator[Delta]) -> AsyncIterator[bytes]:
        """The SSE body: a Delta's events go out as one write (one chunk, one send)."""
        texts: list[list[str]] | None = [[] for _ in group.states] if self.settings.log_prompts else None
        error: APIError | None = None
        loop = asyncio.get_running_loop()
        try:
            if events := renderer.opening(group) + renderer.delta(opening):
                yield b"".join(events)
            try:
                async for delta in deltas:
                    if delta is KEEPALIVE:
                        events = renderer.keepalive()
                    elif delta.error is not None:
                        error = delta_error(delta)
                        break
                    else:
                        if texts is not None:
                            texts[delta.index].append(delta.text)
                        events = renderer.delta(delta)
                    if events:
                        yield b"".join(events)
                        group.written_at = loop.time()
            except TimeoutError:
                error = self.timed_out()
            yield b"".join(renderer.ending(group, error))
        finally:
            if texts is not None:
                self._log_completion(renderer.id, ["".join(t) for t in texts])

    def cancel(self, request: Request, request_id: str) -> None:
        """Cancel a running request of this client (404 if there is none by
        that id): its reader gets an error, and its generation ends there."""
        client_id, group = self.running.get(request_id, (None, None))
        if group is None or client_id != request.scope["state"]["client_id"]:
            raise APIError(404, f"no running request {request_id!r}", type="not_found_error", param="id")
        group.end("the request was cancelled", CANCELLED)

    def end_all(self, message: str) -> None:
        """End every running request with an error (the server is stopping), and any that would start."""
        self.ended = message
        for _, group in self.running.values():
            group.end(message, 503)

    @property
    def room_wait_s(self) -> float:
        """How long a request waits for KV room (ModelPool.reserve): --worker-wait-s, within
        --request-timeout-s, since there is no use reserving what would then time out."""
        return min(self.settings.worker_wait_s, self.settings.request_timeout_s or math.inf)

    def timed_out(self) -> APIError:
        return APIError(504, f"the request ran longer than the server's limit of {self.settings.request_timeout_s:g}s"
                        " and was stopped", type="timeout", code="timeout")

    def _log_completion(self, request_id: str, texts: list[str]) -> None:
        if self.settings.log_prompts:
            prompt_log.info("%s completion: %r", request_id, texts if len(texts) > 1 else texts[0])


async def tokenize(size: float, fn: Callable[..., T], *args: Any, param: str = "messages") -> T:
    """fn(*args), made from `size` bytes of the request: on the event loop
    when small, in a thread when large; a PromptError is the client's 400."""
    try:
        if size <= INLINE_TOKENIZE_BYTES:
            return fn(*args)
        return await asyncio.to_thread(fn, *args)
    except PromptError as e:
        raise APIError(400, str(e), param=param) from None


async def fitted(messages: list[dict], images: list | None, context: int,
                 render: Callable[[list[dict], list | None], Awaitable[Prompt]]) -> Prompt | None:
    """The conversation with the fewest of its oldest turns left out that fits
    `context` with a token to spare, found by bisection: system messages
    stay, and what is kept of the rest starts at a user message, as templates
    want. None if even the last turn does not fit."""
    first = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    starts = [i for i, m in enumerate(messages) if i > first and m["role"] == "user"]
    # Which of the images (one per image part, in order) each message holds.
    bounds = list(accumulate((sum(isinstance(p, dict) and p.get("type") == "image" for p in m["content"])
                              if isinstance(m["content"], list) else 0 for m in messages), initial=0))

    async def keeping(start: int) -> Prompt:
        kept = [i for i, m in enumerate(messages) if i >= start or m["role"] == "system"]
        picked = [image for i in kept for image in (images or [])[bounds[i]:bounds[i + 1]]]
        return await render([messages[i] for i in kept], picked or None)

    best: Prompt | None = None
    low, high = 0, len(starts) - 1
    while low <= high:
        middle = (low + high) // 2
        prompt = await keeping(starts[middle])
        if len(prompt.token_ids) < context:
            best, high = prompt, middle - 1
        else:
            low = middle + 1
    if best is not None:
        log.info("left out the oldest turns of a conversation to fit the context of %d tokens", context)
    return best


def takes_tools(worker: WorkerState) -> bool:
    """The model's template (or its `tool_use` one) renders tools, or mlx-lm parses its calls."""
    return worker.tool_format is not None or "tools" in worker.tokenizer.every_template


def forced_call_format(worker: WorkerState) -> str | None:
    """The tool-call format a forced call's grammar is written in (gateway/structured.py):
    the model's own family, or None for a format of mlx-lm's that has no grammar here."""
    if worker.tool_format is None:
        return worker.tokenizer.tool_family
    return FAMILY_OF_PARSER.get(worker.tool_format.name)


def delta_error(delta: Delta) -> APIError:
    """The error a Delta carries, as the API error it maps to."""
    assert delta.error is not None
    if delta.error_status == 503:
        return unavailable(delta.error)
    return APIError(delta.error_status, delta.error, type=openai_error_type(delta.error_status))


async def unless_client_leaves(request: Request, work: Awaitable[T]) -> T | None:
    """What `work` returns; None if the client disconnects first, and the work
    is then cancelled (a non-streaming request's answer nobody waits for)."""
    working = asyncio.ensure_future(work)
    disconnected = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({working, disconnected}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        finished = working.done()
        disconnected.cancel()
        working.cancel()
        await asyncio.gather(working, disconnected, return_exceptions=True)
    if not finished:
        return None
    return working.result()


async def collect(deltas: AsyncGenerator[Delta], n: int) -> list[Choice]:
    """Every choice's whole text (the generation is closed however this ends)."""
    choices = [Choice() for _ in range(n)]
    async with aclosing(deltas):
        async for delta in deltas:
            if delta.error is not None:
                raise delta_error(delta)
            choices[delta.index].add(delta)
    return choices


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects. (Starlette's Request.is_disconnected
    only polls; a non-streaming request must wait for it while it generates.)"""
    while (await request.receive())["type"] != "http.disconnect":
        pass
