"""OpenAI's dialect: /v1/chat/completions, /v1/completions and /v1/models.

A body becomes a Plan (gateway/plan.py); `Serving.respond` runs it; the
outputs below render its Deltas as OpenAI's SSE chunks or one body.
"""

from __future__ import annotations

import abc
import codecs
import time
import uuid
from typing import cast

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import APIError, decode_body, error_body
from gateway.images import ImageSource
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
    CompletionTokensDetails,
    FunctionDelta,
    FunctionOut,
    GenerationRequest,
    ImagePart,
    Model,
    ModelList,
    ModelMemory,
    NamedToolChoice,
    PromptTokensDetails,
    ResponseFormatJSONObject,
    ResponseFormatJSONSchema,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
    Usage,
)
from gateway.output_processor import Delta, RequestGroup, TokenInfo
from gateway.parsing import ToolCall
from gateway.plan import (
    DOCUMENT_START,
    ChatInput,
    NamedTool,
    Plan,
    SamplingParams,
    function_tool,
    keep_alive_seconds,
    nonempty_stops,
    reasoning_switches,
    streamed,
    template_message,
    template_tool_call,
    tool_definitions,
)
from gateway.responses import SSE, MsgspecResponse, sse_event, timestamp
from gateway.serving import Choice, Serving

DONE = b"data: [DONE]\n\n"
KEEPALIVE_COMMENT = b": keepalive\n\n"


def sampling_params(body: GenerationRequest, logprobs: int | None) -> SamplingParams:
    return SamplingParams(
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
        repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0, seed=body.seed, ignore_eos=body.ignore_eos,
        logit_bias=body.logit_bias, logprobs=logprobs, n=body.n or 1,
    )


def chat_input(body: ChatCompletionRequest) -> ChatInput:
    """The messages as chat templates take them (tool call arguments as
    objects), and the image parts among them, in order."""
    messages = []
    images = []
    for i, m in enumerate(body.messages):
        if m.role != "assistant" and m.content is None:
            raise APIError(400, f"messages[{i}] ({m.role}) needs content", param=f"messages[{i}].content")
        parts = []
        for j, part in enumerate(m.parts()):
            if isinstance(part, ImagePart):
                images.append(ImageSource(f"messages[{i}].content[{j}]", url=part.image_url.url))
                parts.append({"type": "image"})
            else:
                parts.append({"type": "text", "text": part.text})
        calls = [template_tool_call(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or []]
        if m.function_call is not None and not calls:
            calls = [template_tool_call(f"call_{i}", m.function_call.name, m.function_call.arguments)]
        extra = {key: value for key, value in (("tool_call_id", m.tool_call_id), ("name", m.name)) if value is not None}
        if m.role == "function":  # answers the deprecated function_call, which has no id
            extra.setdefault("tool_call_id", _answered_call_id(body.messages, i))
        role = {"developer": "system", "function": "tool"}.get(m.role, m.role)
        messages.append(template_message(role, parts, calls, m.reasoning_content or "", **extra))
    switches = reasoning_switches(body.reasoning_effort)
    kwargs = {**switches, **(body.chat_template_kwargs or {})} if switches else body.chat_template_kwargs
    return ChatInput(messages, images, kwargs)


def _answered_call_id(messages: list, index: int) -> str:
    """The id chat_input gives the latest function_call before messages[index]."""
    return next((f"call_{i}" for i in range(index - 1, -1, -1) if messages[i].function_call is not None), "call_0")


def chat_plan(body: ChatCompletionRequest) -> Plan:
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    choice = body.tool_choice or "auto"
    tools = tool_definitions([function_tool(t.function.name, t.function.description, t.function.parameters)
                              for t in body.tools or []],
                             NamedTool(choice.function.name) if isinstance(choice, NamedToolChoice) else choice)
    spec = body.response_format.json_schema if isinstance(body.response_format, ResponseFormatJSONSchema) else None
    return Plan(
        model=body.model,
        prompt=chat_input(body),
        sampling=sampling_params(body, (body.top_logprobs or 0) if body.logprobs else None),
        stops=nonempty_stops(body.stop_strings(), "stop"),
        stream=streamed(body.stream, body.stream_options),
        max_tokens=body.max_completion_tokens or body.max_tokens,
        max_tokens_param="max_completion_tokens" if body.max_completion_tokens else "max_tokens",
        tools=tools,
        force_tool_call=choice == "required" or isinstance(choice, NamedToolChoice),
        strict_tools=any(t.function.strict for t in body.tools or []),
        parallel_tool_calls=body.parallel_tool_calls is not False,
        json_output=isinstance(body.response_format, (ResponseFormatJSONObject, ResponseFormatJSONSchema)),
        json_schema=spec.schema if spec is not None else None,
        json_schema_strict=spec is not None and spec.strict is True,
        keep_alive_s=keep_alive_seconds(body.keep_alive),
    )


def completion_plan(body: CompletionRequest) -> Plan:
    prompt: str | list | None = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a list of one prompt (text or token ids)
    if isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt):
        raise APIError(400, "a list of several prompts is not supported; send one request per prompt", param="prompt")
    return Plan(
        model=body.model,
        prompt=DOCUMENT_START if prompt is None else prompt if isinstance(prompt, str)
        else [t for t in prompt if isinstance(t, int)],
        sampling=sampling_params(body, body.logprobs),
        stops=nonempty_stops(body.stop_strings(), "stop"),
        stream=streamed(body.stream, body.stream_options),
        max_tokens=body.max_tokens,
        keep_alive_s=keep_alive_seconds(body.keep_alive),
    )


