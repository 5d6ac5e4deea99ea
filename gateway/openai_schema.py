"""OpenAI request and response bodies as msgspec structs.

Requests forbid unknown fields: a parameter we do not implement is a 400
naming it, never silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

# ---- requests ---------------------------------------------------------------

# Integers travel to the worker as msgpack int64.
MAX_INT = 2**63 - 1
MAX_N = 16
MAX_TOP_LOGPROBS = 20
# Stop strings are matched against the text at every token, on the event loop every stream shares.
MAX_STOP_STRINGS = 16
StopString = Annotated[str, Meta(max_length=1024)]
StopStrings = Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)]
Seed = Annotated[int, Meta(ge=-MAX_INT - 1, le=MAX_INT)]

# An extension (Ollama's) every generation body takes: how long the model stays
# loaded once idle, in seconds or as a duration ("5m"); negative is forever.
KeepAlive = str | int | float | None


# A message and its parts take keys they do not know (unlike a request's own
# parameters, which a 400 names): what clients carry along in the messages they
# send back, such as the SDK's stream helpers' `index` and `parsed_arguments`
# on a call, Open WebUI's `index`, OpenCode's `cache_control`, another
# server's `reasoning`. None of them changes what the model is asked.
class TextPart(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ImageURL(msgspec.Struct):
    url: str  # a data: URL, or http(s) from a host of --allow-image-hosts
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor decides the resolution


class ImagePart(msgspec.Struct, tag_field="type", tag="image_url"):
    image_url: ImageURL


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str


class ToolCallIn(msgspec.Struct):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class AudioRef(msgspec.Struct):
    id: str


class ChatMessage(msgspec.Struct):
    # "function": the deprecated function call's result, rendered as a tool's.
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    # The deprecated single call of an assistant message: rendered as a tool call.
    function_call: FunctionCall | None = None
    # Earlier reasoning, as the API returned it: the template's to render
    # (Qwen 3's does for the turns after the last user message, its tool loop).
    reasoning_content: str | None = None
    # Sent back with the assistant messages the API returns (the SDKs' usual
    # multi-turn pattern); not rendered into the prompt.
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: AudioRef | None = None

    def parts(self) -> list[TextPart | ImagePart]:
        if isinstance(self.content, list):
            return self.content
        return [TextPart(self.content)] if self.content else []


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    # OpenAI pads streamed events against length side channels; taken, not needed on a LAN server.
    include_obfuscation: bool | None = None


class GenerationRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields /v1/chat/completions and /v1/completions share."""

    model: str
    stream: bool | None = False  # null: the spec's default, false
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Meta(ge=1, le=MAX_INT)] | None = None
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(ge=0, le=1)] | None = None  # 0: only the likeliest token (greedy)
    top_k: Annotated[int, Meta(ge=-1, le=MAX_INT)] | None = None
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    seed: Seed | None = None
    stop: StopString | StopStrings | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0, le=10)] | None = None
    # Token id (as a string, as OpenAI has it) -> bias added to its logit.
    logit_bias: dict[str, Annotated[float, Meta(ge=-100, le=100)]] | None = None
    user: str | None = None
    # Extension: keep generating past EOS (benchmarks want exact lengths).
    ignore_eos: bool = False
    # Extension (Ollama's): how long the model stays loaded once idle.
    keep_alive: KeepAlive = None

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class FunctionDef(msgspec.Struct, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: NamedFunction


class ResponseFormatText(msgspec.Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    pass


class ResponseFormatJSONObject(msgspec.Struct, tag_field="type", tag="json_object", forbid_unknown_fields=True):
    pass


class JSONSchemaSpec(msgspec.Struct, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormatJSONSchema(msgspec.Struct, tag_field="type", tag="json_schema", forbid_unknown_fields=True):
    json_schema: JSONSchemaSpec


ResponseFormat = ResponseFormatText | ResponseFormatJSONObject | ResponseFormatJSONSchema


class ChatCompletionRequest(GenerationRequest):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Passed to the chat template, e.g. {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1, le=MAX_INT)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # The chat template's reasoning switches (as Responses' reasoning.effort);
    # chat_template_kwargs, where both set one, win.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    # Hints for OpenAI's own services (cache routing, abuse tracking, stored
    # completions, tiers) and a verbosity only OpenAI's models know: taken, not
    # used; clients send them when asked to (Vercel's AI SDK: `textVerbosity`).
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class CompletionRequest(GenerationRequest):
    # A string, or token ids; a list of one of those. (A list of several prompts is refused.)
    # null: the start of a new document (the spec's default, its end-of-text token).
    prompt: str | Annotated[list[int | str | list[int]], Meta(min_length=1)] | None  # required, but may be null
    logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None


# ---- responses --------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0  # tokens whose KV state was reused from the prefix cache


class CompletionTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0  # generated inside the reasoning block (counted in completion_tokens)


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = msgspec.field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails = msgspec.field(default_factory=CompletionTokensDetails)


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class FunctionOut(msgspec.Struct):
    name: str
    arguments: str


class ToolCallOut(msgspec.Struct):
    id: str
    function: FunctionOut
    type: str = "function"


class AssistantMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None
    refusal: None
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str
    logprobs: ChatLogprobs | None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class FunctionDelta(msgspec.Struct):
    name: str
    arguments: str


class ToolCallDelta(msgspec.Struct):
    index: int
    id: str
    function: FunctionDelta
    type: str = "function"


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(msgspec.Struct, omit_defaults=True):
    """A completion, or one chunk of a streamed one (which has no usage but the last)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelMemory(msgspec.Struct):
    """mlxd's: what the memory ledger charges a loaded model, in bytes."""

    weights: int
    prefix_cache: int
    kv_reserved: int
    total: int
    here: int  # this machine's share of the total (a distributed group's ranks split it)


class Model(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "mlxd"
    object: str = "model"
    # mlxd's: "loaded" (a worker serving it is ready), "loading", "unloading" (its worker is being stopped)
    # or "unloaded" (it loads on its first request).
    status: str = "loaded"
    memory: ModelMemory | None = None  # mlxd's, for a model `mlxd serve` runs, while it runs
    # mlxd's, where known (gateway/model_facts.py): its weights' bytes, "Q4" / "BF16" / ..., its context.
    size: int | None = None
    quantization: str | None = None
    context_length: int | None = None
    # Anthropic's ModelInfo, beside OpenAI's fields: /v1/models is both APIs'.
    type: str = "model"
    display_name: str = ""
    created_at: str = ""  # RFC 3339


class ModelList(msgspec.Struct):
    data: list[Model]
    object: str = "list"
    # Anthropic's page: every model is on the one page.
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None


# ---- embeddings ---------------------------------------------------------------

MAX_EMBEDDING_INPUTS = 2048


class EmbeddingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    # A text, token ids, or a list of either (checked in gateway/embeddings_api.py: a union of
    # list types is not one msgspec can tell apart).
    input: str | Annotated[list[Any], Meta(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Meta(ge=1)] | None = None
    user: str | None = None
    keep_alive: KeepAlive = None


class Embedding(msgspec.Struct):
    index: int
    embedding: list[float] | str  # base64 of little-endian float32, when asked for
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(msgspec.Struct):
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    object: str = "list"
