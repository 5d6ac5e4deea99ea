"""The real embedded default model, SmolLM2-135M-Instruct, served with no --model."""

from __future__ import annotations

import openai
import pytest

from tests.conftest import running
from tests.reference import Reference
from worker.model_source import DEFAULT_MODEL_NAME, cache_dir

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    model_dir = cache_dir() / "models" / DEFAULT_MODEL_NAME
    # Tests never download: `make test` prepares the model first (`make model`).
    assert (model_dir / "config.json").exists(), f"{model_dir} is missing; run `make model`"
    with running(["serve"], tmp_path_factory.mktemp("default") / "serve.log") as srv:
        yield srv


def test_paris(default_server):
    client = openai.OpenAI(base_url=default_server.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [DEFAULT_MODEL_NAME]
    response = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=QUESTION, max_tokens=12, temperature=0
    )
    assert "Paris" in response.choices[0].message.content


def test_streamed_tokens_equal_mlx_lm(default_server):
    reference = Reference(cache_dir() / "models" / DEFAULT_MODEL_NAME)
    messages = [{"role": "user", "content": "Name three colours."}]
    expected = reference.greedy(reference.chat_prompt(messages), 10)
    client = openai.OpenAI(base_url=default_server.url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)
