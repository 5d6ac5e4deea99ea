"""Tool-call ids as a model's chat template needs them.

Clients send back the ids of the calls they ran, in their API's own shape
(OpenAI's `call_...`, Anthropic's `toolu_...`), and most templates render
them as they are or not at all. Two families need ids of their own shape:

* Mistral's templates (Mistral Small, Devstral, Magistral) refuse an id that
  is not nine characters ("Tool call IDs should be alphanumeric strings with
  length 9!"): every conversation's second turn would fail.
* Kimi's model writes its calls' ids itself (`functions.get_weather:0`: the
  function and the call's place in the conversation) and reads them back in
  the history; Anthropic's API hands them out as `toolu_functions...`.

An id is rewritten the same way every turn, so a conversation's earlier
turns render the same text again (and hit the prefix cache).
"""

from __future__ import annotations

import hashlib
import re
from typing import Literal

Style = Literal["nine", "kimi"] | None

_NINE_CHECK = re.compile(r"\bid\s*\|\s*length\s*!=\s*9")
_NINE = re.compile(r"[A-Za-z0-9]{9}")
_KIMI = re.compile(r"(?:toolu_)?(functions\.[^:]+:\d+)")


def call_id_style(chat_template: str) -> Style:
    """The shape of id a template needs; None when it takes any."""
    if _NINE_CHECK.search(chat_template):
        return "nine"
    if "<|tool_calls_section_begin|>" in chat_template:
        return "kimi"
    return None


def fit_call_ids(messages: list[dict], style: Style) -> list[dict]:
    """The messages with every call's id, and every tool result's, in the template's shape."""
    if style is None:
        return messages
    fitted: dict[str, str] = {}

    def fit(call_id: str, name: str = "") -> str:
        if call_id not in fitted:
            fitted[call_id] = _fit(call_id, name, len(fitted), style)
        return fitted[call_id]

    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{**c, "id": fit(str(c.get("id") or ""), c["function"]["name"])} for c in m["tool_calls"]]
            m = {**m, "tool_calls": calls}
        if isinstance(m.get("tool_call_id"), str):
            m = {**m, "tool_call_id": fit(m["tool_call_id"])}
        out.append(m)
    return out


def _fit(call_id: str, name: str, place: int, style: Style) -> str:
    if style == "nine":
        return call_id if _NINE.fullmatch(call_id) else hashlib.sha256(call_id.encode()).hexdigest()[:9]
    if match := _KIMI.fullmatch(call_id):
        return match[1]
    return f"functions.{name}:{place}" if name else call_id
