"""Ollama's API (/api/*) through Ollama's own client library, unchanged,
against a real `mlxd serve`: greedy answers equal mlx-lm's in-process output
and the OpenAI endpoint's; bad input gets Ollama's error shape."""

from __future__ import annotations

import json
import re
import shutil

import mlx.core as mx
import numpy as np
import ollama
import pytest

from tests.conftest import MODEL_NAME, Server, running, wait_for
from tests.scripted_model import make_scripted_model
from tests.test_embeddings import expected as expected_embedding
from tests.tiny_model import CHAT_TEMPLATE, make_tiny_model

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about the sea."}]
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url)


def openai_chat(server, messages: list[dict], max_tokens: int) -> str:
    response = server.http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages,
                                                               "max_tokens": max_tokens, "temperature": 0})
    return response.json()["choices"][0]["message"]["content"]


def test_chat_equals_mlx_lm_and_the_openai_endpoint(client, server, reference):
    expected = reference.greedy(reference.chat_prompt(MESSAGES), GREEDY["num_predict"])
    answer = client.chat(model=MODEL_NAME, messages=MESSAGES, options=GREEDY)
    assert answer.message.role == "assistant"
    assert answer.message.content == expected.text == openai_chat(server, MESSAGES, GREEDY["num_predict"])
    assert answer.done and answer.done_reason == expected.finish_reason
    assert answer.prompt_eval_count == len(reference.chat_prompt(MESSAGES))
    assert answer.eval_count == len(expected.token_ids)
    assert answer.total_duration >= answer.prompt_eval_duration > 0


def test_a_chat_longer_than_the_context_loses_its_oldest_turns(client, server, reference):
    """As Ollama does (Open WebUI's long chats go on): the system message
    stays, the oldest turns go, what is kept starts at a user message; the
    OpenAI endpoint still answers such a conversation with a 400."""
    turn = "The keeper counted the ships that passed the rocks, one by one, night after night. " * 4
    history = [MESSAGES[0]]
    for i in range(30):
        history += [{"role": "user", "content": f"{i}: {turn}"}, {"role": "assistant", "content": turn}]
    history.append({"role": "user", "content": "And then?"})
    context = 2048
    assert len(reference.chat_prompt(history)) >= context
    kept = next([MESSAGES[0], *history[start:]] for start in range(1, len(history), 2)
                if len(reference.chat_prompt([MESSAGES[0], *history[start:]])) < context)
    expected = reference.greedy(reference.chat_prompt(kept), GREEDY["num_predict"])
    answer = client.chat(model=MODEL_NAME, messages=history, options=GREEDY)
    assert answer.message.content == expected.text
    assert answer.prompt_eval_count == len(reference.chat_prompt(kept))
    too_long = server.http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": history,
                                                               "max_tokens": 4})
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    not_cut = server.http.post("/api/chat", json={"model": MODEL_NAME, "messages": history, "truncate": False,
                                                  "stream": False, "options": GREEDY})
    assert not_cut.status_code == 400 and "context" in not_cut.json()["error"]


