"""Stop strings, reasoning and tool calls in model output, parsed as it streams.

Each works on text deltas and holds back only what might be the start of a
marker (or of a stop string), so ordinary text streams through without delay.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.tool_formats import ToolFormat


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class StopMatcher:
    """Finds stop strings across token boundaries and never lets one out.

    Holds back the last len(longest stop) - 1 characters, which may be the
    start of a stop string still arriving.
    """

    def __init__(self, stops: list[str]) -> None:
        self._stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._pending = ""

    def feed(self, text: str, final: bool) -> tuple[str, str | None]:
        """(text safe to emit, the stop string hit or None)."""
        self._pending += text
        hits = [(i, s) for s in self._stops if (i := self._pending.find(s)) >= 0]
        if hits:
            at, stop = min(hits)
            out, self._pending = self._pending[:at], ""
            return out, stop
        if final or not self._hold:
            out, self._pending = self._pending, ""
        else:
            cut = max(len(self._pending) - self._hold, 0)
            out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, None


class ReasoningSplitter:
    """Splits `<think>…</think>` (or the template's own markers) off as reasoning."""

    def __init__(self, start: str, end: str, inside: bool) -> None:
        self.start, self.end = start, end
        self.inside = inside  # the prompt already opened the reasoning block
        self._pending = ""
        self._trim = inside  # newlines right after a marker are layout, not text

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) that are safe to emit."""
        self._pending += text
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._trim:
                self._pending = self._pending.lstrip("\n")
                self._trim = not self._pending
            marker = self.end if self.inside else self.start
            at = self._pending.find(marker)
            if at < 0:
                break
            (reasoning if self.inside else content).append(self._pending[:at])
            self._pending = self._pending[at + len(marker):]
            self._trim = True
            self.inside = not self.inside
        keep = 0 if final else _held_prefix(self._pending, self.end if self.inside else self.start)
        out, self._pending = self._pending[: len(self._pending) - keep], self._pending[len(self._pending) - keep:]
        (reasoning if self.inside else content).append(out)
        return "".join(reasoning), "".join(content)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI carries it
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"


class ToolCallParser:
    """Finds tool calls in one model family's format.

    With a ToolFormat (one of mlx-lm's parsers, chosen by mlx-lm from the chat
    template: gateway/tool_formats.py), a call is the text between its
    markers, read by mlx-lm's parser. Without one, the formats mlx-lm has no
    parser for, or whose templates it does not recognise:
    hermes   <tool_call>{"name": ..., "arguments": {...}}</tool_call>   (Qwen, Hermes, ...)
    mistral  [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
    llama3   {"name": ..., "parameters": {...}}  as the whole message (after <|python_tag|> if any)
    """

    def __init__(self, family: str, tools: list[dict] | None = None, tool_format: ToolFormat | None = None) -> None:
        self.family = family
        self._tools = tools
        self._format = tool_format
        self._pending = ""
        self._in_call = False
        self._at_start = True
        self._trim = False  # newlines right after a call are layout, not text
        self._bare = False  # a llama3 call with no <|python_tag|>: the whole reply is JSON
        self.calls: list[ToolCall] = []

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """(content safe to emit, tool calls completed by this text)."""
        self._pending += text
        if self._format is not None:
            if self._format.end:
                return self._feed_marked(self._format.start, self._format.end, self._parse_format, final)
            return self._feed_whole(self._format.start, self._parse_format, final)
        if self.family == "hermes":
            return self._feed_marked("<tool_call>", "</tool_call>", self._parse, final)
        return self._feed_whole("[TOOL_CALLS]" if self.family == "mistral" else "<|python_tag|>", self._parse, final)

    def _feed_marked(self, start: str, end: str, parse: Callable[[str], list[ToolCall] | None],
                     final: bool) -> tuple[str, list[ToolCall]]:
        """Calls between a start and an end marker, text around them. Text
        after a call stays here for the next feed (`holds_text`), so that it
        goes out after the call: a feed's text and calls have no order."""
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._trim:
                self._pending = self._pending.lstrip("\n")
                self._trim = not self._pending
            if not self._in_call:
                at = self._pending.find(start)
                if calls and self._pending and at != 0:  # text after a call: the next feed's
                    return "".join(content), calls
                if at < 0:
                    break
                content.append(self._pending[:at])
                self._pending = self._pending[at + len(start):]
                self._in_call = True
            at = self._pending.find(end)
            if at < 0 and not final:
                break
            raw = self._pending[:at] if at >= 0 else self._pending
            parsed = parse(raw)
            if parsed is None:  # not a call after all: it stays text
                content.append(start + raw + (end if at >= 0 else ""))
            else:
                calls += parsed
            self._pending = self._pending[at + len(end):] if at >= 0 else ""
            self._in_call = False
            self._trim = True
        if not self._in_call:
            keep = 0 if final else _held_prefix(self._pending, start)
            content.append(self._pending[: len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep:]
        return "".join(content), calls

    @property
    def holds_text(self) -> bool:
        """Text after a call waits here for a feed of its own."""
        return bool(self._pending) and not self._in_call

    def _feed_whole(self, marker: str, parse: Callable[[str], list[ToolCall] | None],
                    final: bool) -> tuple[str, list[ToolCall]]:
        """The call is the rest of the message from its marker on (mistral, llama3)."""
        if not self._in_call:
            stripped = self._pending.lstrip()
            if marker in self._pending:
                before, _, self._pending = self._pending.partition(marker)
                self._in_call = True
                content, calls = self._finish_whole(final, parse)
                return before + content, calls
            if self._format is None and self.family == "llama3" and self._at_start and stripped.startswith("{"):
                self._in_call = self._bare = True
                return self._finish_whole(final, parse)
            if not stripped and not final:
                return "", []
            keep = 0 if final else _held_prefix(self._pending, marker)
            out, self._pending = self._pending[: len(self._pending) - keep], self._pending[len(self._pending) - keep:]
            self._at_start = self._at_start and not out.strip()
            return out, []
        return self._finish_whole(final, parse)

    def _finish_whole(self, final: bool, parse: Callable[[str], list[ToolCall] | None]) -> tuple[str, list[ToolCall]]:
        """At the end of the message: the calls, or the text if it holds none."""
        if not final:
            return "", []
        text, self._pending = self._pending, ""
        found = parse(text)
        return ("", found) if found is not None else (text, [])

    def _parse_format(self, text: str) -> list[ToolCall] | None:
        """The calls mlx-lm's parser finds in the text; None if it finds none."""
        assert self._format is not None
        found = self._format.parse(text, self._tools)
        if found is None:
            return None
        calls = [ToolCall(name, arguments, call_id) for name, arguments, call_id in found]
        self.calls += calls
        return calls

    def _parse(self, text: str) -> list[ToolCall] | None:
        """The calls a JSON object (or a list of them) describes; llama3's may
        be several objects, separated by ";". None if the text is not calls."""
        values = _json_values(text, ";" if self.family == "llama3" else "")
        if values is None or len(values) > 1 and self.family != "llama3":  # one object (or list) a call's text
            return None
        items = [item for value in values for item in (value if isinstance(value, list) else [value])]
        names = None if self._tools is None else {tool["function"]["name"] for tool in self._tools}
        calls = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return None
            if self._bare and ("arguments" not in item and "parameters" not in item
                               or names is not None and item["name"] not in names):
                return None  # a JSON answer that has a "name" (a person's), not a call
            arguments = item.get("arguments", item.get("parameters", {}))
            if not isinstance(arguments, str):
                try:  # NaN and Infinity, which Python's JSON reader takes, are no JSON
                    arguments = json.dumps(arguments, allow_nan=False)
                except ValueError:
                    return None
            calls.append(ToolCall(item["name"], arguments))
        self.calls += calls
        return calls


def _json_values(text: str, separator: str) -> list | None:
    """The JSON values the text holds one after another (whitespace, and the
    separator if any, between them); None if it holds anything else. Not a
    split on the separator: a call's arguments may hold it ("cd /tmp; ls")."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    at = 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == separator and values):
            at += 1
        if at == len(text):
            return values or None
        try:
            value, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):  # not JSON, or JSON Python will not read (a 5,000-digit number, deep nesting)
            return None
        values.append(value)


def detect_tool_family(chat_template: str) -> str:
    """The tool-call format a chat template teaches its model."""
    if "<|channel|>" in chat_template and "<|message|>" in chat_template:
        return "harmony"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return "llama3"
    return "hermes"


def detect_reasoning(chat_template: str, vocabulary: set[str]) -> tuple[str, str] | None:
    """The reasoning markers a model uses, if any."""
    for start, end in (("<think>", "</think>"), ("<thinking>", "</thinking>")):
        if start in chat_template or start in vocabulary:
            return start, end
    return None


def reasons(chat_template: str, markers: tuple[str, str] | None) -> bool:
    """Whether the model writes reasoning: between markers, or in Harmony's analysis channel."""
    return markers is not None or detect_tool_family(chat_template) == "harmony"


class MessageParser:
    """One stream's reply read as reasoning, content and tool calls: the
    reasoning block split off first, then tool calls found in the rest."""

    def __init__(self, reasoning: ReasoningSplitter | None, tools: ToolCallParser | None) -> None:
        self._reasoning = reasoning
        self._tools = tools

    @property
    def calls(self) -> list[ToolCall]:
        """Every call found so far."""
        return self._tools.calls if self._tools is not None else []

    @property
    def reasoning(self) -> bool:
        """Inside the reasoning block now."""
        return self._reasoning is not None and self._reasoning.inside

    @property
    def holds_text(self) -> bool:
        """Text after a call waits for a feed of its own (ToolCallParser.holds_text)."""
        return self._tools is not None and self._tools.holds_text

    def feed(self, text: str, final: bool) -> tuple[str, str, list[ToolCall]]:
        """(reasoning, content, tool calls) that this text completes."""
        reasoning = ""
        if self._reasoning is not None:
            reasoning, text = self._reasoning.feed(text, final)
        calls: list[ToolCall] = []
        if self._tools is not None:
            text, calls = self._tools.feed(text, final)
        return reasoning, text, calls


class HarmonyParser:
    """gpt-oss's Harmony format. A reply is a series of messages, each a header
    `<|channel|>NAME [to=RECIPIENT] [<|constrain|>json]`, then `<|message|>` and
    a body ended by `<|end|>` (another message follows, from `<|start|>assistant`),
    `<|call|>` or `<|return|>`. The analysis channel is reasoning; a message to
    `functions.NAME` is a call of tool NAME with its JSON arguments as the body
    (with no tools in the request it stays text); the rest (the final channel,
    commentary preambles) is content. Text outside that shape is content."""

    ENDS = ("<|end|>", "<|call|>", "<|return|>")
    _CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
    _RECIPIENT = re.compile(r"\bto=([^\s<]+)")

    def __init__(self, tools: list[dict] | None, opened: str | None = None) -> None:
        """opened: the header of a message the prompt left open (an assistant
        message continued), whose body the reply goes on with."""
        self._tools = tools
        self._pending = ""
        self._in_body = False
        self._channel = ""
        self._recipient = ""
        self._arguments = ""
        self.calls: list[ToolCall] = []
        if opened is not None:
            self._open(opened)

    @classmethod
    def open_header(cls, prompt_text: str) -> str | None:
        """The header of the message a prompt ends inside, if it does: the
        reply is that message's body, with no header of its own to wait for."""
        header, found, body = prompt_text.rpartition("<|message|>")
        if not found or "<|start|>" in body or any(end in body for end in cls.ENDS):
            return None
        return header.rpartition("<|start|>")[2]

    def _open(self, header: str) -> None:
        channel = self._CHANNEL.search(header)
        recipient = self._RECIPIENT.search(header)
        self._channel = channel.group(1) if channel else ""
        self._recipient = recipient.group(1) if recipient and self._tools is not None else ""
        self._in_body = True

    def feed(self, text: str, final: bool) -> tuple[str, str, list[ToolCall]]:
        """(reasoning, content, tool calls) that this text completes."""
        self._pending += text
        reasoning: list[str] = []
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if not self._in_body:
                header, found, body = self._pending.partition("<|message|>")
                if not found:
                    break
                self._open(header)
                self._pending = body
            ends = [(at, end) for end in self.ENDS if (at := self._pending.find(end)) >= 0]
            if not ends:
                break
            at, end = min(ends)
            self._body(self._pending[:at], reasoning, content)
            self._pending = self._pending[at + len(end):]
            calls += self._end_message(content)
        if self._in_body:
            keep = 0 if final else max(_held_prefix(self._pending, end) for end in self.ENDS)
            self._body(self._pending[: len(self._pending) - keep], reasoning, content)
            self._pending = self._pending[len(self._pending) - keep:]
            if final:
                calls += self._end_message(content)
        elif final:
            if not self._pending.startswith(("<|start|>", "<|channel|>")):  # not Harmony after all
                content.append(self._pending)
            self._pending = ""  # else a message's header the reply ended in: no text of its own
        return "".join(reasoning), "".join(content), calls

    @property
    def holds_text(self) -> bool:
        """Never: a message's text goes out as it comes (MessageParser.holds_text)."""
        return False

    @property
    def reasoning(self) -> bool:
        """Inside an analysis message's body now."""
        return self._in_body and self._channel == "analysis" and not self._recipient

    def _body(self, text: str, reasoning: list[str], content: list[str]) -> None:
        if self._recipient:
            self._arguments += text
        else:
            (reasoning if self._channel == "analysis" else content).append(text)

    def _end_message(self, content: list[str]) -> list[ToolCall]:
        """The call the message made, if any; arguments that are not a JSON
        object (a reply cut short) stay text."""
        self._in_body = False
        recipient, arguments = self._recipient, self._arguments.strip() or "{}"
        self._recipient, self._arguments = "", ""
        if not recipient:
            return []
        if arguments_object(arguments) is None:
            content.append(arguments)
            return []
        call = ToolCall(recipient.removeprefix("functions."), arguments)
        self.calls.append(call)
        return [call]


StreamParser = MessageParser | HarmonyParser


def opens_reasoning(markers: tuple[str, str], prompt_text: str) -> bool:
    """Whether the prompt ends inside the reasoning block (its template opened it): the output starts there."""
    return prompt_text.rstrip().endswith(markers[0])


def stream_parsers(markers: tuple[str, str] | None, family: str, prompt_text: str,
                   tools: list[dict] | None, tool_format: ToolFormat | None = None):
    """A function making each stream's own parser (None when there is nothing to parse).

    tools: the request's tools (no tool calls are looked for without them);
    tool_format: mlx-lm's parser for the model's format, if it has one. A
    grammar (a forced call, JSON) lets the reasoning block come first, so the
    output is read as any other.
    """
    if family == "harmony":
        opened = HarmonyParser.open_header(prompt_text)
        return lambda: HarmonyParser(tools, opened)
    if markers is None and not tools:
        return lambda: None
    inside = markers is not None and opens_reasoning(markers, prompt_text)

    def make() -> MessageParser:
        return MessageParser(ReasoningSplitter(*markers, inside=inside) if markers else None,
                             ToolCallParser(family, tools, tool_format) if tools else None)

    return make


def arguments_object(arguments: str) -> dict | None:
    """A tool call's arguments (JSON text) as an object; None when they are not one."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None
