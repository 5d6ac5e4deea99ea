"""Anthropic's dialect: /v1/messages and /v1/messages/count_tokens.

A body becomes a Plan (gateway/plan.py); `Serving.respond` runs it; a
`MessageOutput` renders its Deltas as Anthropic's SSE event sequence or one
message, with Anthropic's stop reasons and error shape.
"""

from __future__ import annotations

import base64
import uuid

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from gateway.anthropic_schema import (
    Base64Source,
    Block,
    Conversation,
    CountTokensRequest,
    DocumentBlock,
    ImageBlock,
    MessageOut,
    MessagesRequest,
    SearchResultBlock,
    TextBlock,
    TextOut,
    ThinkingBlock,
    ThinkingDisabled,
    ThinkingOut,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseOut,
    Usage,
)
from gateway.errors import APIError, anthropic_error_body, decode_body
from gateway.images import ImageSource
from gateway.output_processor import Delta, RequestGroup
from gateway.parsing import ToolCall, arguments_object
from gateway.plan import (
    ChatInput,
    NamedTool,
    Plan,
    SamplingParams,
    function_tool,
    keep_alive_seconds,
    nonempty_stops,
    reasoning_switches,
    template_message,
    template_tool_call,
    tool_definitions,
)
from gateway.responses import SSE, MsgspecResponse, sse_event
from gateway.serving import Choice, Serving

# Thinking blocks come back signed, their signature carrying the reasoning: a
# client shown none of it (`display: "omitted"`, as Claude Code asks) sends the
# block back as it came, and the template replays the reasoning of a tool loop
# (Qwen 3's, after the last user message) as the model wrote it.
SIGNATURE_PREFIX = "mlxd-reasoning:"


def event(name: str, payload: dict) -> bytes:
    return sse_event(payload, name)


def signature_of(reasoning: str) -> str:
    return SIGNATURE_PREFIX + base64.b64encode(reasoning.encode()).decode()


def reasoning_of(block: ThinkingBlock) -> str:
    """A thinking block's reasoning: its text, or what its signature carries where it has none."""
    signature = block.signature or ""
    if block.thinking or not signature.startswith(SIGNATURE_PREFIX):
        return block.thinking
    try:
        return base64.b64decode(signature.removeprefix(SIGNATURE_PREFIX), validate=True).decode()
    except ValueError:  # not one of ours after all (binascii.Error, UnicodeDecodeError)
        return ""


def stop_reason(finish_reason: str | None, stop_string: str | None, calls: int,
                context_bound: bool = False) -> tuple[str, str | None]:
    """The message's stop_reason, and its stop_sequence (only with stop_reason "stop_sequence").
    context_bound: the context had less room than max_tokens asked for (the generation's limit was its
    room), so a length stop is the context window's, not max_tokens' (Claude Code asks for 128,000). A message
    cut short says so even after a whole call: the next call may be what was cut."""
    if finish_reason == "length":
        return "model_context_window_exceeded" if context_bound else "max_tokens", None
    if calls:
        return "tool_use", None
    if stop_string is not None:
        return "stop_sequence", stop_string
    return "end_turn", None


def chat_input(body: Conversation) -> ChatInput:
    """Anthropic messages as the chat template's messages, and their image
    blocks, in order. Consecutive messages of one role are one turn, as
    Anthropic joins them (templates that insist on alternating roles refuse
    them apart). Earlier thinking goes to the template as the turn's
    `reasoning_content`, for templates that replay it (Qwen 3's, after the
    last user message: an agent's tool loop)."""
    messages = []
    images = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "\n\n".join(b.text for b in body.system)
        messages.append(template_message("system", [{"type": "text", "text": system}]))
    turns: list[tuple[str, list[tuple[str, Block]]]] = []  # (role, [(the block's parameter, block)])
    for i, m in enumerate(body.messages):
        blocks = [TextBlock(m.content)] if isinstance(m.content, str) else m.content
        placed = [(f"messages[{i}].content[{j}]", block) for j, block in enumerate(blocks)]
        if turns and turns[-1][0] == m.role:
            turns[-1][1].extend(placed)
        else:
            turns.append((m.role, placed))
    for role, placed in turns:
        parts: list[dict] = []
        tool_calls = []
        thinking = []
        for param, block in placed:
            if isinstance(block, TextBlock):
                parts.append({"type": "text", "text": block.text})
            elif isinstance(block, DocumentBlock | SearchResultBlock):
                parts.append({"type": "text", "text": block.text()})
            elif isinstance(block, ImageBlock):
                source = block.source
                images.append(ImageSource(f"{param}.source", data=source.data) if isinstance(source, Base64Source)
                              else ImageSource(f"{param}.source", url=source.url))
                parts.append({"type": "image"})
            elif isinstance(block, ToolUseBlock):
                tool_calls.append(template_tool_call(block.id, block.name, block.input))
            elif isinstance(block, ToolResultBlock):
                messages.append(template_message("tool", block.text(), tool_call_id=block.tool_use_id))
            elif isinstance(block, ThinkingBlock):
                thinking.append(reasoning_of(block))
        if parts or tool_calls:
            messages.append(template_message(role, parts, tool_calls, "".join(thinking) if role == "assistant" else ""))
    # A conversation that ends with the assistant's text is a prefill: the answer goes on from it.
    prefill = (body.messages[-1].role == "assistant" and bool(messages) and messages[-1]["role"] == "assistant"
               and "tool_calls" not in messages[-1])
    return ChatInput(messages, images, template_kwargs(body), continue_final=prefill)


