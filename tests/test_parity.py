"""Greedy output through the whole HTTP stack equals mlx-lm in-process, token for token."""

from __future__ import annotations

import openai
import pytest

from tests.conftest import MODEL_NAME

CHATS = [
    [{"role": "user", "content": "Hello there"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Germany?"},
    ],
    [{"role": "user", "content": "héllo wörld 😀 漢字"}],
]
PROMPTS = ["Once upon a time", "The quick brown fox", "Numbers 0 1 2"]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def usage_matches(usage, prompt, expected) -> None:
    assert usage.prompt_tokens == len(prompt)
    assert usage.completion_tokens == len(expected.token_ids)
    assert usage.total_tokens == len(prompt) + len(expected.token_ids)


@pytest.mark.parametrize("messages", CHATS)
def test_chat_matches_mlx_lm(client, reference, messages):
    prompt = reference.chat_prompt(messages)
    expected = reference.greedy(prompt, MAX_TOKENS)
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    choice = response.choices[0]
    assert choice.message.content == expected.text
    assert choice.finish_reason == expected.finish_reason
    usage_matches(response.usage, prompt, expected)


@pytest.mark.parametrize("messages", CHATS)
def test_chat_stream_matches_mlx_lm(client, reference, messages):
    prompt = reference.chat_prompt(messages)
    expected = reference.greedy(prompt, MAX_TOKENS)
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text == expected.text
    assert finish == [expected.finish_reason]
    assert chunks[-1].choices == []
    usage_matches(chunks[-1].usage, prompt, expected)


@pytest.mark.parametrize("prompt_text", PROMPTS)
def test_completion_matches_mlx_lm(client, reference, prompt_text):
    prompt = reference.text_prompt(prompt_text)
    expected = reference.greedy(prompt, MAX_TOKENS)
    response = client.completions.create(
        model=MODEL_NAME, prompt=prompt_text, max_tokens=MAX_TOKENS, temperature=0
    )
    assert response.choices[0].text == expected.text
    assert response.choices[0].finish_reason == expected.finish_reason
    usage_matches(response.usage, prompt, expected)


@pytest.mark.parametrize("prompt_text", PROMPTS)
def test_completion_stream_matches_mlx_lm(client, reference, prompt_text):
    prompt = reference.text_prompt(prompt_text)
    expected = reference.greedy(prompt, MAX_TOKENS)
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=prompt_text,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    usage_matches(chunks[-1].usage, prompt, expected)


def test_completion_from_token_ids(client, reference):
    prompt = reference.text_prompt("The quick brown fox")
    expected = reference.greedy(prompt, MAX_TOKENS)
    response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert response.choices[0].text == expected.text


def test_a_null_prompt_starts_a_new_document(client, reference):
    # The spec's default: the tokenizer's start (BOS) here, or an end-of-text token for a model without one.
    start = reference.tokenizer.encode("") or [reference.tokenizer.eos_token_id]
    expected = reference.greedy(start, MAX_TOKENS)
    response = client.completions.create(model=MODEL_NAME, prompt=None, max_tokens=MAX_TOKENS, temperature=0)
    assert response.choices[0].text == expected.text and response.usage.prompt_tokens == len(start)


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
