"""Anthropic Messages request and response bodies as msgspec structs."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from gateway.openai_schema import MAX_INT


class TextBlock(msgspec.Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    text: str
    # A prompt-caching hint; mlxd's prefix cache needs no marker, so it is accepted and has no effect.
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None


class Base64Source(msgspec.Struct, tag_field="type", tag="base64", forbid_unknown_fields=True):
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class URLSource(msgspec.Struct, tag_field="type", tag="url", forbid_unknown_fields=True):
    url: str  # fetched only from a host of --allow-image-hosts


class ImageBlock(msgspec.Struct, tag_field="type", tag="image", forbid_unknown_fields=True):
    source: Base64Source | URLSource
    cache_control: dict[str, Any] | None = None


class ToolUseBlock(msgspec.Struct, tag_field="type", tag="tool_use", forbid_unknown_fields=True):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(msgspec.Struct, tag_field="type", tag="tool_result", forbid_unknown_fields=True):
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(block.text for block in self.content)
        return self.content or ""


class ThinkingBlock(msgspec.Struct, tag_field="type", tag="thinking", forbid_unknown_fields=True):
    thinking: str
    signature: str | None = None


Block = TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock


class Message(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(msgspec.Struct, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1, max_length=128)]
    input_schema: dict[str, Any]
    description: str | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoiceAuto(msgspec.Struct, tag_field="type", tag="auto", forbid_unknown_fields=True):
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(msgspec.Struct, tag_field="type", tag="any", forbid_unknown_fields=True):
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(msgspec.Struct, tag_field="type", tag="tool", forbid_unknown_fields=True):
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(msgspec.Struct, tag_field="type", tag="none", forbid_unknown_fields=True):
    pass


class ThinkingConfig(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["enabled", "disabled"]
    budget_tokens: Annotated[int, Meta(ge=1)] | None = None


class MessagesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    max_tokens: Annotated[int, Meta(ge=1, le=MAX_INT)]
    messages: Annotated[list[Message], Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    stop_sequences: Annotated[list[str], Meta(max_length=16)] | None = None
    temperature: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, Meta(ge=0, le=MAX_INT)] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone | None = None
    thinking: ThinkingConfig | None = None


class CountTokensRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    messages: Annotated[list[Message], Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone | None = None
    thinking: ThinkingConfig | None = None


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
