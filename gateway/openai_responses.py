"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A body (with the conversation of its `previous_response_id`, when it names
one) becomes a Plan; `Serving.respond` runs it; a `ResponseOutput` renders its
Deltas as the API's typed event sequence or one response object, and keeps
it (`store`) for later turns and GET, in a `ResponseStore` bounded by count,
bytes and age, where only the client that stored a response can see it.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import CANCELLED, APIError, convert, decode_body
from gateway.images import ImageSource
from gateway.openai_responses_schema import (
    ITEM_TYPES,
    CreateResponse,
    FunctionCallItem,
    FunctionCallOut,
    FunctionCallOutputItem,
    FunctionTool,
    IncompleteDetails,
    InputImage,
    InputText,
    InputTokensDetails,
    MessageItem,
    NamespaceTool,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTextPart,
    OutputTokensDetails,
    ReasoningItemIn,
    ReasoningOut,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponseUsage,
    SummaryText,
    TextFormatJSONSchema,
)
from gateway.openai_schema import ResponseFormatJSONObject
from gateway.output_processor import Delta, RequestGroup
from gateway.parsing import ToolCall
from gateway.plan import (
    ChatInput,
    NamedTool,
    Plan,
    SamplingParams,
    function_tool,
    keep_alive_seconds,
    reasoning_switches,
    streamed,
    template_message,
    template_tool_call,
    tool_definitions,
)
from gateway.responses import SSE, MsgspecResponse, sse_event
from gateway.serving import Choice, Serving

log = logging.getLogger("mlxd.gateway")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class StoredResponse:
    client_id: str
    response: ResponseObject
    # The conversation so far, this response's output included (without the
    # instructions, which a later turn does not inherit), and its images.
    messages: list[dict]
    images: list[ImageSource]
    stored_at: float

    @functools.cached_property
    def nbytes(self) -> int:
        """About what it holds in memory: its conversation's text, its images'
        base64, and the response as GET returns it (its instructions and tools
        too, which may be most of it: a coding agent's)."""
        return (len(msgspec.json.encode(self.messages)) + sum(len(i.data or i.url or "") for i in self.images)
                + len(msgspec.json.encode(self.response)))


class ResponseStore:
    """Stored responses, oldest first: at most `max_count` and `max_bytes`,
    none older than `max_age_s`. Beyond a limit, the client holding the most
    (responses, or bytes) loses its oldest: one client storing many, or
    large ones, cannot push out everyone else's."""

    def __init__(self, max_count: int, max_age_s: float, max_bytes: int) -> None:
        self.max_count = max_count
        self.max_age_s = max_age_s
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, stored: StoredResponse) -> None:
        if stored.nbytes > self.max_bytes:
            log.warning("response %s is not stored: it holds %d bytes, more than --responses-store-bytes",
                        stored.response.id, stored.nbytes)
            return
        self._responses[stored.response.id] = stored
        self.nbytes += stored.nbytes
        while len(self._responses) > self.max_count or self.nbytes > self.max_bytes:
            held: Counter[str] = Counter()
            for s in self._responses.values():
                held[s.client_id] += 1 if len(self._responses) > self.max_count else s.nbytes
            most = held.most_common(1)[0][0]
            self._drop(next(key for key, s in self._responses.items() if s.client_id == most))

    def _drop(self, response_id: str) -> None:
        self.nbytes -= self._responses.pop(response_id).nbytes

    def get(self, client_id: str, response_id: str) -> StoredResponse | None:
        """The response, if this client stored it and it has not expired."""
        self._expire()
        stored = self._responses.get(response_id)
        return stored if stored is not None and stored.client_id == client_id else None

    def item(self, client_id: str, item_id: str) -> dict | None:
        """An output item (message, function call, reasoning) of a response this
        client stored, as an input item gives it: what an item_reference names."""
        self._expire()
        for stored in reversed(self._responses.values()):
            if stored.client_id == client_id:
                for item in stored.response.output:
                    if item.id == item_id:
                        return msgspec.to_builtins(item)
        return None

    def _expire(self) -> None:
        expired = time.monotonic() - self.max_age_s
        while self._responses and (oldest := next(iter(self._responses.values()))).stored_at < expired:
            self._drop(oldest.response.id)

    def delete(self, client_id: str, response_id: str) -> bool:
        if self.get(client_id, response_id) is None:
            return False
        self._drop(response_id)
        return True


