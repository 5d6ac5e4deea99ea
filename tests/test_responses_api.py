"""OpenAI's Responses API through the whole stack, with the official openai SDK;
every response and stream event validates against OpenAI's OpenAPI description."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.conftest import MODEL_NAME, Server
from tests.scripted_model import make_scripted_model
from tests.test_tools import CALL, SCRIPTS

KEYS = ["key-a", "key-b"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def event_schema(event: dict) -> str:
    """The spec's schema for an event: response.output_text.delta -> ResponseTextDeltaEvent."""
    words = event["type"].removeprefix("response.").replace("output_text", "text").replace(".", "_").split("_")
    return "Response" + "".join(w.capitalize() for w in words) + "Event"


def test_create_matches_mlx_lm(client, reference, validate):
    expected = reference.greedy(reference.chat_prompt([{"role": "user", "content": "Hello there"}]), 8)
    response = client.responses.create(model=MODEL_NAME, input="Hello there", temperature=0, max_output_tokens=8)
    assert response.output_text == expected.text
    assert response.status == ("incomplete" if expected.finish_reason == "length" else "completed")
    assert response.output[-1].status == response.status  # the message it cut short, too
    assert response.usage.output_tokens == len(expected.token_ids)
    validate(response.model_dump(mode="json", exclude_unset=True), "Response")


def test_truncation_auto_leaves_out_the_oldest_turns(client, reference):
    """The spec's truncation "auto": items dropped from the conversation's
    start until it fits; "disabled", the default, is a 400."""
    turn = "The keeper counted the ships that passed the rocks, one by one, night after night. " * 4
    items = []
    for i in range(30):
        items += [{"role": "user", "content": f"{i}: {turn}"}, {"role": "assistant", "content": turn}]
    items.append({"role": "user", "content": "And then?"})
    system = {"role": "system", "content": "Be brief."}
    assert len(reference.chat_prompt([system, *items])) >= 2048
    kept = next([system, *items[start:]] for start in range(2, len(items), 2)
                if len(reference.chat_prompt([system, *items[start:]])) < 2048)
    expected = reference.greedy(reference.chat_prompt(kept), 8)
    response = client.responses.create(model=MODEL_NAME, instructions="Be brief.", input=items, temperature=0,
                                       max_output_tokens=8, truncation="auto")
    assert response.output_text == expected.text
    assert response.usage.input_tokens == len(reference.chat_prompt(kept))
    with pytest.raises(openai.BadRequestError, match="prompt is too long"):
        client.responses.create(model=MODEL_NAME, instructions="Be brief.", input=items, max_output_tokens=8)


def test_stream_matches_mlx_lm_and_every_event_is_in_the_spec(server, reference, validate):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    expected = reference.greedy(reference.chat_prompt(messages), 8)
    body = {"model": MODEL_NAME, "instructions": "Be brief.", "input": [{"role": "user", "content": "Hello there"}],
            "temperature": 0, "max_output_tokens": 8, "stream": True}
    events = []
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    for event in events:
        validate(event, event_schema(event))
        validate(event, "ResponseStreamEvent")
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if expected.finish_reason == "length" else "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == expected.text == events[-1]["response"]["output"][0]["content"][0]["text"]


def test_previous_response_id_continues_the_conversation(client, reference):
    first = client.responses.create(model=MODEL_NAME, input="Hello there", temperature=0, max_output_tokens=6)
    second = client.responses.create(model=MODEL_NAME, input="And now?", previous_response_id=first.id,
                                     instructions="Be brief.", temperature=0, max_output_tokens=6)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
                {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And now?"}]
    assert second.output_text == reference.greedy(reference.chat_prompt(messages), 6).text
    assert client.responses.retrieve(second.id).output_text == second.output_text
    assert client.responses.delete(second.id) is None or True
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)


def test_an_item_reference_is_the_stored_item_it_names(client, reference):
    """As the Vercel AI SDK (opencode, with OpenAI's provider) sends earlier turns when responses are stored."""
    first = client.responses.create(model=MODEL_NAME, input="Hello there", temperature=0, max_output_tokens=6)
    (message,) = first.output
    second = client.responses.create(model=MODEL_NAME, temperature=0, max_output_tokens=6, input=[
        {"role": "user", "content": "Hello there"}, {"id": message.id},  # its type may be left out
        {"role": "user", "content": "And now?"}])
    messages = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "And now?"}]
    assert second.output_text == reference.greedy(reference.chat_prompt(messages), 6).text
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL_NAME, input=[{"type": "item_reference", "id": "msg_nowhere"}])
    assert e.value.body["param"] == "input[0].id"


