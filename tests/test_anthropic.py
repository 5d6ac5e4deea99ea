"""The Anthropic Messages API through the whole stack, with the official anthropic SDK."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from tests.conftest import MODEL_NAME, Server
from tests.scripted_model import make_scripted_model
from tests.test_stop_strings import spanning_stop

MESSAGES = [{"role": "user", "content": "Hello there"}]
SYSTEM = "You are terse."
GREEDY = {"temperature": 0}  # the current SDK has no temperature argument; the API still takes it


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def chat_of(system: str | None, messages: list[dict]) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + messages


def test_create_matches_mlx_lm(client, reference):
    prompt = reference.chat_prompt(chat_of(SYSTEM, MESSAGES))
    expected = reference.greedy(prompt, 24)
    message = client.messages.create(model=MODEL_NAME, max_tokens=24, system=SYSTEM, messages=MESSAGES,
                                     extra_body=GREEDY)
    assert message.role == "assistant" and message.type == "message" and message.id.startswith("msg_")
    assert message.content[0].type == "text"
    assert message.content[0].text == expected.text
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[expected.finish_reason]
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == len(prompt)
    assert message.usage.output_tokens == len(expected.token_ids)


def test_stream_matches_mlx_lm(client, reference):
    prompt = reference.chat_prompt(chat_of(None, MESSAGES))
    expected = reference.greedy(prompt, 24)
    with client.messages.stream(model=MODEL_NAME, max_tokens=24, messages=MESSAGES, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == expected.text
    assert final.content[0].text == expected.text
    assert final.usage.output_tokens == len(expected.token_ids)
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == len(prompt)


def test_stream_event_sequence(server):
    body = {"model": MODEL_NAME, "max_tokens": 8, "messages": MESSAGES, "stream": True, "temperature": 0}
    names = []
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                names.append(line[7:])
            elif line.startswith("data: "):
                assert json.loads(line[6:])["type"] == names[-1]
    assert_event_grammar(names)


def assert_event_grammar(names: list[str]) -> None:
    """message_start, then blocks (start, deltas, stop), then message_delta, message_stop; pings anywhere."""
    names = [n for n in names if n != "ping"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    blocks = names[1:-2]
    assert blocks and blocks[0] == "content_block_start" and blocks[-1] == "content_block_stop"
    state = "closed"
    for name in blocks:
        if name == "content_block_start":
            assert state == "closed"
            state = "open"
        elif name == "content_block_delta":
            assert state == "open"
        else:
            assert name == "content_block_stop" and state == "open"
            state = "closed"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences(client, reference, stream):
    prompt = reference.chat_prompt(chat_of(None, MESSAGES))
    expected = reference.greedy(prompt, 48)
    stop, at = spanning_stop(reference, expected.token_ids)
    kwargs = dict(model=MODEL_NAME, max_tokens=48, messages=MESSAGES, stop_sequences=["never-seen", stop],
                  extra_body=GREEDY)
    if stream:
        with client.messages.stream(**kwargs) as s:
            text = "".join(s.text_stream)
            message = s.get_final_message()
    else:
        message = client.messages.create(**kwargs)
        text = message.content[0].text
    assert text == expected.text[:at]
    assert message.stop_reason == "stop_sequence"
    assert message.stop_sequence == stop


@pytest.mark.parametrize("stream", [False, True])
def test_a_message_that_fills_the_context_stops_for_the_context_window(client, server, reference, stream):
    """max_tokens beyond the context's room is held to the room: a message that fills it stopped with
    "max_tokens", which says the client's own limit was reached (Claude Code asks for 128,000)."""
    def asking(n: int) -> list[dict]:
        return [{"role": "user", "content": "the cat sat on the mat. " * n}]

    once, twice = (len(reference.chat_prompt(asking(n))) for n in (1, 2))
    messages = asking((reference.model.args.max_position_embeddings - 30 - once) // (twice - once) + 1)
    prompt = reference.chat_prompt(messages)
    room = reference.model.args.max_position_embeddings - len(prompt)
    assert 0 < room <= 30 + twice - once and reference.greedy(prompt, room).finish_reason == "length"
    for max_tokens, reason in ((100_000, "model_context_window_exceeded"), (room - 1, "max_tokens")):
        if stream:
            with client.messages.stream(model=MODEL_NAME, max_tokens=max_tokens, messages=messages,
                                        extra_body=GREEDY) as s:
                message = s.get_final_message()
            got = message.stop_reason, message.usage.output_tokens
        else:  # the SDK streams whatever may take long: max_tokens 100,000 only goes in plain HTTP
            body = server.http.post("/v1/messages", json={"model": MODEL_NAME, "max_tokens": max_tokens,
                                                          "messages": messages, **GREEDY}).json()
            got = body["stop_reason"], body["usage"]["output_tokens"]
        assert got == (reason, min(room, max_tokens))


def test_count_tokens(client, reference):
    count = client.messages.count_tokens(model=MODEL_NAME, system=SYSTEM, messages=MESSAGES)
    assert count.input_tokens == len(reference.chat_prompt(chat_of(SYSTEM, MESSAGES)))


def test_content_blocks_and_tool_results_are_rendered(client, reference):
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]},
    ]
    expected = reference.greedy(reference.chat_prompt(chat_of(None, MESSAGES)), 8)
    message = client.messages.create(model=MODEL_NAME, max_tokens=8, messages=messages, extra_body=GREEDY)
    assert message.content[0].text == expected.text