def input_items(body: CreateResponse, stored_item: Callable[[str], dict | None]) -> list[Any]:
    """The body's input items; an item_reference is the stored output item it names (`stored_item`)."""
    if isinstance(body.input, str):
        return [MessageItem("user", body.input)]
    items = []
    for i, raw in enumerate(body.input):
        # An item_reference may leave out its type too: an id alone, without a role.
        item_type = raw.get("type", "item_reference" if "role" not in raw and "id" in raw else "message")
        if item_type == "item_reference":
            item_id = raw.get("id")
            found = stored_item(item_id) if isinstance(item_id, str) else None
            if found is None:
                raise APIError(404, f"no stored item {item_id!r} (an item_reference names an output item of a "
                                    "response stored here)", type="not_found_error", param=f"input[{i}].id")
            raw, item_type = found, found["type"]
        kind = ITEM_TYPES.get(item_type) if isinstance(item_type, str) else None
        if kind is None:
            raise APIError(400, f"input items of type {item_type!r} are not supported", param=f"input[{i}].type")
        items.append(convert(raw, kind, f"input[{i}]"))
    return items


def _continue_turn(message: dict, parts: list[dict], reasoning: str) -> None:
    """An assistant message's parts and reasoning added to the assistant message
    before it: one response's output ([message, function_call, message], as a
    stateless client such as Codex sends it back) is one turn, as the stored
    response renders it (text after a call went in a turn of its own, between
    the call and its result)."""
    content = message["content"]
    for part in parts:
        if part["type"] == "text" and content and content[-1]["type"] == "text":
            content[-1] = {"type": "text", "text": content[-1]["text"] + part["text"]}
        else:
            content.append(part)
    if reasoning:
        message["reasoning_content"] = message.get("reasoning_content", "") + reasoning


def conversation(items: list[Any], before: Sequence[dict] = ()) -> tuple[list[dict], list[ImageSource]]:
    """Input items as chat template messages: a function call, or an assistant
    message, joins the assistant message before it; a reasoning item goes to the assistant
    message after it as its `reasoning_content`, for templates that replay
    it (Qwen 3's, after the last user message: an agent's tool loop).
    A call's output must answer a call, of these items or of the
    conversation `before` them (a 400, as OpenAI answers)."""
    messages: list[dict] = []
    images: list[ImageSource] = []
    calls = {call["id"] for m in before for call in m.get("tool_calls") or ()}
    reasoning = ""  # of the reasoning items since the last assistant message
    for i, item in enumerate(items):
        if isinstance(item, ReasoningItemIn):
            reasoning += item.text()
        elif isinstance(item, MessageItem):
            content = [InputText(item.content)] if isinstance(item.content, str) else item.content
            parts: list[dict] = []
            for j, part in enumerate(content):
                if isinstance(part, (InputText, OutputText)):
                    parts.append({"type": "text", "text": part.text})
                elif isinstance(part, InputImage):
                    if part.image_url is None:
                        raise APIError(400, "an input_image needs an image_url (there is no Files API)",
                                       param=f"input[{i}].content[{j}].image_url")
                    images.append(ImageSource(f"input[{i}].content[{j}].image_url", url=part.image_url))
                    parts.append({"type": "image"})
            role = "system" if item.role == "developer" else item.role
            if role == "assistant" and messages and messages[-1]["role"] == "assistant":
                _continue_turn(messages[-1], parts, reasoning)
            else:
                messages.append(template_message(role, parts, None, reasoning if role == "assistant" else ""))
            reasoning = ""  # an assistant message's, or of a turn that ended before one (cut short)
        elif isinstance(item, FunctionCallItem):
            calls.add(item.call_id)
            call = template_tool_call(item.call_id, item.name, item.arguments)
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
                if reasoning:
                    messages[-1]["reasoning_content"] = messages[-1].get("reasoning_content", "") + reasoning
            else:
                messages.append(template_message("assistant", [], [call], reasoning))
            reasoning = ""
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                raise APIError(400, f"No tool call found for function call output with call_id {item.call_id}.",
                               param=f"input[{i}].call_id")
            messages.append(template_message("tool", item.text(), tool_call_id=item.call_id))
    return messages, images


