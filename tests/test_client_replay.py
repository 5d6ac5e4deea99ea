"""Requests the real coding agents send, replayed: each must be served, not refused.

tests/data/clients/ holds one request body per client version, captured from
the client itself (installed from npm, run headless against mlxd through a
recording proxy; the capture machine's ids replaced by zeros). A new client
version whose requests mlxd does not accept shows here, once its capture is
added. Only the length limit is changed, so that the random model's answer
stays short. The model's template refuses a system message past the first
message, as Qwen 3.5's does: Claude Code sends one there.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import running
from tests.tiny_model import SYSTEM_FIRST_TEMPLATE, make_tiny_model

CAPTURES = sorted((Path(__file__).parent / "data" / "clients").glob("*.json"))
LENGTH_FIELD = {"/v1/messages": "max_tokens", "/v1/responses": "max_output_tokens",
                "/v1/chat/completions": "max_tokens"}
# How each stream ends when served (sampling: EOS may or may not come within the limit).
LAST_EVENTS = {"/v1/messages": ("message_stop",), "/v1/responses": ("response.incomplete", "response.completed"),
               "/v1/chat/completions": ("[DONE]",)}


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory):
    # The agents' system prompts and tool lists run to 15,000 tokens: a context that holds them. One
    # layer, whose prefill computes no attention (its KV state needs none; only the last token's
    # logits are read): with two, prefilling those prompts was 40 s of the suite.
    model = make_tiny_model(tmp_path_factory.mktemp("replay") / "tiny", context=32768, layers=1,
                            chat_template=SYSTEM_FIRST_TEMPLATE)
    with running(["serve", "--model", str(model), "--served-model-name", "tiny", "--model-alias", "*=tiny"],
                 model.parent / "serve.log") as srv:
        yield srv


@pytest.mark.parametrize("capture", CAPTURES, ids=[c.stem for c in CAPTURES])
def test_a_captured_agent_request_is_served(agent_server, capture):
    recorded = json.loads(capture.read_text())
    body = dict(recorded["body"], **{LENGTH_FIELD[recorded["path"]]: 4})
    url = recorded["path"] + (f"?{recorded['query']}" if recorded["query"] else "")
    with agent_server.http.stream("POST", url, json=body, headers={"user-agent": recorded["user_agent"]}) as r:
        text = r.read().decode()
    assert r.status_code == 200, text[:500]
    assert body["stream"] and r.headers["content-type"].startswith("text/event-stream")
    last = [line for line in text.splitlines() if line.startswith(("data: ", "event: "))][-1]
    assert any(event in last for event in LAST_EVENTS[recorded["path"]]), text[-500:]
