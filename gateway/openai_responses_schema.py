"""OpenAI Responses API request and response bodies as msgspec structs.

`input` items are checked one by one (gateway/openai_responses.py): a message
item may leave out its `type`, which a tagged union cannot express.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from gateway.images import IMAGE_LEFT_OUT
from gateway.openai_schema import MAX_INT, KeepAlive, ResponseFormatJSONObject, ResponseFormatText

# ---- requests ---------------------------------------------------------------


class InputText(msgspec.Struct, tag_field="type", tag="input_text", forbid_unknown_fields=True):
    text: str


class OutputText(msgspec.Struct, tag_field="type", tag="output_text", forbid_unknown_fields=True):
    """Text of an assistant message passed back."""

    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class Refusal(msgspec.Struct, tag_field="type", tag="refusal", forbid_unknown_fields=True):
    refusal: str


class InputImage(msgspec.Struct, tag_field="type", tag="input_image", forbid_unknown_fields=True):
    image_url: str | None = None  # a data: URL, or http(s) from a host of --allow-image-hosts
    detail: Literal["auto", "low", "high", "original"] | None = None
    file_id: None = None  # no Files API here


class MessageItem(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText | OutputText | Refusal | InputImage]
    type: Literal["message"] = "message"
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCallItem(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None
    namespace: str | None = None
    caller: dict[str, Any] | None = None  # accepted, not used
    run_async: bool | None = msgspec.field(default=None, name="async")  # accepted, not used


class FunctionCallOutputItem(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText | InputImage]
    id: str | None = None
    status: str | None = None
    name: str | None = None  # accepted, not used: the call_id names the call
    namespace: str | None = None  # accepted, not used
    caller: dict[str, Any] | None = None  # accepted, not used

    def text(self) -> str:
        """The output's text, an image in it named as left out (chat templates take no images in a tool's result)."""
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text if isinstance(part, InputText) else IMAGE_LEFT_OUT for part in self.output)


class ReasoningItemIn(msgspec.Struct, forbid_unknown_fields=True):
    """Earlier reasoning passed back: the text of its content (else of its summary) goes to the template."""

    type: Literal["reasoning"]
    summary: list[Any]
    id: str | None = None
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None

    def text(self) -> str:
        return "".join(part["text"] for part in self.content or self.summary
                       if isinstance(part, dict) and isinstance(part.get("text"), str))


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItemIn
ITEM_TYPES: dict[str, type] = {"message": MessageItem, "function_call": FunctionCallItem,
                               "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItemIn}


class FunctionTool(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    name: Annotated[str, Meta(min_length=1, max_length=128)]
    parameters: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class NamespaceTool(msgspec.Struct, forbid_unknown_fields=True):
    """Function (and custom) tools under one name; the functions are offered as any others."""

    type: Literal["namespace"]
    name: Annotated[str, Meta(min_length=1)]
    tools: Annotated[list[dict[str, Any]], Meta(min_length=1)]
    description: str | None = None


class NamedFunction(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    name: str


class TextFormatJSONSchema(msgspec.Struct, tag_field="type", tag="json_schema", forbid_unknown_fields=True,
                           omit_defaults=True):  # echoed in the response, where a description is never null
    name: str
    schema: dict[str, Any]
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, forbid_unknown_fields=True):
    format: ResponseFormatText | ResponseFormatJSONObject | TextFormatJSONSchema | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, not used


class ReasoningConfig(msgspec.Struct, forbid_unknown_fields=True):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    # A summary asked for is the reasoning itself: mlxd has no model to summarize it with.
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_obfuscation: bool | None = None  # accepted; nothing is obfuscated


class CreateResponse(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    # Function tools are offered to the model; the hosted tools (web search, file search, ...) are not.
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    # Extension (Ollama's): how long the model stays loaded once idle.
    keep_alive: KeepAlive = None
    max_output_tokens: Annotated[int, Meta(ge=1, le=MAX_INT)] | None = None
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    store: bool | None = True
    # The spec's values (what they add is hosted tools' results, or kept from a stateless client: nothing
    # here), but for the text's log-probabilities, which are not given here: a 400 (openai_responses).
    include: list[Literal["file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                          "message.input_image.image_url", "computer_call_output.output.image_url",
                          "code_interpreter_call.outputs", "reasoning.encrypted_content",
                          "message.output_text.logprobs"]] | None = None
    metadata: dict[str, str] | None = None
    # Accepted, not used: the prefix cache finds shared prefixes by itself.
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    # Accepted, not used.
    client_metadata: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: Annotated[int, Meta(ge=1)] | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    background: Literal[False] | None = None  # no background mode


# ---- responses --------------------------------------------------------------


class OutputTextPart(msgspec.Struct, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class OutputMessage(msgspec.Struct, tag_field="type", tag="message"):
    id: str
    status: str
    content: list[OutputTextPart]
    role: str = "assistant"


class ReasoningText(msgspec.Struct, tag_field="type", tag="reasoning_text"):
    text: str


class SummaryText(msgspec.Struct, tag_field="type", tag="summary_text"):
    text: str


class ReasoningOut(msgspec.Struct, tag_field="type", tag="reasoning"):
    """The model's reasoning, as `content` or, when the request asks for a summary, as `summary`."""
    id: str
    content: list[ReasoningText]
    summary: list[SummaryText] = msgspec.field(default_factory=list)
    status: str = "completed"

    @property
    def part(self) -> ReasoningText | SummaryText:
        """The one part the text goes to."""
        return (self.summary or self.content)[0]


class FunctionCallOut(msgspec.Struct, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"
    namespace: str | msgspec.UnsetType = msgspec.UNSET  # the namespace tool the function came in


OutputItem = ReasoningOut | OutputMessage | FunctionCallOut


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(msgspec.Struct):
    code: str
    message: str


class IncompleteDetails(msgspec.Struct):
    reason: str


class ResponseObject(msgspec.Struct):
    id: str
    created_at: int
    status: str
    model: str
    output: list[OutputItem]
    instructions: str | None
    tools: list[dict[str, Any]]
    tool_choice: Any
    parallel_tool_calls: bool
    temperature: float | None
    top_p: float | None
    metadata: dict[str, str]
    previous_response_id: str | None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    usage: ResponseUsage | msgspec.UnsetType = msgspec.UNSET  # absent until the response ends
    max_output_tokens: int | None = None
    store: bool = True
    text: dict[str, Any] = msgspec.field(default_factory=lambda: {"format": {"type": "text"}})
    object: str = "response"