# Tools OpenAI's servers run (Codex sends web_search whatever the provider): not offered to the model.
HOSTED_TOOLS = ("file_search", "computer", "computer_use_preview", "web_search", "web_search_preview", "mcp",
                "code_interpreter", "image_generation", "tool_search", "programmatic_tool_calling")


def function_tools(body: CreateResponse) -> tuple[list[dict], dict[str, str]]:
    """The function tools, as the body gives them, with those of its namespace
    tools (Codex's sub-agents come so), and the namespace of each of the
    latter by its name; hosted tools are not offered. A tool of another type
    (the client's own custom, shell or apply_patch tools, which it would wait
    in vain for the model to call) is a 400."""
    tools, namespaces = [], {}
    for i, tool in enumerate(body.tools or []):
        if _offered(tool, f"tools[{i}]"):
            tools.append(msgspec.to_builtins(convert(tool, FunctionTool, f"tools[{i}]")))
        elif tool.get("type") == "namespace":
            namespace = convert(tool, NamespaceTool, f"tools[{i}]")
            for j, member in enumerate(namespace.tools):
                if _offered(member, f"tools[{i}].tools[{j}]"):
                    function = msgspec.to_builtins(convert(member, FunctionTool, f"tools[{i}].tools[{j}]"))
                    tools.append(function)
                    namespaces[function["name"]] = namespace.name
    return tools, namespaces


def _offered(tool: dict, param: str) -> bool:
    """A function tool (True), a hosted tool or a namespace (False), or a 400."""
    kind = tool.get("type")
    if kind == "function":
        return True
    if kind == "namespace" or isinstance(kind, str) and kind.startswith(HOSTED_TOOLS):  # web_search_2025_08_26
        return False
    raise APIError(400, f"{param}: tools of type {kind!r} are not supported here; give the tool as a function",
                   param=f"{param}.type")


def responses_plan(body: CreateResponse, previous: StoredResponse | None, offered: list[dict],
                   stored_item: Callable[[str], dict | None]) -> Plan:
    """offered: the body's function tools (function_tools); stored_item: see input_items."""
    messages, images = conversation(input_items(body, stored_item), previous.messages if previous else ())
    if previous is not None:
        messages, images = previous.messages + messages, previous.images + images
    if body.instructions:
        messages = [template_message("system", [{"type": "text", "text": body.instructions}]), *messages]
    choice = body.tool_choice or "auto"
    tools = tool_definitions(
        [function_tool(t["name"], t.get("description"), t.get("parameters")) for t in offered],
        choice if isinstance(choice, str) else NamedTool(choice.name),
    )
    text_format = body.text.format if body.text else None
    effort = body.reasoning.effort if body.reasoning else None
    return Plan(
        model=body.model,
        # truncation "auto": the spec's way to drop items from the conversation's start until it fits.
        prompt=ChatInput(messages, images, reasoning_switches(effort), fit_context=body.truncation == "auto"),
        sampling=SamplingParams(temperature=body.temperature, top_p=body.top_p),
        stops=[],
        stream=streamed(body.stream, body.stream_options),
        max_tokens=body.max_output_tokens,
        max_tokens_param="max_output_tokens",
        messages_param="input",
        tools=tools,
        force_tool_call=choice == "required" or not isinstance(choice, str),
        strict_tools=any(t.get("strict") is True for t in offered),
        parallel_tool_calls=body.parallel_tool_calls is not False,
        json_output=isinstance(text_format, (ResponseFormatJSONObject, TextFormatJSONSchema)),
        json_schema=text_format.schema if isinstance(text_format, TextFormatJSONSchema) else None,
        json_schema_strict=isinstance(text_format, TextFormatJSONSchema) and text_format.strict is True,
        json_schema_param="text.format",
        keep_alive_s=keep_alive_seconds(body.keep_alive),
    )