def test_a_response_not_stored_cannot_be_continued(client):
    unstored = client.responses.create(model=MODEL_NAME, input="Hello", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL_NAME, input="Hi", previous_response_id=unstored.id)
    assert e.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL_NAME, "input": "x", "frobnicate": 1}, "frobnicate"),
    ({"model": MODEL_NAME, "input": [{"type": "web_search_call", "id": "w"}]}, "input[0].type"),
    ({"model": MODEL_NAME, "input": [{"type": []}]}, "input[0].type"),
    ({"model": MODEL_NAME, "input": [{"role": "user", "content": "x", "colour": 1}]}, "input[0].colour"),
    ({"model": MODEL_NAME, "input": [{"type": "function_call", "name": "f"}]}, "input[0]"),
    ({"model": MODEL_NAME, "input": "x", "tools": [{"type": "function"}]}, "tools[0]"),
    # The client's own tools of other kinds would be waited for in vain: they were dropped without a word.
    ({"model": MODEL_NAME, "input": "x", "tools": [{"type": "custom", "name": "apply_patch"}]}, "tools[0].type"),
    ({"model": MODEL_NAME, "input": "x", "tools": [{"type": "web_search"}, {"name": "f"}]}, "tools[1].type"),
    ({"model": MODEL_NAME, "input": "x", "tools": [{"type": "namespace", "name": "n", "description": "d",
                                                    "tools": [{"type": "local_shell"}]}]}, "tools[0].tools[0].type"),
    ({"model": MODEL_NAME, "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    # Asked for and not given, they were ignored: an empty list of log-probabilities.
    ({"model": MODEL_NAME, "input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": 2}, "include"),
    ({"model": MODEL_NAME, "input": "x", "top_logprobs": 2}, "top_logprobs"),
    ({"model": MODEL_NAME, "input": "x", "include": ["bogus.value"]}, "include"),
    # A call's output that answers no call, as OpenAI refuses it (it went into the prompt as a tool's result).
    ({"model": MODEL_NAME, "input": [{"role": "user", "content": "x"},
                                     {"type": "function_call_output", "call_id": "c9", "output": "18"}]},
     "input[1].call_id"),
    ({"model": MODEL_NAME, "input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"model": MODEL_NAME, "input": "x", "stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"model": MODEL_NAME, "input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "banana"}}}},
     "text.format"),
])
def test_bad_input_is_a_400_naming_the_parameter(server, body, param):
    r = server.http.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"].startswith(param), error


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    markers, script = SCRIPTS["hermes"]
    path = make_scripted_model(tmp_path_factory.mktemp("responses") / "model", script, markers)
    args = ["serve", "--model", str(path), "--served-model-name", "scripted"]
    for key in KEYS:
        args += ["--api-key", key]
    server = Server(args, path.parent / "serve.log")
    server.wait_ready()
    yield server
    server.stop()


TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
         {"type": "web_search"}]  # a hosted tool: not offered to the model


