"""Ollama's API (/api/*): request and response bodies, as msgspec structs.

Field names and meanings follow Ollama's API reference. Requests are lax
where Ollama is (unknown fields and unknown `options` are ignored, as Ollama
ignores them: clients send options of llama.cpp's that mean nothing here);
values of known fields are checked.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from gateway.openai_schema import MAX_EMBEDDING_INPUTS, MAX_TOP_LOGPROBS, StopString

MAX_INT = 2**31 - 1
KeepAlive = str | float | None


class Options(msgspec.Struct):
    """The `options` mlxd maps onto its sampling; the others are ignored.
    As lax as Ollama's Go: values it takes are taken (clamped into what
    sampling allows, a float where an integer goes cut to one), not refused."""

    temperature: Annotated[float, Meta(ge=0)] | None = None
    top_p: Annotated[float, Meta(ge=0)] | None = None  # above 1: 1 (off), as Ollama takes it
    top_k: Annotated[float, Meta(le=MAX_INT)] | None = None  # 0 or less: off, as in llama.cpp
    min_p: float | None = None
    seed: Annotated[float, Meta(ge=-MAX_INT - 1, le=MAX_INT)] | None = None
    num_predict: float | None = None  # 0 or less: no limit (-2, Ollama's "fill the context", is the same here)
    # Editors' autocomplete (Continue) sends a stop string per keyword that starts a new statement.
    stop: Annotated[list[StopString], Meta(max_length=64)] | None = None
    repeat_penalty: float | None = None  # 0 or less: 1 (off), as Ollama takes it
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class ToolCallFunction(msgspec.Struct):
    name: str
    arguments: dict[str, Any] = {}
    # The call's place among the answer's calls (0, 1, ...): clients that take
    # streamed calls as OpenAI's deltas merge those of one index into one call.
    index: int | None = 0  # null as Go reads it, should a client send one back


class ToolCall(msgspec.Struct, omit_defaults=True):
    function: ToolCallFunction
    id: str | None = None  # what a `tool` message's tool_call_id names


class Message(msgspec.Struct):
    role: str
    content: str = ""
    images: list[str] | None = None  # base64
    tool_calls: list[ToolCall] | None = None
    thinking: str | None = None
    tool_name: str | None = None  # on a "tool" message: the tool whose result it is
    tool_call_id: str | None = None  # on a "tool" message: the call it answers


class FunctionDefinition(msgspec.Struct):
    name: Annotated[str, Meta(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDefinition(msgspec.Struct):
    function: FunctionDefinition
    type: Literal["function"] = "function"


class GenerationRequest(msgspec.Struct):
    """What /api/chat and /api/generate both take."""

    model: Annotated[str, Meta(min_length=1)]
    format: str | dict[str, Any] | None = None  # "json", or a JSON schema
    options: Options | None = None
    stream: bool = True
    keep_alive: KeepAlive = None
    think: bool | str | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] = 0  # the likeliest tokens beside each
    # A conversation longer than the context loses its oldest turns (false: a 400 instead). Generation
    # stops where the context ends, shift or not: nothing slides the window along.
    truncate: bool = True
    shift: bool = True


class ChatRequest(GenerationRequest):
    messages: list[Message] = []
    tools: list[ToolDefinition] | None = None


class GenerateRequest(GenerationRequest):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None


class EmbedRequest(msgspec.Struct):
    model: Annotated[str, Meta(min_length=1)]
    input: str | Annotated[list[str], Meta(max_length=MAX_EMBEDDING_INPUTS)] = ""  # none: load the model
    truncate: bool = True
    dimensions: Annotated[int, Meta(ge=1)] | None = None
    keep_alive: KeepAlive = None
    options: dict[str, Any] | None = None  # none of them means anything to an embedding here


class EmbeddingsRequest(msgspec.Struct):
    """The older /api/embeddings: one prompt, one vector."""

    model: Annotated[str, Meta(min_length=1)]
    prompt: str = ""  # none: load the model
    keep_alive: KeepAlive = None
    options: dict[str, Any] | None = None  # none of them means anything to an embedding here


class ShowRequest(msgspec.Struct):
    model: str = ""
    name: str = ""  # what older clients send
    verbose: bool = False  # the tokenizer's whole vocabulary in model_info: not given here


# ---- responses --------------------------------------------------------------


class Details(msgspec.Struct):
    format: str
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str
    parent_model: str = ""


class ModelEntry(msgspec.Struct, omit_defaults=True):
    """One model of /api/tags; /api/ps adds when it unloads and its memory."""

    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: Details
    expires_at: str | None = None
    size_vram: int | None = None
    context_length: int | None = None


class OutMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str
    thinking: str | None = None
    tool_calls: list[ToolCall] | None = None


class TokenLogprob(msgspec.Struct, omit_defaults=True):
    token: str
    logprob: float
    bytes: list[int] | None = None  # the token's own bytes: its text may be part of a character


class Logprob(TokenLogprob, omit_defaults=True):
    top_logprobs: list[TokenLogprob] | None = None


class _Chunk(msgspec.Struct, omit_defaults=True, kw_only=True):
    """A streamed line, or a whole response; the last (done) carries why it
    ended and its counts and durations (nanoseconds)."""

    model: str
    created_at: str
    done: bool
    done_reason: str | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None
    logprobs: list[Logprob] | None = None  # the tokens of this piece, when asked for


class ChatChunk(_Chunk, kw_only=True):
    message: OutMessage


class GenerateChunk(_Chunk, kw_only=True):
    response: str
    thinking: str | None = None


class Embed(msgspec.Struct):
    model: str
    embeddings: list[list[float]]
    total_duration: int
    load_duration: int
    prompt_eval_count: int