def test_streamed_chat_is_the_same_text_in_ndjson_lines(client, server, reference):
    expected = reference.greedy(reference.chat_prompt(MESSAGES), GREEDY["num_predict"]).text
    parts = list(client.chat(model=MODEL_NAME + ":latest", messages=MESSAGES, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == expected
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done
    assert parts[-1].eval_count > 0 and parts[-1].eval_duration > 0
    with server.http.stream("POST", "/api/chat", json={"model": MODEL_NAME, "messages": MESSAGES,
                                                       "options": GREEDY}) as response:
        assert response.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in response.iter_lines() if line]
    assert "".join(line["message"]["content"] for line in lines) == expected


def test_generate_templates_the_prompt_or_takes_it_raw(client, reference):
    prompt = "Once upon a time"
    chat = reference.greedy(reference.chat_prompt([{"role": "user", "content": prompt}]), GREEDY["num_predict"])
    assert client.generate(model=MODEL_NAME, prompt=prompt, options=GREEDY).response == chat.text
    raw = reference.greedy(reference.text_prompt(prompt), GREEDY["num_predict"])
    assert client.generate(model=MODEL_NAME, prompt=prompt, raw=True, options=GREEDY).response == raw.text
    streamed = client.generate(model=MODEL_NAME, prompt=prompt, raw=True, options=GREEDY, stream=True)
    assert "".join(p.response for p in streamed) == raw.text


def test_a_model_whose_tool_use_template_is_a_named_one_takes_tools(tmp_path):
    """Named templates (Hermes 2 Pro's, Command R's: a default and a tool_use one) read as no template when
    the gateway looked for tools in it: "does not support tools", where the OpenAI API called them."""
    tool_use = "{% if tools %}{{ 'Tools: ' + tools | map(attribute='function.name') | join(',') + '\\n' }}" \
               "{% endif %}" + CHAT_TEMPLATE
    model = make_tiny_model(tmp_path / "named", chat_template=[{"name": "default", "template": CHAT_TEMPLATE},
                                                               {"name": "tool_use", "template": tool_use}])
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with running(["serve", "--model", str(model), "--served-model-name", "named"], tmp_path / "serve.log") as srv:
        client = ollama.Client(host=srv.url)
        answer = client.chat(model="named", messages=MESSAGES, tools=tools, options=GREEDY)
        assert answer.done and "tools" in client.show("named").capabilities
        assert client.generate(model="named", keep_alive=0).done_reason == "unload"
        assert "tools" in client.show("named").capabilities  # from its files, not loaded


def test_generate_on_a_model_without_a_chat_template_takes_the_prompt_as_it_is(reference, tmp_path):
    """Ollama's default template is the prompt alone: a base model answered
    /api/generate (without raw) with a 400 "no chat template"."""
    model = make_tiny_model(tmp_path / "base", chat_template="")
    prompt = "Once upon a time"
    expected = reference.greedy(reference.text_prompt(prompt), GREEDY["num_predict"]).text
    with running(["serve", "--model", str(model), "--served-model-name", "base"], tmp_path / "serve.log") as srv:
        client = ollama.Client(host=srv.url)
        assert client.generate(model="base", prompt=prompt, options=GREEDY).response == expected
        assert client.generate(model="base", prompt=prompt, raw=True, options=GREEDY).response == expected
        with pytest.raises(ollama.ResponseError) as refused:
            client.chat(model="base", messages=[{"role": "user", "content": prompt}], options=GREEDY)
    assert refused.value.status_code == 400 and "no chat template" in refused.value.error


def test_options_stop_and_format(client, reference):
    expected = reference.greedy(reference.chat_prompt(MESSAGES), 40).text
    stop = expected[5:9]
    cut = client.chat(model=MODEL_NAME, messages=MESSAGES, options={"temperature": 0, "num_predict": 40,
                                                                     "stop": [stop]})
    assert cut.message.content == expected[:expected.index(stop)] and cut.done_reason == "stop"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    shaped = client.chat(model=MODEL_NAME, messages=MESSAGES, format=schema, options={"temperature": 0,
                                                                                       "num_predict": 60})
    if shaped.done_reason == "stop":
        assert isinstance(json.loads(shaped.message.content)["n"], int)
    else:
        assert shaped.message.content.startswith("{")


def test_embed_and_the_older_embeddings(client, reference):
    texts = ["Once upon a time", "the cat sat on the mat"]
    result = client.embed(model=MODEL_NAME, input=texts)
    for vector, text in zip(result.embeddings, texts):
        np.testing.assert_allclose(vector, expected_embedding(reference, reference.text_prompt(text)),
                                   rtol=0, atol=1e-6)
    assert result.prompt_eval_count == sum(len(reference.text_prompt(t)) for t in texts)
    older = client.embeddings(model=MODEL_NAME, prompt=texts[0])
    np.testing.assert_allclose(older.embedding, result.embeddings[0], rtol=0, atol=1e-7)


def test_model_management_says_how_mlxd_manages_models(client, server):
    """Ollama's pull, create, copy, delete (Open WebUI's model manager calls them) were a bare 404."""
    for call in (lambda: client.pull("smollm2"), lambda: client.delete("smollm2"),
                 lambda: client.copy(MODEL_NAME, "other")):
        with pytest.raises(ollama.ResponseError) as refused:
            call()
        assert refused.value.status_code == 501 and "mlxd pull NAME" in refused.value.error
    assert server.http.head("/api/blobs/sha256:00").status_code == 501


def test_embed_cuts_an_input_longer_than_the_context_unless_told_not_to(tiny_model, reference, tmp_path):
    """Ollama's `truncate` (true unless sent false) keeps an input's start, and what the tokenizer adds
    after it: an embedding model's EOS, which it pools on (Qwen3-Embedding's tokenizer appends one).
    It was ignored, and every over-long chunk of a RAG ingestion (LangChain's OllamaEmbeddings, Open
    WebUI) was a 400."""
    model = tmp_path / "eos"
    shutil.copytree(tiny_model, model)
    vocabulary = json.loads((model / "tokenizer.json").read_text())
    eos = next(t["id"] for t in vocabulary["added_tokens"] if t["content"] == "<|im_end|>")
    end = {"SpecialToken": {"id": "<|im_end|>", "type_id": 0}}
    vocabulary["post_processor"] = {
        "type": "TemplateProcessing", "single": [{"Sequence": {"id": "A", "type_id": 0}}, end],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}, end],
        "special_tokens": {"<|im_end|>": {"id": "<|im_end|>", "ids": [eos], "tokens": ["<|im_end|>"]}}}
    (model / "tokenizer.json").write_text(json.dumps(vocabulary))
    text = "the cat sat on the mat. " * 400
    ids = reference.text_prompt(text)
    context = reference.model.args.max_position_embeddings
    assert len(ids) > context
    with running(["serve", "--model", str(model), "--served-model-name", "eos"], tmp_path / "serve.log") as srv:
        client = ollama.Client(host=srv.url)
        result = client.embed(model="eos", input=text)
        with pytest.raises(ollama.ResponseError) as refused:
            client.embed(model="eos", input=text, truncate=False)
    assert result.prompt_eval_count == context
    np.testing.assert_allclose(result.embeddings[0], expected_embedding(reference, ids[:context - 1] + [eos]),
                               rtol=0, atol=1e-5)
    assert refused.value.status_code == 400 and "context" in refused.value.error


