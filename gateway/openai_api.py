"""OpenAI's /v1/chat/completions, /v1/completions and /v1/models.

Each handler validates its body, builds the prompt and one Sampling per
choice, and hands them to `Serving` (gateway/serving.py), which runs them in
the worker; then it turns the Deltas into OpenAI's SSE chunks or one body.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import cast

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import APIError, decode_body, error_body, openai_error_type
from gateway.generation import TokenInfo
from gateway.images import ImageSource
from gateway.json_response import MsgspecResponse
from gateway.openai_schema import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    FunctionDelta,
    FunctionOut,
    GenerationRequest,
    ImagePart,
    Model,
    ModelList,
    NamedToolChoice,
    PromptTokensDetails,
    ResponseFormatJSONObject,
    ResponseFormatJSONSchema,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
    Usage,
)
from gateway.parsing import ToolCall, stream_parsers
from gateway.serving import Choice, EventStream, Generation, Serving, collect, nonempty_stops
from gateway.structured import forced_tool_call_grammar, json_schema_grammar, named_tool
from gateway.tokenizer import Prompt, template_content
from gateway.worker_link import WorkerState
from protocol import Sampling

_json = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


def sse(payload) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"


def samplings(body: GenerationRequest, max_tokens: int, logprobs: int | None, worker: WorkerState,
              grammar: str | None = None) -> list[Sampling]:
    """One Sampling per choice, the model's defaults where the body is silent;
    with a seed, choice i samples with seed + i."""
    vocab_size = worker.hello.vocab_size
    defaults = worker.sampling
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        if not key.lstrip("-").isdigit() or not 0 <= int(key) < vocab_size:
            raise APIError(400, f"logit_bias key {key!r} is not a token id of this model (0..{vocab_size - 1})",
                           param="logit_bias")
        bias[int(key)] = value
    base = Sampling(
        max_tokens=max_tokens,
        temperature=defaults.temperature if body.temperature is None else body.temperature,
        top_p=defaults.top_p if body.top_p is None else body.top_p,
        top_k=defaults.top_k if body.top_k is None else max(body.top_k, 0),
        min_p=defaults.min_p if body.min_p is None else body.min_p,
        seed=body.seed,
        ignore_eos=body.ignore_eos,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=defaults.repetition_penalty if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=bias,
        logprobs=logprobs,
        grammar=grammar,
    )
    n = body.n or 1
    if body.seed is None:
        return [base] * n
    return [msgspec.structs.replace(base, seed=body.seed + i) for i in range(n)]


def template_messages(messages: list, vision: bool) -> tuple[list[dict], list[ImageSource]]:
    """Chat messages as chat templates expect them (tool call arguments as
    objects), and the image parts among them, in order."""
    out = []
    images = []
    for i, m in enumerate(messages):
        parts = []
        for j, part in enumerate(m.parts()):
            if isinstance(part, ImagePart):
                images.append(ImageSource(f"messages[{i}].content[{j}]", url=part.image_url.url))
                parts.append({"type": "image"})
            else:
                parts.append({"type": "text", "text": part.text})
        message: dict = {"role": "system" if m.role == "developer" else m.role,
                         "content": template_content(parts, vision)}
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                              "arguments": _json_or_text(c.function.arguments)}}
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out, images


def _json_or_text(arguments: str):
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def tool_definitions(body: ChatCompletionRequest) -> list[dict] | None:
    """The tools to render into the prompt: none with tool_choice "none", only
    the named one with a named tool_choice."""
    if not body.tools or body.tool_choice == "none":
        if isinstance(body.tool_choice, NamedToolChoice) or body.tool_choice == "required":
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    tools = [msgspec.to_builtins(t) for t in body.tools]
    if isinstance(body.tool_choice, NamedToolChoice):
        return named_tool(tools, body.tool_choice.function.name)
    return tools


def chat_grammar(body: ChatCompletionRequest, tools: list[dict] | None, family: str) -> str | None:
    """The grammar a chat request's output must follow: its response_format, or a
    forced tool call (tool_choice "required" or a named function)."""
    forced = body.tool_choice == "required" or isinstance(body.tool_choice, NamedToolChoice)
    structured = isinstance(body.response_format, (ResponseFormatJSONObject, ResponseFormatJSONSchema))
    if forced and structured:
        raise APIError(400, "a forced tool_choice and a JSON response_format cannot both constrain the output",
                       param="response_format")
    if forced:
        assert tools is not None  # tool_definitions refused a forced choice without tools
        return forced_tool_call_grammar(tools, family)
    if isinstance(body.response_format, ResponseFormatJSONSchema):
        return json_schema_grammar(body.response_format.json_schema.schema)
    if isinstance(body.response_format, ResponseFormatJSONObject):
        return json_schema_grammar(None)
    return None


class OpenAIAPI:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def models(self, _request: Request) -> Response:
        body = ModelList([Model(id=name, created=self.serving.started) for name in self.serving.model_names()])
        return MsgspecResponse(body)

    async def chat_completions(self, request: Request) -> Response:
        body: ChatCompletionRequest = decode_body(await self.serving.read_body(request), ChatCompletionRequest)
        stop = nonempty_stops(body.stop_strings(), "stop")
        for i, m in enumerate(body.messages):
            if m.role != "assistant" and m.content is None:
                raise APIError(400, f"messages[{i}] ({m.role}) needs content", param=f"messages[{i}].content")
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        tools = tool_definitions(body)
        worker = await self.serving.worker_for(body.model)
        messages, images = template_messages(body.messages, worker.hello.vision)
        prompt = await self.serving.chat_prompt(worker, messages, tools, body.chat_template_kwargs, images)
        requested = body.max_completion_tokens or body.max_tokens
        max_tokens = self.serving.max_tokens(
            prompt.token_ids, requested, worker, "messages", "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        )
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        output = ChatOutput(body.model, parallel_tool_calls=body.parallel_tool_calls is not False)
        family = worker.tokenizer.tool_family
        grammar = chat_grammar(body, tools, family)
        parsers = stream_parsers(worker.tokenizer.reasoning_markers, family, prompt.text, bool(tools))
        generation = self.serving.start(
            request, worker, output.id, prompt,
            samplings(body, max_tokens, logprobs, worker, grammar), stop, parsers,
        )
        return await self.respond(request, body, generation, output)

    async def completions(self, request: Request) -> Response:
        body: CompletionRequest = decode_body(await self.serving.read_body(request), CompletionRequest)
        stop = nonempty_stops(body.stop_strings(), "stop")
        prompt_in = body.prompt
        if isinstance(prompt_in, list) and len(prompt_in) == 1 and isinstance(prompt_in[0], str):
            prompt_in = prompt_in[0]
        if isinstance(prompt_in, list) and not all(isinstance(t, int) for t in prompt_in):
            raise APIError(400, "a list of several prompts is not supported; send one request per prompt", param="prompt")
        worker = await self.serving.worker_for(body.model)
        if isinstance(prompt_in, str):
            prompt = Prompt(prompt_in, await self.serving.tokenize(worker.tokenizer.encode_text, prompt_in,
                                                                   param="prompt"))
        else:
            vocab = worker.hello.vocab_size
            token_ids = [t for t in prompt_in if isinstance(t, int)]  # all of them (checked above)
            bad = next((t for t in token_ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="prompt")
            prompt = Prompt("", token_ids)
        max_tokens = self.serving.max_tokens(prompt.token_ids, body.max_tokens, worker, "prompt")
        output = CompletionOutput(body.model)
        generation = self.serving.start(
            request, worker, output.id, prompt, samplings(body, max_tokens, body.logprobs, worker),
            stop,
        )
        return await self.respond(request, body, generation, output)

    async def respond(self, request: Request, body: GenerationRequest, generation: Generation, output) -> Response:
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return EventStream(self._events(generation, output, include_usage), generation)
        choices = await collect(request, generation, self.serving)
        if choices is None:
            return Response(status_code=499)  # nobody is listening
        self.serving.log_completion(output.id, [c.text for c in choices])
        usage = _usage(generation)
        return MsgspecResponse(output.response(choices, usage))

    async def _events(self, generation: Generation, output, include_usage: bool) -> AsyncIterator[bytes]:
        sent: list[str] = []
        try:
            for index in range(len(generation.group.streams)):
                if (first := output.first_chunk(index)) is not None:
                    yield sse(first)
            try:
                async for delta in generation.deltas():
                    if delta.error is not None:
                        yield sse(error_body(delta.error, openai_error_type(delta.error_status)))
                        break
                    if delta.reasoning:
                        yield sse(output.reasoning_chunk(delta.index, delta.reasoning))
                    if delta.text or delta.logprobs:
                        yield sse(output.chunk(delta.index, delta.text, None, delta.logprobs))
                        sent.append(delta.text)
                    if delta.tool_calls:
                        yield sse(output.tool_calls_chunk(delta.index, delta.tool_calls))
                    if delta.finish_reason is not None:
                        yield sse(output.chunk(delta.index, None, delta.finish_reason, []))
            except TimeoutError:
                yield sse(error_body(self.serving.timed_out(), "timeout", code="timeout"))
            if include_usage:
                yield sse(output.usage_chunk(_usage(generation)))
            yield DONE
        finally:
            self.serving.log_completion(output.id, ["".join(sent)])


def _usage(generation: Generation) -> Usage:
    group = generation.group
    return Usage(group.prompt_tokens, group.completion_tokens, group.prompt_tokens + group.completion_tokens,
                 PromptTokensDetails(group.cached_tokens))


def _token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


class _Output:
    """Builds one request's response bodies; one subclass per endpoint."""

    prefix = ""

    def __init__(self, model: str) -> None:
        self.id = f"{self.prefix}{uuid.uuid4().hex}"
        self.model = model
        self.created = int(time.time())