def template_kwargs(body: Conversation) -> dict | None:
    """The template's reasoning switches: as Anthropic's models do, one asked
    neither for thinking nor for an effort does not think."""
    effort = body.output_config.effort if body.output_config else None
    thinking = None if body.thinking is None else not isinstance(body.thinking, ThinkingDisabled)
    return reasoning_switches(effort, False if thinking is None and effort is None else thinking)


def tools(body: Conversation) -> list[dict] | None:
    """The tools in OpenAI's function shape, which chat templates expect, narrowed by the tool choice."""
    choice = body.tool_choice
    return tool_definitions(
        [function_tool(t.name, t.description, t.input_schema) for t in body.tools or []],
        "none" if isinstance(choice, ToolChoiceNone) else "required" if isinstance(choice, ToolChoiceAny)
        else NamedTool(choice.name) if isinstance(choice, ToolChoiceTool) else "auto",
    )


def messages_plan(body: MessagesRequest) -> Plan:
    choice = body.tool_choice
    output_format = body.output_config.format if body.output_config else None
    return Plan(
        model=body.model,
        prompt=chat_input(body),
        sampling=SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k),
        stops=nonempty_stops(body.stop_sequences or [], "stop_sequences"),
        stream=body.stream,
        max_tokens=body.max_tokens,
        tools=tools(body),
        force_tool_call=isinstance(choice, (ToolChoiceAny, ToolChoiceTool)),
        strict_tools=any(t.strict for t in body.tools or []),
        parallel_tool_calls=choice is None or isinstance(choice, ToolChoiceNone)
        or not choice.disable_parallel_tool_use,
        json_output=output_format is not None,
        json_schema=output_format.schema if output_format is not None else None,
        json_schema_param="output_config.format",
        keep_alive_s=keep_alive_seconds(body.keep_alive),
    )


def thinking_blocks(body: MessagesRequest) -> str | None:
    """How reasoning comes back: as `thinking` blocks ("shown"), as blocks of
    no text whose signature alone carries it ("omitted", for `thinking.display`
    "omitted"), or not at all (None) where thinking is not on: a model that
    reasons whatever its template is told keeps it to itself then, as
    Anthropic returns no thinking unasked."""
    if (template_kwargs(body) or {}).get("enable_thinking") is not True:
        return None
    return "omitted" if getattr(body.thinking, "display", None) == "omitted" else "shown"


class AnthropicAPI:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def count_tokens(self, request: Request) -> Response:
        body = decode_body(await self.serving.read_body(request), CountTokensRequest)
        plan = Plan(model=body.model, prompt=chat_input(body), sampling=SamplingParams(), stops=[], tools=tools(body))
        lease, worker = await self.serving.lease(body.model, keep_alive_seconds(body.keep_alive), request=request)
        try:
            prompt = await self.serving.prompt(request, worker, plan)
        finally:
            lease.release()
        return MsgspecResponse({"input_tokens": len(prompt.token_ids)})

    async def messages(self, request: Request) -> Response:
        body = decode_body(await self.serving.read_body(request), MessagesRequest)
        return await self.serving.respond(request, messages_plan(body),
                                          MessageOutput(body.model, body.max_tokens, thinking_blocks(body)))


def usage(group: RequestGroup) -> Usage:
    """Anthropic's usage: `input_tokens` are those the prefix cache did not
    hold, so input + cache read is the prompt (what count_tokens says)."""
    return Usage(group.prompt_tokens - group.cached_tokens, group.completion_tokens,
                 cache_read_input_tokens=group.cached_tokens)


def tool_use_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def tool_use(call: ToolCall) -> ToolUseOut:
    return ToolUseOut(tool_use_id(call), call.name, arguments_object(call.arguments) or {})


