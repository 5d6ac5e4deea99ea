"""Anthropic Messages request and response bodies as msgspec structs."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from gateway.images import IMAGE_LEFT_OUT
from gateway.openai_schema import MAX_INT, KeepAlive, StopStrings

# What the current SDK (anthropic 2.12, beta types included) defines is
# accepted: honoured where mlxd can, otherwise ignored, and each ignored field
# is listed in docs/api.md. Anything else is a 400 naming it.

# A prompt-caching hint, anywhere the SDK allows one: mlxd's prefix cache needs
# no marker, so it is accepted and has no effect.
CacheControl = dict[str, Any]


class TextBlock(msgspec.Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    text: str
    cache_control: CacheControl | None = None
    # Extension (Ollama's): how long the model stays loaded once idle.
    keep_alive: KeepAlive = None
    citations: list[Any] | None = None


class Base64Source(msgspec.Struct, tag_field="type", tag="base64", forbid_unknown_fields=True):
    # Anthropic's four, and AVIF, which the gateway decodes from any source (the bytes say what they are).
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp", "image/avif"]
    data: str


class URLSource(msgspec.Struct, tag_field="type", tag="url", forbid_unknown_fields=True):
    url: str  # fetched only from a host of --allow-image-hosts


class ImageBlock(msgspec.Struct, tag_field="type", tag="image", forbid_unknown_fields=True):
    source: Base64Source | URLSource
    cache_control: CacheControl | None = None
    transformations: dict[str, Any] | None = None  # ignored: what Anthropic's servers do to an image first
    # Extension (Ollama's): how long the model stays loaded once idle.
    keep_alive: KeepAlive = None


class PlainTextSource(msgspec.Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    data: str
    media_type: Literal["text/plain"] = "text/plain"


class ContentSource(msgspec.Struct, tag_field="type", tag="content", forbid_unknown_fields=True):
    content: str | list[TextBlock | ImageBlock]


class PDFSource(msgspec.Struct, tag_field="type", tag="base64", forbid_unknown_fields=True):
    data: str
    media_type: Literal["application/pdf"] = "application/pdf"


class FileSource(msgspec.Struct, tag_field="type", tag="file", forbid_unknown_fields=True):
    file_id: str


class DocumentBlock(msgspec.Struct, tag_field="type", tag="document", forbid_unknown_fields=True):
    """A document (Claude Code sends the files it reads so): its text reaches
    the model; a PDF or an uploaded file, which mlxd cannot read, is named as left out."""

    source: PlainTextSource | ContentSource | PDFSource | URLSource | FileSource
    title: str | None = None
    context: str | None = None
    citations: dict[str, Any] | None = None  # ignored: mlxd cites nothing
    cache_control: CacheControl | None = None

    def text(self) -> str:
        source = self.source
        if isinstance(source, PlainTextSource):
            body = source.data
        elif isinstance(source, ContentSource):
            body = source.content if isinstance(source.content, str) else "\n".join(
                block.text for block in source.content if isinstance(block, TextBlock))
        else:
            body = "[a PDF or file document, left out: this server reads text documents only]"
        return "\n".join(part for part in (self.title, self.context, body) if part)


class SearchResultBlock(msgspec.Struct, tag_field="type", tag="search_result", forbid_unknown_fields=True):
    content: list[TextBlock]
    source: str
    title: str
    citations: dict[str, Any] | None = None  # ignored: mlxd cites nothing
    cache_control: CacheControl | None = None

    def text(self) -> str:
        return "\n".join([f"{self.title} ({self.source})", *(block.text for block in self.content)])


class ToolUseBlock(msgspec.Struct, tag_field="type", tag="tool_use", forbid_unknown_fields=True):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    # Extension (Ollama's): how long the model stays loaded once idle.
    keep_alive: KeepAlive = None
    caller: dict[str, Any] | None = None  # ignored: which tool runner made the call
    toolset_name: str | None = None  # ignored


class ToolReferenceBlock(msgspec.Struct, tag_field="type", tag="tool_reference", forbid_unknown_fields=True):
    """A tool search's result (Claude Code's, for tools it defers): the tool it
    found. The model here sees every tool up front, so the name is all it adds."""

    tool_name: str
    cache_control: CacheControl | None = None

    def text(self) -> str:
        return f"tool found: {self.tool_name}"


class ToolResultBlock(msgspec.Struct, tag_field="type", tag="tool_result", forbid_unknown_fields=True):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock | DocumentBlock | SearchResultBlock | ToolReferenceBlock] | None = None
    is_error: bool = False
    cache_control: CacheControl | None = None
    toolset_name: str | None = None  # ignored
    # Extension (Ollama's): how long the model stays loaded once idle.
    keep_alive: KeepAlive = None

    def text(self) -> str:
        """The result's text (an image in it is named as left out: chat templates
        take no images in a tool's result), said to be an error when the tool
        failed: the template has no other way."""
        if isinstance(self.content, list):
            text = "\n".join(block.text if isinstance(block, TextBlock) else IMAGE_LEFT_OUT
                             if isinstance(block, ImageBlock) else block.text() for block in self.content)
        else:
            text = self.content or ""
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(msgspec.Struct, tag_field="type", tag="thinking", forbid_unknown_fields=True):
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(msgspec.Struct, tag_field="type", tag="redacted_thinking", forbid_unknown_fields=True):
    data: str


Block = (TextBlock | ImageBlock | DocumentBlock | SearchResultBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock
         | RedactedThinkingBlock)


Effort = Literal["low", "medium", "high", "xhigh", "max"]


class SystemOutputConfig(msgspec.Struct, forbid_unknown_fields=True):
    effort: Effort | None = None


class Message(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["user", "assistant", "system"]  # "system": a system message in the conversation
    content: str | list[Block]
    # A system message's per-turn controls (beta): accepted, not applied; the
    # message itself is rendered where it stands.
    clear_at: Literal["next_user_message", "never"] | None = None
    output_config: SystemOutputConfig | None = None


class Tool(msgspec.Struct, forbid_unknown_fields=True):
    """A tool the client runs (the SDK's "custom" type); Anthropic's server tools are not offered."""

    name: Annotated[str, Meta(min_length=1, max_length=128)]
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    # Extension (Ollama's): how long the model stays loaded once idle.
    keep_alive: KeepAlive = None
    # True: the model's calls of it (any tool's, with tool_choice auto) follow their schemas (a grammar).
    strict: bool | None = None
    # Ignored: the model sees every tool up front.
    defer_loading: bool | None = None
    input_examples: list[dict[str, Any]] | None = None
    allowed_callers: list[str] | None = None
    eager_input_streaming: bool | None = None


class ToolChoiceAuto(msgspec.Struct, tag_field="type", tag="auto", forbid_unknown_fields=True):
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(msgspec.Struct, tag_field="type", tag="any", forbid_unknown_fields=True):
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(msgspec.Struct, tag_field="type", tag="tool", forbid_unknown_fields=True):
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(msgspec.Struct, tag_field="type", tag="none", forbid_unknown_fields=True):
    pass


ToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone
Display = Literal["summarized", "omitted"]


class ThinkingEnabled(msgspec.Struct, tag_field="type", tag="enabled", forbid_unknown_fields=True):
    budget_tokens: Annotated[int, Meta(ge=1)] | None = None  # not enforced: the template's switch only
    display: Display | None = None
    block_binding: dict[str, Any] | None = None  # ignored: earlier thinking is not checked here


class ThinkingAdaptive(msgspec.Struct, tag_field="type", tag="adaptive", forbid_unknown_fields=True):
    display: Display | None = None
    block_binding: dict[str, Any] | None = None  # ignored: earlier thinking is not checked here


class ThinkingBetweenTools(msgspec.Struct, tag_field="type", tag="between_tools", forbid_unknown_fields=True):
    pass


class ThinkingDisabled(msgspec.Struct, tag_field="type", tag="disabled", forbid_unknown_fields=True):
    pass


Thinking = ThinkingEnabled | ThinkingAdaptive | ThinkingBetweenTools | ThinkingDisabled


class JSONOutputFormat(msgspec.Struct, tag_field="type", tag="json_schema", forbid_unknown_fields=True):
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct, forbid_unknown_fields=True):
    effort: Effort | None = None
    format: JSONOutputFormat | None = None
    task_budget: dict[str, Any] | None = None  # ignored: max_tokens bounds the output


class Metadata(msgspec.Struct, forbid_unknown_fields=True):
    user_id: str | None = None


class Conversation(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What /v1/messages and /v1/messages/count_tokens both take."""

    model: str
    messages: Annotated[list[Message], Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None
    # Extension (Ollama's): how long the model stays loaded once idle.
    keep_alive: KeepAlive = None
    # Its edits are not applied: earlier thinking goes to the chat template,
    # which renders it only where the model expects it.
    context_management: dict[str, Any] | None = None
    # Ignored: Anthropic's own services (containers, MCP servers, regions,
    # tiers, fallbacks, beta flags, accounts).
    betas: list[str] | None = None
    billing_policy: Any = None
    compaction: Any = None
    container: Any = None
    diagnostics: Any = None
    fallback_credit_token: str | None = None
    fallbacks: Any = None
    inference_geo: str | None = None
    mcp_servers: list[Any] | None = None
    service_tier: str | None = None
    speed: str | None = None
    thread: Any = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


class MessagesRequest(Conversation, kw_only=True):
    max_tokens: Annotated[int, Meta(ge=1, le=MAX_INT)]
    stop_sequences: StopStrings | None = None
    # No longer arguments of the SDK's create(), but sent by clients in extra_body.
    temperature: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, Meta(ge=0, le=MAX_INT)] | None = None
    stream: bool = False
    metadata: Metadata | None = None


class CountTokensRequest(Conversation, kw_only=True):
    pass


# ---- responses --------------------------------------------------------------


class Usage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class TextOut(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ThinkingOut(msgspec.Struct, tag_field="type", tag="thinking"):
    thinking: str
    signature: str = ""


class ToolUseOut(msgspec.Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


ContentOut = TextOut | ThinkingOut | ToolUseOut


class MessageOut(msgspec.Struct):
    id: str
    model: str
    content: list[ContentOut]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage
    type: str = "message"
    role: str = "assistant"