class OpenAIAPI:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def models(self, _request: Request) -> Response:
        models = [self._model(name, name) for name in self.serving.model_names()]
        return MsgspecResponse(ModelList(models, first_id=models[0].id if models else None,
                                         last_id=models[-1].id if models else None))

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        return MsgspecResponse(self._model(name, self.serving.served_name(name, self.serving.model_names())))

    def _model(self, name: str, served: str) -> Model:
        """`name` as a client asked for it, served by the model `served`."""
        pool = self.serving.pool
        charge = pool.charge(served)
        facts = self.serving.model_facts(served)
        return Model(id=name, created=self.serving.started, status=pool.status(served),
                     memory=ModelMemory(**charge.as_dict()) if charge else None, size=facts.size or None,
                     quantization=facts.quantization or None, context_length=facts.context_length,
                     display_name=name, created_at=timestamp(self.serving.started))

    async def chat_completions(self, request: Request) -> Response:
        body = decode_body(await self.serving.read_body(request), ChatCompletionRequest)
        return await self.serving.respond(request, chat_plan(body), ChatOutput(body.model, _include_usage(body)))

    async def completions(self, request: Request) -> Response:
        body = decode_body(await self.serving.read_body(request), CompletionRequest)
        return await self.serving.respond(request, completion_plan(body), CompletionOutput(body.model,
                                                                                         _include_usage(body)))