class ResponsesAPI:
    def __init__(self, serving: Serving, store: ResponseStore) -> None:
        self.serving = serving
        self.store = store

    async def create(self, request: Request) -> Response:
        body = decode_body(await self.serving.read_body(request), CreateResponse)
        if "message.output_text.logprobs" in (body.include or []) or body.top_logprobs:
            raise APIError(400, "log-probabilities are not given on the Responses API here: "
                                "/v1/chat/completions gives them (logprobs, top_logprobs)",
                           param="include" if body.include else "top_logprobs")
        client_id = request.scope["state"]["client_id"]
        previous = None
        if body.previous_response_id is not None:
            previous = self.store.get(client_id, body.previous_response_id)
            if previous is None:
                raise APIError(404, f"no stored response {body.previous_response_id!r}", type="not_found_error",
                               param="previous_response_id", code="previous_response_not_found")
        tools, namespaces = function_tools(body)
        plan = responses_plan(body, previous, tools, lambda item_id: self.store.item(client_id, item_id))
        assert isinstance(plan.prompt, ChatInput)
        conversation_so_far = (plan.prompt.messages[1:] if body.instructions else plan.prompt.messages,
                               plan.prompt.images)

        def keep(response: ResponseObject, output_messages: list[dict]) -> None:
            if body.store is not False:
                messages, images = conversation_so_far
                self.store.put(StoredResponse(client_id, response, messages + output_messages, images,
                                              time.monotonic()))

        return await self.serving.respond(request, plan, ResponseOutput(body, tools, keep, namespaces))

    async def retrieve(self, request: Request) -> Response:
        if request.query_params.get("stream", "false").lower() != "false":
            raise APIError(400, "a stored response is retrieved whole here, not streamed again", param="stream")
        return MsgspecResponse(self._stored(request).response)

    async def not_offered(self, request: Request) -> Response:
        """The Responses API's other endpoints (compact, input_tokens, input_items, cancel): a clear 404,
        not a 405 from the route they resemble (which clients read as a bug of their own)."""
        raise APIError(404, f"mlxd does not offer {request.method} {request.url.path}", type="not_found_error")

    async def delete(self, request: Request) -> Response:
        response_id = self._stored(request).response.id
        self.store.delete(request.scope["state"]["client_id"], response_id)
        return MsgspecResponse({"id": response_id, "object": "response", "deleted": True})

    def _stored(self, request: Request) -> StoredResponse:
        response_id = request.path_params["response_id"]
        stored = self.store.get(request.scope["state"]["client_id"], response_id)
        if stored is None:
            raise APIError(404, f"no stored response {response_id!r}", type="not_found_error", param="response_id")
        return stored


