"""The real embedded default model, SmolLM2-135M-Instruct, served with no --model."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

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
    assert client.models.retrieve(DEFAULT_MODEL_NAME).id == DEFAULT_MODEL_NAME
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-nothing")
    assert e.value.body["code"] == "model_not_found"
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


def test_the_readme_call_without_temperature_answers_sensibly(default_server):
    """No temperature: the model's recommended sampling (0.2, top_p 0.9), not
    the API's 1.0, at which this model says Paris about one time in four."""
    client = openai.OpenAI(base_url=default_server.url + "/v1", api_key="unused", max_retries=0)

    def answer(seed: int) -> str | None:
        return client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=QUESTION, max_tokens=32,
                                              seed=seed).choices[0].message.content

    with ThreadPoolExecutor(8) as pool:  # decoded as one batch: a quarter of the time they take one by one
        answers = list(pool.map(answer, range(8)))
    assert sum("Paris" in a for a in answers) >= 6, answers
    assert default_server.health()["worker"]["sampling_defaults"]["temperature"] == 0.2