def test_tags_ps_show_and_version(client, server):
    listed = client.list().models
    assert [m.model for m in listed] == [MODEL_NAME + ":latest"]
    # Ollama's list has no such fields: a null there breaks clients that share one struct with /api/ps.
    assert not {"expires_at", "size_vram"} & set(server.http.get("/api/tags").json()["models"][0])
    assert listed[0].size > 0 and listed[0].details.format == "safetensors" and listed[0].details.family == "llama"
    running_models = client.ps().models
    assert [m.model for m in running_models] == [MODEL_NAME + ":latest"]
    assert running_models[0].size_vram == running_models[0].size > 0 and running_models[0].context_length == 2048
    shown = client.show(MODEL_NAME)
    assert "completion" in shown.capabilities and "<|im_start|>" in shown.template
    # Go reads a null as a field left out, and times always have their fraction (OllamaKit reads none without).
    raw = server.http.post("/api/show", json={"model": MODEL_NAME, "name": None, "verbose": None}).json()
    assert raw["template"] == shown.template
    times = [m["modified_at"] for m in server.http.get("/api/tags").json()["models"]]
    times += [m["expires_at"] for m in server.http.get("/api/ps").json()["models"]]
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", t) for t in times), times
    assert shown.modelinfo["llama.context_length"] == 2048
    assert server.http.get("/api/version").json()["version"]
    # Ollama's CLI checks the server with HEAD / before each command; apps look for this text.
    assert server.http.head("/").status_code == 200 and server.http.get("/").text == "Ollama is running"
    entry = server.http.get("/v1/models").json()["data"][0]
    assert entry["size"] > 0 and entry["context_length"] == 2048