def test_system_blocks_and_failed_tool_results_reach_the_model(client, reference):
    """System blocks are separate paragraphs (Claude Code sends several); a tool result with is_error says so."""
    blocks = [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Answer in one word."}]
    count = client.messages.count_tokens(model=MODEL_NAME, system=blocks, messages=MESSAGES)
    joined = chat_of("You are terse.\n\nAnswer in one word.", MESSAGES)
    assert count.input_tokens == len(reference.chat_prompt(joined))

    def with_result(content: str, is_error: bool) -> int:
        messages = [{"role": "user", "content": "Run it"},
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": is_error,
                                                  "content": [{"type": "text", "text": content}]}]}]
        return client.messages.count_tokens(model=MODEL_NAME, messages=messages).input_tokens

    assert with_result("no such file", True) == with_result("Error: no such file", False) != with_result(
        "no such file", False)


def test_documents_and_search_results_reach_the_model_as_text(client):
    """Claude Code sends the files it reads as document blocks, and they stay in the history: a text
    document is its text; a PDF, which this server cannot read, is named as left out, not a 400; a
    tool search's tool_reference is the tool's name."""
    def count(*content: dict, result: list | None = None) -> int:
        messages = [{"role": "user", "content": list(content)}]
        if result is not None:
            messages = [{"role": "user", "content": "Look it up"},
                        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "find", "input": {}}]},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": result}]}]
        return client.messages.count_tokens(model=MODEL_NAME, messages=messages).input_tokens

    ask = {"type": "text", "text": "Summarize."}
    document = {"type": "document", "title": "notes.txt", "citations": {"enabled": False},
                "source": {"type": "text", "media_type": "text/plain", "data": "The sea is wide."}}
    assert count(document, ask) == count({"type": "text", "text": "notes.txt\nThe sea is wide."}, ask)
    blocks = {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "The sea is wide."}]}}
    assert count(blocks, ask) == count({"type": "text", "text": "The sea is wide."}, ask)
    pdf = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}}
    assert count(pdf, ask) > count(ask)
    found = {"type": "search_result", "source": "https://example.com/sea", "title": "The sea",
             "content": [{"type": "text", "text": "It is wide."}]}
    assert count(result=[found]) == count(result=[{"type": "text", "text": "The sea (https://example.com/sea)\nIt is wide."}])
    # Claude Code's tool search answers with references to the tools it found (a 400 before).
    assert count(result=[{"type": "tool_reference", "tool_name": "Read"}]) == count(
        result=[{"type": "text", "text": "tool found: Read"}])
    answer = client.messages.create(model=MODEL_NAME, max_tokens=4, messages=[{"role": "user", "content": [pdf, ask]}])
    assert answer.content[0].type == "text"