class ChatOutput(_Output):
    prefix = "chatcmpl-"

    def __init__(self, model: str, parallel_tool_calls: bool = True) -> None:
        super().__init__(model)
        self.parallel_tool_calls = parallel_tool_calls
        self._calls_sent: dict[int, int] = {}

    def _allowed(self, index: int, calls: list[ToolCall]) -> list[ToolCall]:
        """With parallel_tool_calls false, only a choice's first call."""
        if self.parallel_tool_calls:
            return calls
        return calls[: max(1 - self._calls_sent.get(index, 0), 0)]

    def reasoning_chunk(self, index: int, reasoning: str) -> ChatCompletionChunk:
        return self._chunk([ChatChunkChoice(index, ChatDelta(reasoning_content=reasoning))])

    def tool_calls_chunk(self, index: int, calls: list[ToolCall]) -> ChatCompletionChunk | None:
        calls = self._allowed(index, calls)
        first = self._calls_sent.get(index, 0)
        self._calls_sent[index] = first + len(calls)
        return self._chunk([ChatChunkChoice(index, ChatDelta(tool_calls=[
            ToolCallDelta(first + i, c.id, FunctionDelta(c.name, c.arguments)) for i, c in enumerate(calls)
        ]))])

    @staticmethod
    def _logprobs(tokens: list[TokenInfo]) -> ChatLogprobs:
        return ChatLogprobs([
            ChatTokenLogprob(
                t.text, t.logprob, _token_bytes(t.text),
                [TopLogprob(alt, lp, _token_bytes(alt)) for alt, lp in t.top],
            )
            for t in tokens
        ])

    def _chunk(self, choices, usage=None) -> ChatCompletionChunk:
        return ChatCompletionChunk(self.id, self.created, self.model, choices, usage)

    def first_chunk(self, index: int) -> ChatCompletionChunk:
        return self._chunk([ChatChunkChoice(index, ChatDelta(role="assistant", content=""))])

    def chunk(self, index: int, text: str | None, finish_reason: str | None, logprobs: list[TokenInfo]):
        return self._chunk([
            ChatChunkChoice(index, ChatDelta(content=text), finish_reason, self._logprobs(logprobs) if logprobs else None)
        ])

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return self._chunk([], usage)

    def response(self, choices: list[Choice], usage: Usage) -> ChatCompletion:
        return ChatCompletion(self.id, self.created, self.model, [
            # Every choice of a collected response has finished.
            ChatChoice(i, self._message(i, c), cast(str, c.finish_reason),
                       self._logprobs(c.logprobs) if c.logprobs else None)
            for i, c in enumerate(choices)
        ], usage)

    def _message(self, index: int, choice: Choice) -> AssistantMessage:
        calls = self._allowed(index, choice.tool_calls)
        return AssistantMessage(
            "assistant",
            None if calls and not choice.text.strip() else choice.text,
            None,
            [ToolCallOut(c.id, FunctionOut(c.name, c.arguments)) for c in calls] or None,
            choice.reasoning or None,
        )


class CompletionOutput(_Output):
    prefix = "cmpl-"

    @staticmethod
    def _logprobs(tokens: list[TokenInfo], offset: int = 0) -> CompletionLogprobs:
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t.text)
        return CompletionLogprobs(
            [t.text for t in tokens], [t.logprob for t in tokens], [dict(t.top) for t in tokens], offsets
        )

    def first_chunk(self, index: int) -> None:
        return None

    def chunk(self, index: int, text: str | None, finish_reason: str | None, logprobs: list[TokenInfo]):
        return Completion(self.id, "text_completion", self.created, self.model, [
            CompletionChoice(index, text or "", finish_reason, self._logprobs(logprobs) if logprobs else None)
        ])

    def usage_chunk(self, usage: Usage) -> Completion:
        return Completion(self.id, "text_completion", self.created, self.model, [], usage)

    def response(self, choices: list[Choice], usage: Usage) -> Completion:
        return Completion(self.id, "text_completion", self.created, self.model, [
            CompletionChoice(i, c.text, c.finish_reason, self._logprobs(c.logprobs) if c.logprobs else None)
            for i, c in enumerate(choices)
        ], usage)