def test_a_function_call_round_trip(tool_server, validate):
    client = openai.OpenAI(base_url=tool_server.url + "/v1", api_key=KEYS[0], max_retries=0)
    first = client.responses.create(model="scripted", input="Weather in Paris?", tools=TOOLS, temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(CALL["name"], CALL["arguments"])]
    validate(first.model_dump(mode="json", exclude_unset=True), "Response")
    with client.responses.stream(model="scripted", input="Weather in Paris?", tools=TOOLS, temperature=0) as stream:
        final = stream.get_final_response()
    assert [(c.name, c.arguments) for c in final.output if c.type == "function_call"] == [
        (c.name, c.arguments) for c in calls]
    # The tool's result goes back as an item, continuing the stored response.
    second = client.responses.create(model="scripted", previous_response_id=first.id, tools=TOOLS, temperature=0,
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "18 degrees and sunny"}])
    assert second.usage.input_tokens > first.usage.input_tokens + 5
    # The same turn with the whole history sent back instead, as Codex CLI does (store: false).
    history = [{"role": "user", "content": "Weather in Paris?"}, *[item.model_dump(mode="json", by_alias=True) for item in first.output],
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 degrees and sunny"}]
    resent = client.responses.create(model="scripted", input=history, tools=TOOLS, temperature=0, store=False)
    assert resent.usage.input_tokens == second.usage.input_tokens
    # The spec's other fields of a call's output (its function's name) are taken, as its call's are.
    history[-1] |= {"name": CALL["name"], "caller": {"type": "direct"}}
    named = client.responses.create(model="scripted", input=history, tools=TOOLS, temperature=0, store=False)
    assert named.usage.input_tokens == second.usage.input_tokens


def test_what_is_not_offered_says_so(server):
    """A stored response asked for as a stream answered JSON, which the SDK read as an empty stream; the API's
    other endpoints were a 405 (compact, input_tokens: the route of a stored response) or a bare 404."""
    stored = server.http.post("/v1/responses", json={"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 2})
    streamed = server.http.get(f"/v1/responses/{stored.json()['id']}", params={"stream": "true"})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "stream"
    for method, path in (("POST", "/v1/responses/compact"), ("POST", "/v1/responses/input_tokens"),
                         ("GET", f"/v1/responses/{stored.json()['id']}/input_items"),
                         ("POST", f"/v1/responses/{stored.json()['id']}/cancel")):
        answer = server.http.request(method, path, json={"model": MODEL_NAME, "input": "Hi"})
        assert answer.status_code == 404 and f"does not offer {method} {path}" in answer.json()["error"]["message"]


def test_text_after_a_call_sent_back_is_the_same_turn_as_stored(tmp_path):
    """A response's output [message, function_call, message] sent back whole (Codex, store: false) rendered
    its second message as a turn of its own between the call and its result: another prompt than the
    stored response's continuation, and a miss in the prefix cache every turn."""
    markers, script = SCRIPTS["hermes-between"]
    path = make_scripted_model(tmp_path / "model", script, markers)
    server = Server(["serve", "--model", str(path), "--served-model-name", "scripted"], tmp_path / "serve.log")
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        first = client.responses.create(model="scripted", input="Weather in Paris?", tools=TOOLS, temperature=0)
        assert [item.type for item in first.output] == ["message", "function_call", "message"]
        (call,) = [item for item in first.output if item.type == "function_call"]
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}
        stored = client.responses.create(model="scripted", previous_response_id=first.id, tools=TOOLS,
                                         temperature=0, input=[result], max_output_tokens=1)
        history = [{"role": "user", "content": "Weather in Paris?"},
                   *[item.model_dump(mode="json", by_alias=True) for item in first.output], result]
        resent = client.responses.create(model="scripted", input=history, tools=TOOLS, temperature=0, store=False,
                                         max_output_tokens=1)
    finally:
        server.stop()
    assert resent.usage.input_tokens == stored.usage.input_tokens


def test_a_namespaces_functions_are_offered_and_their_calls_name_it(tool_server, validate):
    """Codex offers its sub-agent tools under a namespace tool; a call to one says which namespace it is in."""
    namespaced = [{"type": "namespace", "name": "forecasts", "description": "Weather services",
                   "tools": [TOOLS[0]]}, TOOLS[1]]
    body = {"model": "scripted", "input": "Weather in Paris?", "tools": namespaced, "temperature": 0}
    response = tool_server.http.post("/v1/responses", json=body, headers={"Authorization": f"Bearer {KEYS[0]}"})
    validate(response.json(), "Response")
    calls = [item for item in response.json()["output"] if item["type"] == "function_call"]
    assert [(c["namespace"], c["name"]) for c in calls] == [("forecasts", CALL["name"])]
    plain = tool_server.http.post("/v1/responses", json=dict(body, tools=TOOLS),
                                  headers={"Authorization": f"Bearer {KEYS[0]}"}).json()
    assert ["namespace" in item for item in plain["output"] if item["type"] == "function_call"] == [False]


def test_a_stored_response_is_only_visible_to_the_key_that_stored_it(tool_server):
    a, b = (openai.OpenAI(base_url=tool_server.url + "/v1", api_key=key, max_retries=0) for key in KEYS)
    mine = a.responses.create(model="scripted", input="Hello", max_output_tokens=2)
    assert a.responses.retrieve(mine.id).id == mine.id
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.create(model="scripted", input="Hi", previous_response_id=mine.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.delete(mine.id)
    a.responses.delete(mine.id)


def test_text_format_json_schema_constrains_the_output(client, validate):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 6}},
              "required": ["answer"], "additionalProperties": False}
    raw = client.responses.with_raw_response.create(
        model=MODEL_NAME, input="Hello there", max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "a", "schema": schema}})
    validate(raw.http_response.json(), "Response")  # the format echoed back: no null description
    response = raw.parse()
    if response.status == "completed":
        assert set(json.loads(response.output_text)) == {"answer"}
    else:  # out of tokens mid-object: still a prefix the grammar allowed
        assert response.output_text.startswith('{"answer"')
    plain_json = client.responses.create(model=MODEL_NAME, input="Hello there", max_output_tokens=40,
                                         text={"format": {"type": "json_object"}})
    assert plain_json.output_text.lstrip().startswith("{")  # json_object: a JSON object