@pytest.mark.parametrize("stream", [False, True])
def test_an_assistant_prefill_is_continued(client, reference, stream):
    """A conversation that ends with the assistant's words: the answer goes on from them, in the same turn."""
    messages = [{"role": "user", "content": "Tell me about the sea."}, {"role": "assistant", "content": "The sea"}]
    prompt = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=False,
                                                     continue_final_message=True)
    expected = reference.greedy(prompt, 8)
    if stream:
        with client.messages.stream(model=MODEL_NAME, max_tokens=8, messages=messages, extra_body=GREEDY) as s:
            text = s.get_final_text()
    else:
        text = client.messages.create(model=MODEL_NAME, max_tokens=8, messages=messages, extra_body=GREEDY
                                      ).content[0].text
    assert text == expected.text
    assert client.messages.count_tokens(model=MODEL_NAME, messages=messages).input_tokens == len(prompt)


ANTHROPIC_BAD = [
    ({"max_tokens": 8, "messages": MESSAGES}, 400),  # no model
    ({"model": MODEL_NAME, "messages": MESSAGES}, 400),  # no max_tokens
    ({"model": MODEL_NAME, "max_tokens": 8, "messages": []}, 400),
    ({"model": MODEL_NAME, "max_tokens": 8, "messages": [{"role": "developer", "content": "x"}]}, 400),
    ({"model": MODEL_NAME, "max_tokens": 8, "messages": MESSAGES, "temperature": 1.5}, 400),
    ({"model": MODEL_NAME, "max_tokens": 0, "messages": MESSAGES}, 400),
    ({"model": MODEL_NAME, "max_tokens": 8, "messages": MESSAGES, "stop_sequences": [""]}, 400),
    ({"model": MODEL_NAME, "max_tokens": 8, "messages": MESSAGES, "unknown": 1}, 400),
    ({"model": MODEL_NAME, "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, 400),
    ({"model": "claude-opus", "max_tokens": 8, "messages": MESSAGES}, 404),
]


@pytest.mark.parametrize("body, status", ANTHROPIC_BAD)
def test_bad_input_gets_anthropic_errors(server, body, status):
    response = server.http.post("/v1/messages", json=body)
    assert response.status_code == status, response.text
    payload = response.json()
    assert payload["type"] == "error"
    assert set(payload["error"]) == {"type", "message"}
    assert payload["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("messages", [
    b'[{"role": "user", "content": "caf\xe9"}]',  # Latin-1
    # Deep enough for transformers' and the chat template's recursive walks, within the JSON decoder's bound.
    b'[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", '
    b'"name": "f", "input": {"a": ' + b"[" * 900 + b"]" * 900 + b'}}]}, {"role": "user", "content": [{"type": '
    b'"tool_result", "tool_use_id": "toolu_1", "content": "ok"}]}]',
], ids=["not UTF-8", "nested too deeply for the template"])
def test_a_body_the_gateway_cannot_read_or_render_is_a_400_and_the_connection_serves_on(server, path, messages):
    limit = b'"max_tokens": 8, ' if path == "/v1/messages" else b""  # count_tokens refuses the field
    body = b'{"model": "tiny", ' + limit + b'"messages": ' + messages + b"}"
    response = server.http.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["type"] == "error" and response.json()["error"]["type"] == "invalid_request_error"
    # A 500 closed the connection, failing the client's next request on it.
    assert server.http.post("/v1/messages/count_tokens", json={"model": MODEL_NAME, "messages": MESSAGES}).is_success


def test_sdk_raises_typed_errors(client):
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-opus", max_tokens=8, messages=MESSAGES)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL_NAME, max_tokens=8, messages=[])


def test_tool_choice_none_renders_no_tools(client, reference):
    """`none` has no disable_parallel_tool_use: it was read all the same, a 500 (found by mypy)."""
    tool = {"name": "get_weather", "description": "Weather", "input_schema": {"type": "object", "properties": {}}}
    expected = reference.greedy(reference.chat_prompt(MESSAGES), 12)
    message = client.messages.create(model=MODEL_NAME, max_tokens=12, messages=MESSAGES, tools=[tool],
                                     tool_choice={"type": "none"}, extra_body=GREEDY)
    assert message.content[0].text == expected.text and message.stop_reason != "tool_use"


def test_a_request_as_claude_code_sends_it(client, reference):
    """The fields the current SDK's (beta) types define, on ?beta=true, as Claude Code sends them:
    a system message inside the conversation, adaptive thinking shown as omitted, output_config's
    effort, context_management, cache_control, tool fields, earlier (redacted) thinking."""
    history = [
        {"role": "user", "content": [{"type": "text", "text": "Hello there", "cache_control": {"type": "ephemeral"}}]},
        {"role": "system", "content": "Answer in one word."},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                          {"type": "redacted_thinking", "data": "xyz"},
                                          {"type": "text", "text": "Hi"}]},
        {"role": "user", "content": "And now?"},
    ]
    # strict: False (true holds the output to a grammar, whose valid UTF-8 the random model's reference is not).
    tools = [{"name": "Bash", "description": "Run a command", "type": "custom", "defer_loading": False,
              "strict": False, "input_examples": [{"command": "ls"}], "cache_control": {"type": "ephemeral"},
              "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]
    message = client.beta.messages.create(
        model=MODEL_NAME, max_tokens=12, system=[{"type": "text", "text": SYSTEM}], messages=history, tools=tools,
        thinking={"type": "adaptive", "display": "omitted"}, output_config={"effort": "high"},
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        cache_control={"type": "ephemeral"}, metadata={"user_id": "u-1"}, betas=["context-management-2025-06-27"],
        extra_body=GREEDY,
    )
    rendered = chat_of(SYSTEM, [{"role": "user", "content": "Hello there"},
                                {"role": "system", "content": "Answer in one word."},
                                {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "And now?"}])
    # The tiny model's template renders no tools: the prompt is the conversation alone.
    expected = reference.greedy(reference.chat_prompt(rendered), 12)
    assert message.content[0].text == expected.text
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == len(reference.chat_prompt(rendered))


def test_fields_the_sdk_does_not_define_are_still_refused(server):
    body = {"model": MODEL_NAME, "max_tokens": 4, "messages": MESSAGES}
    for extra, param in (({"frobnicate": 1}, "frobnicate"), ({"output_config": {"verbosity": "low"}},
                                                             "output_config.verbosity"),
                         ({"tools": [{"name": "t", "input_schema": {}, "color": "red"}]}, "tools[0].color")):
        r = server.http.post("/v1/messages?beta=true", json={**body, **extra})
        assert r.status_code == 400, r.text
        assert r.json()["type"] == "error" and param in r.json()["error"]["message"]


def test_output_config_format_constrains_the_output_to_the_schema(client):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 6}},
              "required": ["answer"], "additionalProperties": False}
    message = client.messages.create(model=MODEL_NAME, max_tokens=40, messages=MESSAGES,
                                     output_config={"format": {"type": "json_schema", "schema": schema}})
    if message.stop_reason == "end_turn":
        assert set(json.loads(message.content[0].text)) == {"answer"}
    else:  # out of tokens mid-object: still a prefix the grammar allowed
        assert message.content[0].text.startswith('{"answer"')


