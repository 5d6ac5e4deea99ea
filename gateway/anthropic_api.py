"""Anthropic's /v1/messages and /v1/messages/count_tokens.

The same generation path as the OpenAI endpoints (gateway/serving.py), with
Anthropic's request shape, stop reasons, SSE event sequence and error shape.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from gateway.anthropic_schema import (
    Base64Source,
    CountTokensRequest,
    ImageBlock,
    MessageOut,
    MessagesRequest,
    TextBlock,
    TextOut,
    ThinkingBlock,
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
from gateway.json_response import MsgspecResponse
from gateway.parsing import ToolCall, stream_parsers
from gateway.serving import EventStream, Generation, Serving, collect, nonempty_stops
from gateway.structured import forced_tool_call_grammar, named_tool
from gateway.tokenizer import template_content
from protocol import Sampling

_json = msgspec.json.Encoder()


def event(name: str, payload: dict) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _json.encode(payload) + b"\n\n"


def stop_reason(finish_reason: str | None, stop_string: str | None) -> str:
    if stop_string is not None:
        return "stop_sequence"
    return "max_tokens" if finish_reason == "length" else "end_turn"


def chat_messages(body: MessagesRequest | CountTokensRequest, vision: bool) -> tuple[list[dict], list[ImageSource]]:
    """Anthropic messages as the chat template's messages, and their image
    blocks, in order."""
    messages = []
    images = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "".join(b.text for b in body.system)
        messages.append({"role": "system", "content": template_content([{"type": "text", "text": system}], vision)})
    for i, m in enumerate(body.messages):
        blocks = [TextBlock(m.content)] if isinstance(m.content, str) else m.content
        parts: list[dict] = []
        tool_calls = []
        for j, block in enumerate(blocks):
            if isinstance(block, TextBlock):
                parts.append({"type": "text", "text": block.text})
            elif isinstance(block, ImageBlock):
                source = block.source
                param = f"messages[{i}].content[{j}].source"
                images.append(ImageSource(param, data=source.data) if isinstance(source, Base64Source)
                              else ImageSource(param, url=source.url))
                parts.append({"type": "image"})
            elif isinstance(block, ToolUseBlock):
                tool_calls.append({"id": block.id, "type": "function",
                                   "function": {"name": block.name, "arguments": block.input}})
            elif isinstance(block, ToolResultBlock):
                messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
            elif isinstance(block, ThinkingBlock):
                pass  # earlier reasoning is not replayed into the prompt, as chat templates do
        if parts or tool_calls:
            message: dict = {"role": m.role, "content": template_content(parts, vision)}
            if tool_calls:
                message["tool_calls"] = tool_calls
            messages.append(message)
    return messages, images


def tool_definitions(body: MessagesRequest | CountTokensRequest) -> list[dict] | None:
    """The tools in OpenAI's function shape, which chat templates expect: none with
    tool_choice none, only the named one with tool_choice tool."""
    if not body.tools or isinstance(body.tool_choice, ToolChoiceNone):
        if isinstance(body.tool_choice, (ToolChoiceAny, ToolChoiceTool)):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                               "parameters": t.input_schema}} for t in body.tools]
    if isinstance(body.tool_choice, ToolChoiceTool):
        return named_tool(tools, body.tool_choice.name)
    return tools


class AnthropicAPI:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def _prompt(self, body: MessagesRequest | CountTokensRequest, tools: list[dict] | None):
        worker = await self.serving.worker_for(body.model)
        template_kwargs = {"enable_thinking": body.thinking.type == "enabled"} if body.thinking else None
        messages, images = chat_messages(body, worker.hello.vision)
        return worker, await self.serving.chat_prompt(worker, messages, tools, template_kwargs, images)

    async def count_tokens(self, request: Request) -> Response:
        body: CountTokensRequest = decode_body(await self.serving.read_body(request), CountTokensRequest)
        _, prompt = await self._prompt(body, tool_definitions(body))
        return MsgspecResponse({"input_tokens": len(prompt.token_ids)})

    async def messages(self, request: Request) -> Response:
        body: MessagesRequest = decode_body(await self.serving.read_body(request), MessagesRequest)
        stops = nonempty_stops(body.stop_sequences or [], "stop_sequences")
        tools = tool_definitions(body)
        worker, prompt = await self._prompt(body, tools)
        max_tokens = self.serving.max_tokens(prompt.token_ids, body.max_tokens, worker, "messages")
        family = worker.tokenizer.tool_family
        forced = isinstance(body.tool_choice, (ToolChoiceAny, ToolChoiceTool))
        defaults = worker.sampling  # the model's, where the body is silent
        sampling = Sampling(
            max_tokens=max_tokens,
            temperature=defaults.temperature if body.temperature is None else body.temperature,
            top_p=defaults.top_p if body.top_p is None else body.top_p,
            top_k=defaults.top_k if body.top_k is None else body.top_k,
            min_p=defaults.min_p,
            repetition_penalty=defaults.repetition_penalty,
            grammar=forced_tool_call_grammar(tools, family) if forced and tools is not None else None,
        )
        message_id = f"msg_{uuid.uuid4().hex}"
        parsers = stream_parsers(worker.tokenizer.reasoning_markers, family, prompt.text, tools is not None)
        generation = self.serving.start(request, worker, message_id, prompt, [sampling], stops, parsers)
        single_call = (body.tool_choice is not None and not isinstance(body.tool_choice, ToolChoiceNone)
                       and body.tool_choice.disable_parallel_tool_use)
        if body.stream:
            return EventStream(self._events(generation, message_id, body.model, single_call), generation)
        choices = await collect(request, generation, self.serving)
        if choices is None:
            return Response(status_code=499)  # nobody is listening
        (choice,) = choices
        self.serving.log_completion(message_id, [choice.text])
        calls = choice.tool_calls[:1] if single_call else choice.tool_calls
        content: list = [ThinkingOut(choice.reasoning)] if choice.reasoning else []
        content += [TextOut(choice.text)] if choice.text.strip() or not (calls or content) else []
        content += [ToolUseOut(tool_use_id(c), c.name, tool_input(c)) for c in calls]
        out = MessageOut(
            message_id,
            body.model,
            content,
            "tool_use" if calls else stop_reason(choice.finish_reason, choice.stop_string),
            choice.stop_string,
            Usage(generation.group.prompt_tokens, generation.group.completion_tokens,
                  cache_read_input_tokens=generation.group.cached_tokens),
        )
        return MsgspecResponse(out)

    async def _events(self, generation: Generation, message_id: str, model: str,
                      single_call: bool) -> AsyncIterator[bytes]:
        group = generation.group
        start = MessageOut(message_id, model, [], None, None, Usage(group.prompt_tokens, 0))
        yield event("message_start", {"type": "message_start", "message": msgspec.to_builtins(start)})
        yield event("ping", {"type": "ping"})
        blocks = Blocks()
        reason = stop_string = None
        calls = 0
        sent = []
        try:
            async for delta in generation.deltas():
                if delta.error is not None:
                    yield event("error", anthropic_error_body(delta.error_status, delta.error))
                    return
                if delta.reasoning:
                    for e in blocks.add("thinking", {"type": "thinking_delta", "thinking": delta.reasoning}):
                        yield e
                if delta.text and (delta.text.strip() or blocks.kind == "text"):
                    sent.append(delta.text)
                    for e in blocks.add("text", {"type": "text_delta", "text": delta.text}):
                        yield e
                for call in delta.tool_calls[: 1 - calls if single_call else None]:
                    calls += 1
                    for e in blocks.tool_use(call):
                        yield e
                if delta.finish_reason is not None:
                    reason, stop_string = stop_reason(delta.finish_reason, delta.stop_string), delta.stop_string
        except TimeoutError:
            yield event("error", anthropic_error_body(504, self.serving.timed_out()))
            return
        finally:
            self.serving.log_completion(message_id, ["".join(sent)])
        for e in blocks.close(ensure_one=True):
            yield e
        yield event("message_delta", {"type": "message_delta",
                                      "delta": {"stop_reason": "tool_use" if calls else reason,
                                                "stop_sequence": stop_string},
                                      "usage": {"output_tokens": group.completion_tokens}})
        yield event("message_stop", {"type": "message_stop"})


def tool_use_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def tool_input(call: ToolCall) -> dict:
    try:
        value = json.loads(call.arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class Blocks:
    """The content blocks of a streamed message: one open at a time, in order."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None

    def _start(self, kind: str, block: dict) -> bytes:
        self.index += 1
        self.kind = kind
        return event("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})

    def close(self, ensure_one: bool = False) -> list[bytes]:
        out = []
        if self.kind is None and ensure_one and self.index < 0:
            out.append(self._start("text", {"type": "text", "text": ""}))
        if self.kind is not None:
            out.append(event("content_block_stop", {"type": "content_block_stop", "index": self.index}))
            self.kind = None
        return out

    def add(self, kind: str, delta: dict) -> list[bytes]:
        out = []
        if self.kind != kind:
            out += self.close()
            empty = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text", "text": ""}
            out.append(self._start(kind, empty))
        out.append(event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}))
        return out

    def tool_use(self, call: ToolCall) -> list[bytes]:
        out = self.close()
        out.append(self._start("tool_use", {"type": "tool_use", "id": tool_use_id(call), "name": call.name, "input": {}}))
        out.append(event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                 "delta": {"type": "input_json_delta", "partial_json": call.arguments}}))
        out += self.close()
        return out