class MessageOutput:
    """One message's renderer (serving.Renderer): Anthropic's event sequence, or the message whole."""

    media_type = SSE

    def __init__(self, model: str, max_tokens: int, thinking: str | None = "shown") -> None:
        """thinking: how reasoning comes back (thinking_blocks)."""
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self._max_tokens = max_tokens  # as asked: the context may have held less
        self._thinking = thinking
        self._blocks = Blocks()
        self._calls = 0
        self._finish: tuple[str | None, str | None] = (None, None)  # the finish reason and the stop string met
        self._held = ""  # whitespace alone opens no text block; it goes in front of the text after it

    def opening(self, group: RequestGroup) -> list[bytes]:
        # Before the first step nothing is known of the prefix cache: the whole prompt counts as input
        # here, and message_delta's usage says how much of it the cache held.
        start = MessageOut(self.id, self.model, [], None, None, Usage(group.prompt_tokens, 0))
        return [event("message_start", {"type": "message_start", "message": msgspec.to_builtins(start)}),
                event("ping", {"type": "ping"})]

    def keepalive(self) -> list[bytes]:
        return [event("ping", {"type": "ping"})]

    def delta(self, delta: Delta) -> list[bytes]:
        blocks = self._blocks
        out = []
        if delta.reasoning and self._thinking is not None:
            out += blocks.think(delta.reasoning, shown=self._thinking == "shown")
        if delta.text and (delta.text.strip() or blocks.kind == "text"):
            out += blocks.text(self._held + delta.text)
            self._held = ""
        elif delta.text:
            self._held += delta.text
        for call in delta.tool_calls:
            self._calls += 1
            self._held = ""  # whitespace before a call opens no text block, as in the whole message
            out += blocks.tool_use(call)
        if delta.finish_reason is not None:
            self._finish = (delta.finish_reason, delta.stop_string)
        return out

    def ending(self, group: RequestGroup, error: APIError | None) -> list[bytes]:
        if error is not None:
            return [event("error", anthropic_error_body(error.status, error.message))]
        reason, sequence = stop_reason(*self._finish, self._calls, self._context_bound(group))
        # An answer of whitespace alone is that text block, as in the whole message.
        alone = self._blocks.text(self._held) if self._held and self._blocks.index < 0 else []
        return [*alone, *self._blocks.close(ensure_one=True),
                event("message_delta", {"type": "message_delta",
                                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                        "usage": msgspec.to_builtins(usage(group))}),
                event("message_stop", {"type": "message_stop"})]

    def body(self, choices: list[Choice], group: RequestGroup) -> MessageOut:
        (choice,) = choices
        content: list = []  # in the order the stream sends its blocks
        for kind, value in choice.parts:
            if isinstance(value, ToolCall):
                content.append(tool_use(value))
            elif kind == "reasoning":
                if self._thinking is not None:
                    content.append(ThinkingOut(value if self._thinking == "shown" else "", signature_of(value)))
            elif value.strip():  # whitespace alone is no block
                content.append(TextOut(value))
        content = content or [TextOut(choice.text)]
        reason, sequence = stop_reason(choice.finish_reason, choice.stop_string, len(choice.tool_calls),
                                       self._context_bound(group))
        return MessageOut(self.id, self.model, content, reason, sequence, usage(group))

    def _context_bound(self, group: RequestGroup) -> bool:
        return group.states[0].sampling.max_tokens < self._max_tokens


class Blocks:
    """The content blocks of a streamed message: one open at a time, in order."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None
        self._thought = ""  # the open thinking block's reasoning: its signature, once it closes

    def _start(self, kind: str, block: dict) -> bytes:
        self.index += 1
        self.kind = kind
        return event("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})

    def _delta(self, delta: dict) -> bytes:
        return event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def close(self, ensure_one: bool = False) -> list[bytes]:
        out = []
        if self.kind is None and ensure_one and self.index < 0:
            out.append(self._start("text", {"type": "text", "text": ""}))
        if self.kind == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": signature_of(self._thought)}))
            self._thought = ""
        if self.kind is not None:
            out.append(event("content_block_stop", {"type": "content_block_stop", "index": self.index}))
            self.kind = None
        return out

    def _open(self, kind: str, empty: dict) -> list[bytes]:
        if self.kind == kind:
            return []
        return [*self.close(), self._start(kind, empty)]

    def think(self, reasoning: str, shown: bool) -> list[bytes]:
        """Reasoning, in the open thinking block: as thinking_deltas where shown, in its signature alone if not."""
        out = self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        self._thought += reasoning
        if shown:
            out.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
        return out

    def text(self, text: str) -> list[bytes]:
        return [*self._open("text", {"type": "text", "text": ""}), self._delta({"type": "text_delta", "text": text})]

    def tool_use(self, call: ToolCall) -> list[bytes]:
        # Clients parse the pieces, put together, as the input object: arguments that are not one are {}.
        partial_json = call.arguments if arguments_object(call.arguments) is not None else "{}"
        out = self.close()
        out.append(self._start("tool_use", {"type": "tool_use", "id": tool_use_id(call), "name": call.name, "input": {}}))
        out.append(self._delta({"type": "input_json_delta", "partial_json": partial_json}))
        out += self.close()
        return out