def test_models_are_listed_as_anthropic_s_sdk_reads_them(client, server):
    """/v1/models is both APIs': an entry has Anthropic's ModelInfo fields beside OpenAI's, the list
    Anthropic's page fields, and an unknown model is Anthropic's 404 when its SDK asks."""
    page = client.models.list()
    (model,) = page.data
    assert (model.id, model.type, model.display_name) == (MODEL_NAME, "model", MODEL_NAME)
    assert model.created_at.timestamp() > 0
    assert (page.has_more, page.first_id, page.last_id) == (False, MODEL_NAME, MODEL_NAME)
    assert client.models.retrieve(MODEL_NAME).display_name == MODEL_NAME
    with pytest.raises(anthropic.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    openai_404 = server.http.get("/v1/models/no-such-model").json()  # no anthropic-version: OpenAI's shape
    assert openai_404["error"]["code"] == "model_not_found"


def test_an_answer_of_whitespace_alone_is_the_same_streamed(tmp_path):
    """Streamed, the whitespace was held for the text after it, none came, and the text block came empty."""
    path = make_scripted_model(tmp_path / "model", ["\n\n"])
    server = Server(["serve", "--model", str(path), "--served-model-name", "blank"], tmp_path / "serve.log")
    try:
        server.wait_ready()
        client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
        body = dict(model="blank", max_tokens=8, messages=[{"role": "user", "content": "Hi"}], extra_body=GREEDY)
        whole = client.messages.create(**body)
        with client.messages.stream(**body) as stream:
            streamed = stream.get_final_message()
    finally:
        server.stop()
    assert [b.text for b in whole.content] == [b.text for b in streamed.content] == ["\n\n"]
