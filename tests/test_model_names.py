"""Clients' own model names: --model-alias, and GET /v1/models/{name}."""

from __future__ import annotations

import subprocess

import anthropic
import openai
import pytest

from tests.conftest import MLXD, MODEL_NAME, ROOT, running

USER = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def aliased(tiny_model, tmp_path_factory):
    args = ["serve", "--model", str(tiny_model), "--served-model-name", MODEL_NAME, "--served-model-name", "tiny-too"]
    # From the environment, as a launchd plist carries them (the flag takes the same values).
    with running(args, tmp_path_factory.mktemp("alias") / "serve.log",
                 env={"MLXD_MODEL_ALIAS": f"claude-*={MODEL_NAME},gpt-4?*={MODEL_NAME}"}) as srv:
        yield srv


def test_an_alias_reaches_the_served_model_and_is_echoed(aliased, reference):
    client = openai.OpenAI(base_url=aliased.url + "/v1", api_key="unused", max_retries=0)
    expected = reference.greedy(reference.chat_prompt(USER), 6).text
    chat = client.chat.completions.create(model="gpt-4o", messages=USER, max_tokens=6, temperature=0)
    assert chat.model == "gpt-4o" and chat.choices[0].message.content == expected
    claude = anthropic.Anthropic(base_url=aliased.url, api_key="unused", max_retries=0)
    message = claude.messages.create(model="claude-mlxd-test", max_tokens=6, messages=USER,
                                     extra_body={"temperature": 0})
    assert message.model == "claude-mlxd-test" and message.content[0].text == expected


def test_names_no_alias_matches_are_404(aliased):
    client = openai.OpenAI(base_url=aliased.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gemini-pro", messages=USER, max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-3.5-turbo", messages=USER, max_tokens=2)  # gpt-4?* only


def test_a_name_in_another_case_reaches_its_model_as_in_ollama(aliased):
    """Ollama finds names in any case, and its apps and users capitalize them: "TINY" was a 404."""
    for name in (MODEL_NAME.upper(), MODEL_NAME.title() + ":Latest"):
        answer = aliased.http.post("/api/chat", json={"model": name, "messages": USER, "stream": False,
                                                      "options": {"num_predict": 2}})
        assert answer.status_code == 200, answer.text
    assert aliased.http.post("/v1/completions", json={"model": MODEL_NAME.upper(), "prompt": "Hi",
                                                      "max_tokens": 2}).status_code == 200


def test_models_lists_served_names_and_retrieves_aliases_too(aliased):
    client = openai.OpenAI(base_url=aliased.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL_NAME, "tiny-too"]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    assert client.models.retrieve("claude-opus-4").id == "claude-opus-4"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("llama")


def test_a_malformed_alias_is_refused_at_start():
    result = subprocess.run([*MLXD, "gateway", "--model-alias", "claude-*"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and "--model-alias" in result.stderr


def test_a_model_of_two_names_is_loaded_once_in_ollamas_ps(aliased):
    """Its memory was counted under each name."""
    assert aliased.http.post("/api/generate", json={"model": "tiny-too", "prompt": "Hi", "stream": False,
                                                    "options": {"num_predict": 1}}).status_code == 200
    assert [m["name"] for m in aliased.http.get("/api/ps").json()["models"]] == [MODEL_NAME + ":latest"]
    assert [m["name"] for m in aliased.http.get("/api/tags").json()["models"]] == [
        MODEL_NAME + ":latest", "tiny-too:latest"]