def _include_usage(body: GenerationRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _usage(group: RequestGroup) -> Usage:
    return Usage(group.prompt_tokens, group.completion_tokens, group.prompt_tokens + group.completion_tokens,
                 PromptTokensDetails(group.cached_tokens), CompletionTokensDetails(group.reasoning_tokens))


class _Output(abc.ABC):
    """One request's renderer (serving.Renderer): its SSE chunks and body; one subclass per endpoint."""

    prefix = ""
    media_type = SSE

    def __init__(self, model: str, include_usage: bool) -> None:
        self.id = f"{self.prefix}{uuid.uuid4().hex}"
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage
        self._opened: set[int] = set()

    def opening(self, group: RequestGroup) -> list[bytes]:
        return []

    def delta(self, delta: Delta) -> list[bytes]:
        out = []
        if delta.index not in self._opened:
            self._opened.add(delta.index)
            if (first := self.first_chunk(delta.index)) is not None:
                out.append(sse_event(first))
        out += self.content_chunks(delta)
        if delta.finish_reason is not None:
            out.append(sse_event(self.chunk(delta.index, None, delta.finish_reason, [])))
        return out

    def keepalive(self) -> list[bytes]:
        # A comment: every SSE reader skips it, and proxies see the connection busy. (Chunks have
        # no type to mark one as nothing; an empty delta would be a new chunk to every client.)
        return [KEEPALIVE_COMMENT]

    def content_chunks(self, delta: Delta) -> list[bytes]:
        if delta.text or delta.logprobs:
            return [sse_event(self.chunk(delta.index, delta.text, None, delta.logprobs))]
        return []

    def ending(self, group: RequestGroup, error: APIError | None) -> list[bytes]:
        out = [sse_event(error_body(error.message, error.type, code=error.code))] if error is not None else []
        if self.include_usage:
            out.append(sse_event(self.usage_chunk(_usage(group))))
        return out + [DONE]

    def body(self, choices: list[Choice], group: RequestGroup) -> msgspec.Struct:
        return self.response(choices, _usage(group))

    def first_chunk(self, index: int) -> msgspec.Struct | None:
        return None

    @abc.abstractmethod
    def chunk(self, index: int, text: str | None, finish_reason: str | None,
              logprobs: list[TokenInfo]) -> msgspec.Struct: ...

    @abc.abstractmethod
    def usage_chunk(self, usage: Usage) -> msgspec.Struct: ...

    @abc.abstractmethod
    def response(self, choices: list[Choice], usage: Usage) -> msgspec.Struct: ...


class ChatOutput(_Output):
    prefix = "chatcmpl-"

    def __init__(self, model: str, include_usage: bool) -> None:
        super().__init__(model, include_usage)
        self._calls_sent: dict[int, int] = {}

    def content_chunks(self, delta: Delta) -> list[bytes]:
        """Reasoning, text, then tool calls."""
        out = [sse_event(self._reasoning_chunk(delta.index, delta.reasoning))] if delta.reasoning else []
        out += super().content_chunks(delta)
        if delta.tool_calls:
            out.append(sse_event(self._tool_calls_chunk(delta.index, delta.tool_calls)))
        return out

    def _reasoning_chunk(self, index: int, reasoning: str) -> ChatCompletionChunk:
        return self._chunk([ChatChunkChoice(index, ChatDelta(reasoning_content=reasoning))])

    def _tool_calls_chunk(self, index: int, calls: list[ToolCall]) -> ChatCompletionChunk:
        first = self._calls_sent.get(index, 0)
        self._calls_sent[index] = first + len(calls)
        return self._chunk([ChatChunkChoice(index, ChatDelta(tool_calls=[
            ToolCallDelta(first + i, c.id, FunctionDelta(c.name, c.arguments)) for i, c in enumerate(calls)
        ]))])

    @staticmethod
    def _logprobs(tokens: list[TokenInfo]) -> ChatLogprobs:
        return ChatLogprobs([
            ChatTokenLogprob(
                t.text, t.logprob, list(t.raw),
                [TopLogprob(alt, lp, list(raw)) for alt, raw, lp in t.top],
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
            ChatChoice(i, self._message(c), cast(str, c.finish_reason),
                       self._logprobs(c.logprobs) if c.logprobs else None)
            for i, c in enumerate(choices)
        ], usage)

    def _message(self, choice: Choice) -> AssistantMessage:
        calls = choice.tool_calls
        return AssistantMessage(
            "assistant",
            None if calls and not choice.text.strip() else choice.text,
            None,
            [ToolCallOut(c.id, FunctionOut(c.name, c.arguments)) for c in calls] or None,
            choice.reasoning or None,
        )


class CompletionOutput(_Output):
    prefix = "cmpl-"

    def __init__(self, model: str, include_usage: bool) -> None:
        super().__init__(model, include_usage)
        # Per choice: where its next token's text begins, and the bytes of a character begun and not ended.
        self._text_offsets: dict[int, int] = {}
        self._characters: dict[int, codecs.IncrementalDecoder] = {}

    def _logprobs(self, index: int, tokens: list[TokenInfo]) -> CompletionLogprobs:
        """text_offset: where each token's text begins in the choice's text, counted over the tokens'
        bytes: a token holding part of a character (its text reads U+FFFD) begins where the character does."""
        characters = self._characters.setdefault(index, codecs.getincrementaldecoder("utf-8")("replace"))
        offset = self._text_offsets.get(index, 0)
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(characters.decode(t.raw))
        self._text_offsets[index] = offset
        return CompletionLogprobs(
            [t.text for t in tokens], [t.logprob for t in tokens], [{alt: lp for alt, _, lp in t.top} for t in tokens],
            offsets
        )

    def chunk(self, index: int, text: str | None, finish_reason: str | None, logprobs: list[TokenInfo]):
        return Completion(self.id, "text_completion", self.created, self.model, [
            CompletionChoice(index, text or "", finish_reason, self._logprobs(index, logprobs) if logprobs else None)
        ])

    def usage_chunk(self, usage: Usage) -> Completion:
        return Completion(self.id, "text_completion", self.created, self.model, [], usage)

    def response(self, choices: list[Choice], usage: Usage) -> Completion:
        return Completion(self.id, "text_completion", self.created, self.model, [
            CompletionChoice(i, c.text, c.finish_reason, self._logprobs(i, c.logprobs) if c.logprobs else None)
            for i, c in enumerate(choices)
        ], usage)