def test_load_and_unload_with_an_empty_request(tiny_model, tmp_path):
    srv = Server(["serve", "--model", str(tiny_model), "--served-model-name", MODEL_NAME], tmp_path / "load.log",
                 env={"MLXD_PRELOAD": "false"})
    try:
        wait_for(srv.answers, 30, "the gateway")
        client = ollama.Client(host=srv.url)
        assert client.ps().models == []
        unloaded = client.list().models
        assert client.generate(model=MODEL_NAME).done_reason == "load"
        assert [m.model for m in client.ps().models] == [MODEL_NAME + ":latest"]
        # What its files say, loaded or not (loaded, its weights may be dequantized): clients cache by the digest.
        assert [(m.size, m.digest, m.details) for m in client.list().models] == [
            (m.size, m.digest, m.details) for m in unloaded]
        assert re.fullmatch("[0-9a-f]{64}", unloaded[0].digest)
        assert client.generate(model=MODEL_NAME, keep_alive=0).done_reason == "unload"
        assert client.ps().models == []
        assert client.chat(model=MODEL_NAME, messages=[]).done_reason == "load"
        assert client.generate(model=MODEL_NAME, keep_alive=0).done_reason == "unload"
        # Embedding models are loaded with an empty request of their own endpoints.
        assert srv.http.post("/api/embed", json={"model": MODEL_NAME, "input": []}).json()["embeddings"] == []
        assert [m.model for m in client.ps().models] == [MODEL_NAME + ":latest"]
        client.generate(model=MODEL_NAME, keep_alive=0)
        assert srv.http.post("/api/embeddings", json={"model": MODEL_NAME, "prompt": None}).json() == {"embedding": []}
        assert [m.model for m in client.ps().models] == [MODEL_NAME + ":latest"]
        assert client.generate(model=MODEL_NAME, keep_alive=0).done_reason == "unload"
        # A request that loads its model: the load is load_duration, not prompt evaluation.
        answer = client.chat(model=MODEL_NAME, messages=MESSAGES, options=GREEDY)
        assert answer.load_duration > 10 * answer.prompt_eval_duration > 0
        again = client.chat(model=MODEL_NAME, messages=MESSAGES, options=GREEDY)
        assert again.load_duration < answer.load_duration / 10
    finally:
        srv.stop()


def test_a_pinned_model_outlasts_a_clients_unload(tiny_model, tmp_path):
    """keep_alive 0 is any client's to send; keeping a model loaded is the operator's (--pin) to say."""
    srv = Server(["serve", "--model", str(tiny_model), "--served-model-name", MODEL_NAME, "--pin", MODEL_NAME],
                 tmp_path / "pinned.log")
    try:
        wait_for(srv.answers, 30, "the gateway")
        client = ollama.Client(host=srv.url)
        assert client.generate(model=MODEL_NAME).done_reason == "load"
        client.generate(model=MODEL_NAME, keep_alive=0)
        assert [m.model for m in client.ps().models] == [MODEL_NAME + ":latest"]
    finally:
        srv.stop()