@pytest.fixture(scope="module")
def reasoning_server(tmp_path_factory):
    markers, script = SCRIPTS["reasoning"]
    path = make_scripted_model(tmp_path_factory.mktemp("responses-reasoning") / "model", script, markers)
    server = Server(["serve", "--model", str(path), "--served-model-name", "scripted"], path.parent / "serve.log")
    server.wait_ready()
    yield server
    server.stop()


@pytest.mark.parametrize("summary", [None, "auto"])
def test_reasoning_comes_back_as_a_reasoning_item(reasoning_server, validate, summary):
    """As reasoning_text content; as the summary when one is asked for (the reasoning is its own summary)."""
    body = {"model": "scripted", "input": "What is the capital of France?", "temperature": 0,
            "reasoning": {"effort": "high", "summary": summary}}
    response = reasoning_server.http.post("/v1/responses", json=body).json()
    validate(response, "Response")
    reasoning, message = response["output"]
    part = {"type": "summary_text" if summary else "reasoning_text", "text": "The user wants the capital.\n"}
    assert (reasoning["type"], reasoning["summary" if summary else "content"]) == ("reasoning", [part])
    assert message["content"][0]["text"] == "Paris."
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == 3  # <think>, its text, </think>
    events = []
    with reasoning_server.http.stream("POST", "/v1/responses", json=dict(body, stream=True)) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    for event in events:
        validate(event, event_schema(event))
    kinds = [e["type"] for e in events]
    prefix = "response.reasoning_summary_text" if summary else "response.reasoning_text"
    text = "".join(e["delta"] for e in events if e["type"] == prefix + ".delta")
    assert text == part["text"] and prefix + ".done" in kinds
    assert ("response.reasoning_summary_part.added" in kinds) == bool(summary)
    added = next(e["item"] for e in events if e["type"] == "response.output_item.added")
    assert added["summary"] == []  # its part comes with reasoning_summary_part.added, once
    assert events[-1]["response"]["output"][0] == dict(reasoning, id=events[-1]["response"]["output"][0]["id"])


def test_reasoning_cut_short_is_the_incomplete_item(reasoning_server, validate):
    """Out of tokens while thinking: the reasoning is incomplete, and no message is made up after it."""
    body = {"model": "scripted", "input": "What is the capital of France?", "temperature": 0,
            "reasoning": {"effort": "max"}, "max_output_tokens": 2}
    response = reasoning_server.http.post("/v1/responses", json=body).json()
    validate(response, "Response")
    assert response["status"] == "incomplete"
    assert [(item["type"], item["status"]) for item in response["output"]] == [("reasoning", "incomplete")]
    with reasoning_server.http.stream("POST", "/v1/responses", json=dict(body, stream=True)) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete"
    assert [(item["type"], item["status"]) for item in final["output"]] == [("reasoning", "incomplete")]


def test_whitespace_that_opens_the_answer_is_streamed_too(tmp_path):
    """Whitespace alone opens no message, but it is the start of the text after it (code's indentation,
    a token of its own in many vocabularies): the stream dropped it, and said another answer than body."""
    script = ["<think>", "\nthink\n", "</think>", "\n", "    ", "return", " x"]
    path = make_scripted_model(tmp_path / "model", script, "<think>")
    server = Server(["serve", "--model", str(path), "--served-model-name", "scripted"], tmp_path / "serve.log")
    try:
        server.wait_ready()
        body = {"model": "scripted", "input": "Code?", "temperature": 0}
        whole = server.http.post("/v1/responses", json=body).json()
        with server.http.stream("POST", "/v1/responses", json=dict(body, stream=True)) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    finally:
        server.stop()
    texts = [part["text"] for item in whole["output"] if item["type"] == "message" for part in item["content"]]
    assert texts == ["    return x"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "    return x"
    final = events[-1]["response"]["output"]
    assert [part["text"] for item in final if item["type"] == "message" for part in item["content"]] == texts


def test_a_cancelled_response_says_cancelled(server, validate):
    body = {"model": MODEL_NAME, "input": "Once upon a time", "temperature": 0, "max_output_tokens": 1500,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as r:
        lines = (json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: "))
        response_id = next(lines)["response"]["id"]
        next(e for e in lines if e["type"] == "response.output_text.delta")
        assert server.http.post(f"/v1/requests/{response_id}/cancel").json()["cancelled"] is True
        events = list(lines)
    final = events[-1]
    validate(final, event_schema(final))
    assert final["type"] == "response.failed"
    assert final["response"]["status"] == "cancelled"
    assert final["response"]["error"] is None  # OpenAI's error codes have none for a cancel
    assert final["response"]["output"][-1]["status"] == "incomplete"
    stored = server.http.get(f"/v1/responses/{response_id}").json()
    assert stored["status"] == "cancelled" and stored["output"] == final["response"]["output"]