class ResponseOutput:
    """One response's renderer (serving.Renderer): the typed event sequence, or the response whole."""

    media_type = SSE

    def __init__(self, body: CreateResponse, tools: list[dict],
                 keep: Callable[[ResponseObject, list[dict]], None], namespaces: dict[str, str]) -> None:
        """namespaces: the namespace tool of each function that came in one (function_tools)."""
        self.id = _new_id("resp")
        self._body = body
        self._tools = tools
        self._namespaces = namespaces
        self._keep = keep
        self._created = int(time.time())
        self._sequence = 0
        self._items: list[OutputItem] = []
        self._open: ReasoningOut | OutputMessage | None = None
        self._held = ""  # whitespace alone opens no message; it goes in front of the text after it
        self._finish: str | None = None
        reasoning = body.reasoning
        self._summarize = reasoning is not None and (reasoning.summary or reasoning.generate_summary) is not None

    # ---- the response object ----

    def _response(self, status: str, group: RequestGroup | None = None, error: APIError | None = None,
                  ) -> ResponseObject:
        body = self._body
        usage: ResponseUsage | msgspec.UnsetType = msgspec.UNSET
        if group is not None:
            usage = ResponseUsage(group.prompt_tokens, InputTokensDetails(group.cached_tokens),
                                  group.completion_tokens, OutputTokensDetails(group.reasoning_tokens),
                                  group.prompt_tokens + group.completion_tokens)
        return ResponseObject(
            self.id, self._created, status, body.model, list(self._items), body.instructions, self._tools,
            msgspec.to_builtins(body.tool_choice) if body.tool_choice is not None else "auto",
            body.parallel_tool_calls is not False, body.temperature, body.top_p, body.metadata or {},
            body.previous_response_id,
            error=ResponseError("server_error" if error.status >= 500 else "invalid_prompt", error.message)
            if error is not None and status == "failed" else None,
            incomplete_details=IncompleteDetails("max_output_tokens") if status == "incomplete" else None,
            usage=usage, max_output_tokens=body.max_output_tokens, store=body.store is not False,
            text=msgspec.to_builtins(body.text) if body.text and body.text.format else {"format": {"type": "text"}},
        )

    def _finished(self, group: RequestGroup, error: APIError | None) -> ResponseObject:
        status = ("cancelled" if error.status == CANCELLED else "failed") if error is not None else \
            "incomplete" if self._finish == "length" else "completed"
        response = self._response(status, group, error)
        # A failed or cancelled response is kept too, as OpenAI keeps it: a GET
        # then says what became of it, where a 404 would say it never was.
        self._keep(response, self._messages())
        return response

    def _messages(self) -> list[dict]:
        """This response's output as the conversation's next assistant message."""
        text = "".join(p.text for item in self._items if isinstance(item, OutputMessage) for p in item.content)
        calls = [template_tool_call(c.call_id, c.name, c.arguments) for c in self._items
                 if isinstance(c, FunctionCallOut)]
        reasoning = "".join(item.part.text for item in self._items if isinstance(item, ReasoningOut))
        return [template_message("assistant", [{"type": "text", "text": text}], calls, reasoning)]

    def body(self, choices: list[Choice], group: RequestGroup) -> ResponseObject:
        (choice,) = choices
        for kind, value in choice.parts:  # in the order the stream sends its items
            if isinstance(value, ToolCall):
                self._items.append(self._call(value))
            elif kind == "reasoning":
                self._items.append(self._reasoning(value))
            elif value.strip():  # whitespace alone is no message
                self._items.append(OutputMessage(_new_id("msg"), "completed", [OutputTextPart(value)]))
        self._finish = choice.finish_reason
        # Cut short while reasoning: the reasoning is the incomplete item, with no message after it.
        cut_in_reasoning = self._finish == "length" and bool(self._items) and isinstance(self._items[-1], ReasoningOut)
        if not cut_in_reasoning and not any(isinstance(item, OutputMessage | FunctionCallOut) for item in self._items):
            self._items.append(OutputMessage(_new_id("msg"), "completed", [OutputTextPart(choice.text)]))
        if self._finish == "length" and isinstance(self._items[-1], ReasoningOut | OutputMessage):
            self._items[-1].status = "incomplete"  # cut short
        return self._finished(group, None)

    def _reasoning(self, text: str, status: str = "completed") -> ReasoningOut:
        if self._summarize:
            return ReasoningOut(_new_id("rs"), [], [SummaryText(text)], status=status)
        return ReasoningOut(_new_id("rs"), [ReasoningText(text)], status=status)

    def _call(self, call: ToolCall) -> FunctionCallOut:
        return FunctionCallOut(_new_id("fc"), call.id, call.name, call.arguments,
                               namespace=self._namespaces.get(call.name, msgspec.UNSET))

    # ---- the event sequence ----

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}  # from 0, as OpenAI numbers them
        self._sequence += 1
        return sse_event(payload, kind)

    def opening(self, group: RequestGroup) -> list[bytes]:
        response = msgspec.to_builtins(self._response("in_progress"))
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def keepalive(self) -> list[bytes]:
        # An event, not an SSE comment: Codex's idle timer counts events only (a comment let it time
        # out through a long prefill and resend the request). Clients read past in_progress events.
        return [self._event("response.in_progress", response=msgspec.to_builtins(self._response("in_progress")))]

    def delta(self, delta: Delta) -> list[bytes]:
        out = []
        if delta.reasoning:
            self._held = ""  # between items: no message's (as in body)
            out += self._open_item(self._reasoning("", status="in_progress"))
            assert isinstance(self._open, ReasoningOut)
            self._open.part.text += delta.reasoning
            where = {"summary_index": 0} if self._summarize else {"content_index": 0}
            kind = "response.reasoning_summary_text.delta" if self._summarize else "response.reasoning_text.delta"
            out.append(self._event(kind, item_id=self._open.id, output_index=len(self._items), **where,
                                   delta=delta.reasoning))
        if delta.text and (delta.text.strip() or isinstance(self._open, OutputMessage)):
            out += self._text(self._held + delta.text)
            self._held = ""
        elif delta.text:
            self._held += delta.text
        for call in delta.tool_calls:
            self._held = ""
            out += self._close_item()
            item = self._call(call)
            index = len(self._items)
            added = msgspec.structs.replace(item, arguments="", status="in_progress")
            out += [self._event("response.output_item.added", output_index=index, item=msgspec.to_builtins(added)),
                    self._event("response.function_call_arguments.delta", item_id=item.id, output_index=index,
                                delta=call.arguments),
                    self._event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                                name=call.name, arguments=call.arguments),
                    self._event("response.output_item.done", output_index=index, item=msgspec.to_builtins(item))]
            self._items.append(item)
        if delta.finish_reason is not None:
            self._finish = delta.finish_reason
        return out

    def _text(self, text: str) -> list[bytes]:
        """The message's next text, opening the message if none is open."""
        out = self._open_item(OutputMessage(_new_id("msg"), "in_progress", []))
        assert isinstance(self._open, OutputMessage)
        self._open.content[0].text += text
        out.append(self._event("response.output_text.delta", item_id=self._open.id,
                               output_index=len(self._items), content_index=0, delta=text, logprobs=[]))
        return out

    def _open_item(self, item: ReasoningOut | OutputMessage) -> list[bytes]:
        """Open an item of this kind unless one is open already (closing one of the other kind)."""
        if type(self._open) is type(item):
            return []
        out = self._close_item()
        self._open = item
        index = len(self._items)
        # An item comes as it starts: a summary's part is added by its own event, as a message's is.
        added = msgspec.structs.replace(item, summary=[]) if isinstance(item, ReasoningOut) else item
        out.append(self._event("response.output_item.added", output_index=index, item=msgspec.to_builtins(added)))
        if isinstance(item, OutputMessage):
            part = OutputTextPart("")
            item.content.append(part)
            out.append(self._event("response.content_part.added", item_id=item.id, output_index=index,
                                   content_index=0, part=msgspec.to_builtins(part)))
        elif item.summary:
            out.append(self._event("response.reasoning_summary_part.added", item_id=item.id, output_index=index,
                                   summary_index=0, part=msgspec.to_builtins(item.part)))
        return out

    def _close_item(self, status: str = "completed") -> list[bytes]:
        """status: "incomplete" for the last item of a response cut short."""
        item = self._open
        if item is None:
            return []
        self._open = None
        index = len(self._items)
        item.status = status
        if isinstance(item, OutputMessage):
            (part,) = item.content
            out = [self._event("response.output_text.done", item_id=item.id, output_index=index, content_index=0,
                               text=part.text, logprobs=[]),
                   self._event("response.content_part.done", item_id=item.id, output_index=index, content_index=0,
                               part=msgspec.to_builtins(part))]
        elif item.summary:
            out = [self._event("response.reasoning_summary_text.done", item_id=item.id, output_index=index,
                               summary_index=0, text=item.part.text),
                   self._event("response.reasoning_summary_part.done", item_id=item.id, output_index=index,
                               summary_index=0, part=msgspec.to_builtins(item.part))]
        else:
            out = [self._event("response.reasoning_text.done", item_id=item.id, output_index=index, content_index=0,
                               text=item.part.text)]
        out.append(self._event("response.output_item.done", output_index=index, item=msgspec.to_builtins(item)))
        self._items.append(item)
        return out

    def ending(self, group: RequestGroup, error: APIError | None) -> list[bytes]:
        out = []
        cut_in_reasoning = self._finish == "length" and isinstance(self._open, ReasoningOut)
        answered = isinstance(self._open, OutputMessage) or any(isinstance(i, OutputMessage | FunctionCallOut)
                                                               for i in self._items)
        if error is None and not answered and not cut_in_reasoning:
            # An empty answer, or whitespace alone: a message still, as in body.
            out += self._text(self._held) if self._held else self._open_item(
                OutputMessage(_new_id("msg"), "in_progress", []))
        out += self._close_item("incomplete" if error is not None or self._finish == "length" else "completed")
        response = self._finished(group, error)
        # The Responses API streams no event of its own for a cancel: it ends as a failure, its status cancelled.
        kind = {"failed": "response.failed", "cancelled": "response.failed",
                "incomplete": "response.incomplete"}.get(response.status, "response.completed")
        return out + [self._event(kind, response=msgspec.to_builtins(response))]