@pytest.mark.parametrize("path,body,status,words", [
    ("/api/chat", {"model": "nope", "messages": MESSAGES}, 404, "does not exist"),
    ("/api/chat", {"model": MODEL_NAME, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("/api/chat", {"model": MODEL_NAME, "messages": MESSAGES, "options": {"temperature": -1}}, 400,
     "temperature"),
    ("/api/chat", {"model": MODEL_NAME, "messages": MESSAGES, "format": "yaml"}, 400, "format"),
    ("/api/chat", {"model": MODEL_NAME, "messages": MESSAGES, "think": "very"}, 400, "think"),
    ("/api/chat", {"model": MODEL_NAME, "messages": MESSAGES, "think": True}, 400,
     f'"{MODEL_NAME}" does not support thinking'),
    ("/api/generate", {"model": MODEL_NAME, "prompt": "x", "think": "high"}, 400, "does not support thinking"),
    ("/api/generate", {"model": MODEL_NAME, "prompt": "x", "raw": True, "think": "very"}, 400, "think must be"),
    ("/api/chat", {"model": MODEL_NAME, "messages": "hello"}, 400, "messages"),
    ("/api/generate", {"model": MODEL_NAME, "prompt": "x", "context": [1, 2]}, 400, "context"),
    ("/api/generate", {"model": MODEL_NAME, "prompt": "x", "raw": True, "system": "Be terse."}, 400, "raw"),
    ("/api/chat", {"model": MODEL_NAME, "messages": MESSAGES, "tools": [{"function": {"name": "f"}}]}, 400,
     f'"{MODEL_NAME}" does not support tools'),
    ("/api/chat", {"model": MODEL_NAME, "messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs"),
    ("/api/embed", {"model": MODEL_NAME, "input": [""]}, 400, "empty"),
    ("/api/embed", {"model": MODEL_NAME, "input": ["a", ""]}, 400, "empty"),
    ("/api/embed", {"model": MODEL_NAME, "input": ["x"] * 2049}, 400, "input"),
    ("/api/chat", {"model": MODEL_NAME, "messages": MESSAGES, "options": {"seed": 2**64}}, 400, "seed"),
    ("/api/chat", {"model": MODEL_NAME, "messages": MESSAGES, "options": {"top_k": 2**64}}, 400, "top_k"),
    ("/api/chat", {"model": MODEL_NAME, "messages": MESSAGES, "options": {"stop": ["x"] * 65}}, 400, "stop"),
    ("/api/show", {"model": "nope"}, 404, "does not exist"),
    ("/api/show", {}, 400, "model is required"),
    ("/api/show", {"model": MODEL_NAME, "verbose": "very"}, 400, "verbose"),
    ("/api/chat", {"model": MODEL_NAME, "messages": MESSAGES, "options": {"temperature": "inf"}}, 400, "temperature"),
    ("/api/chat", {"model": MODEL_NAME, "messages": MESSAGES, "options": {"top_k": "-inf"}}, 400, "top_k"),
    ("/api/chat", {"model": MODEL_NAME, "messages": MESSAGES, "options": {"seed": "nan"}}, 400, "seed"),
    ("/api/embed", {"model": MODEL_NAME, "input": "x", "options": "fast"}, 400, "options"),
    ("/api/embeddings", {"model": MODEL_NAME, "prompt": "x", "options": []}, 400, "options"),
    # A tool in another API's flat shape, or nameless: a 500 from deep inside the grammar or the parser.
    ("/api/chat", {"model": MODEL_NAME, "messages": MESSAGES, "format": "json",
                   "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}, 400, "tools[0]"),
    ("/api/chat", {"model": MODEL_NAME, "messages": MESSAGES, "tools": [{"function": {"name": ""}}]}, 400,
     "tools[0].function.name"),
])
def test_bad_input_gets_ollamas_error_shape(server, path, body, status, words):
    response = server.http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()
    assert list(error) == ["error"] and words in error["error"]


@pytest.mark.parametrize("body, words", [
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "caf\xe9"}]}', "not valid UTF-8"),
    # Inside a free-form object msgspec's path reads `$[...][1][...]`: left out of the message.
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", '
     b'"tool_calls": [{"function": {"name": "f", "arguments": {"a": 1e400}}}]}]}', "Number out of range"),
])
def test_a_body_that_does_not_decode_gets_a_400_saying_why(server, body, words):
    response = server.http.post("/api/chat", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400 and list(response.json()) == ["error"], response.text
    assert words in response.json()["error"] and "[...]" not in response.json()["error"]


def test_nulls_and_options_ollama_takes_are_taken(server, reference):
    """Go reads a null as the field left out; Ollama bounds neither temperature nor top_k (0 or less: off)."""
    expected = reference.greedy(reference.chat_prompt(MESSAGES), GREEDY["num_predict"]).text
    messages = [MESSAGES[0], {**MESSAGES[1], "images": None, "tool_calls": None, "thinking": None}]
    body = {"model": MODEL_NAME, "messages": messages, "stream": None, "format": None, "tools": None,
            "options": {**GREEDY, "top_k": -1, "stop": None}}
    answer = server.http.post("/api/chat", json=body)
    assert answer.status_code == 200, answer.text
    lines = [json.loads(line) for line in answer.text.splitlines()]  # stream: null is the default, a stream
    assert len(lines) > 1 and "".join(line["message"]["content"] for line in lines) == expected
    nulls = server.http.post("/api/chat", json={"model": MODEL_NAME, "stream": False, "options": {"temperature": 3},
                                                "messages": [{"role": "user", "content": None}]})
    assert nulls.status_code == 200, nulls.text


def test_values_ollama_takes_beyond_openais_ranges_are_taken(server, reference):
    """Go cuts a float to an integer and bounds no penalty; a limit of 0 or less is none; editors send a stop
    string per keyword (more than OpenAI's limit); OpenAI's `developer` role is the system's."""
    expected = reference.greedy(reference.chat_prompt(MESSAGES), 5).text
    messages = [{**MESSAGES[0], "role": "developer"}, MESSAGES[1]]
    options = {"temperature": 0, "num_predict": 5.7, "top_k": 40.5, "seed": 7.9, "presence_penalty": 0, "min_p": 0,
               "stop": [f"never seen {i}" for i in range(20)]}
    answer = server.http.post("/api/chat", json={"model": MODEL_NAME, "messages": messages, "stream": False,
                                                 "options": options})
    assert answer.status_code == 200, answer.text
    assert answer.json()["message"]["content"] == expected and answer.json()["eval_count"] == 5
    for extreme in ({"presence_penalty": 2.5, "frequency_penalty": -9}, {"min_p": 1.5}, {"min_p": -1}):
        body = {"model": MODEL_NAME, "messages": MESSAGES, "stream": False, "options": {**GREEDY, **extreme}}
        assert server.http.post("/api/chat", json=body).status_code == 200, extreme
    unbounded = reference.greedy(reference.chat_prompt(MESSAGES), 40).text  # (-1 and -2 were taken before)
    body = {"model": MODEL_NAME, "messages": MESSAGES, "stream": False, "options": {"temperature": 0, "num_predict": 0}}
    assert server.http.post("/api/chat", json=body).json()["message"]["content"].startswith(unbounded)


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_equal_mlx_lms(client, reference, stream):
    expected = reference.greedy(reference.chat_prompt(MESSAGES), GREEDY["num_predict"])
    answer = client.chat(model=MODEL_NAME, messages=MESSAGES, options=GREEDY, logprobs=True, top_logprobs=3,
                         stream=stream)
    logprobs = [lp for part in answer for lp in part.logprobs or []] if stream else answer.logprobs
    assert len(logprobs) == len(expected.token_ids) - (expected.finish_reason == "stop")
    for item, token, token_logprobs in zip(logprobs, expected.token_ids, expected.logprobs):
        assert item.token == reference.decode([token]) and abs(item.logprob - float(token_logprobs[token])) < 1e-3
        values = np.array(token_logprobs.astype(mx.float32))
        top = np.argsort(-values)[:3]
        assert [t.token for t in item.top_logprobs] == [reference.token_text(int(i)) for i in top]
        assert np.allclose([t.logprob for t in item.top_logprobs], values[top], atol=1e-3)
    plain = client.chat(model=MODEL_NAME, messages=MESSAGES, options=GREEDY)
    assert plain.logprobs is None and plain.message.content == expected.text


def test_unknown_options_are_ignored_as_ollama_ignores_them(client, reference):
    expected = reference.greedy(reference.chat_prompt(MESSAGES), GREEDY["num_predict"]).text
    answer = client.chat(model=MODEL_NAME, messages=MESSAGES,
                         options={**GREEDY, "num_ctx": 8192, "num_thread": 4, "mirostat": 0})
    assert answer.message.content == expected


def test_the_api_is_behind_the_keys(tiny_model, tmp_path):
    with running(["serve", "--model", str(tiny_model), "--served-model-name", MODEL_NAME, "--api-key", "sk-o"],
                 tmp_path / "keys.log") as srv:
        response = srv.http.post("/api/chat", json={"model": MODEL_NAME, "messages": MESSAGES})
        assert response.status_code == 401 and list(response.json()) == ["error"]
        keyed = ollama.Client(host=srv.url, headers={"Authorization": "Bearer sk-o"})
        assert keyed.chat(model=MODEL_NAME, messages=MESSAGES, options=GREEDY).done


def test_a_line_separator_in_the_text_stays_inside_its_ndjson_line(tmp_path):
    """Ollama's client reads the stream with httpx's iter_lines, which ends a line at U+2028 too:
    written raw, the character cut a line's JSON in two and the client failed the whole answer."""
    model = make_scripted_model(tmp_path / "scripted", ["Line one\u2028line two.", " Done\x85."])
    with running(["serve", "--model", str(model), "--served-model-name", "scripted"], tmp_path / "serve.log") as srv:
        client = ollama.Client(host=srv.url)
        messages = [{"role": "user", "content": "Go"}]
        streamed = "".join(p.message.content for p in client.chat(model="scripted", messages=messages, stream=True))
        assert streamed == client.chat(model="scripted", messages=messages).message.content
        assert streamed == "Line one\u2028line two. Done\x85."
        generated = "".join(p.response for p in client.generate(model="scripted", prompt="Go", stream=True))
        assert generated == streamed

