"""The worker's prefix cache: shared prefixes are prefilled once, and a cache hit
never changes the output."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.conftest import MODEL_NAME, Server, wait_for

SYSTEM = " ".join(f"Rule {i}: be brief." for i in range(80))  # ~1000 tokens


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def ask(client, messages, max_tokens=16):
    return client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=max_tokens, temperature=0)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_shared_system_prompt_is_reused_and_output_unchanged(client, reference):
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]
    second = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "And of Germany?"}]
    cold = ask(client, first)
    warm = ask(client, second)
    shared = common_prefix(reference.chat_prompt(first), reference.chat_prompt(second))
    assert shared > 900
    assert warm.usage.prompt_tokens_details.cached_tokens >= shared - 1
    for messages, response in ((first, cold), (second, warm)):
        expected = reference.greedy(reference.chat_prompt(messages), 16)
        assert response.choices[0].message.content == expected.text


def test_repeated_prompt_and_multi_turn(client, reference):
    messages = [{"role": "user", "content": "Tell me about the lighthouse keeper, once more."}]
    one = ask(client, messages)
    again = ask(client, messages)
    prompt = reference.chat_prompt(messages)
    assert again.usage.prompt_tokens_details.cached_tokens == len(prompt) - 1
    assert again.choices[0].message.content == one.choices[0].message.content
    follow_up = messages + [{"role": "assistant", "content": one.choices[0].message.content},
                            {"role": "user", "content": "Go on."}]
    turn = ask(client, follow_up)
    assert turn.usage.prompt_tokens_details.cached_tokens >= len(prompt)
    assert turn.choices[0].message.content == reference.greedy(reference.chat_prompt(follow_up), 16).text


def test_cache_stats_in_health_and_anthropic_usage(server):
    before = server.health()["worker"].get("prefix_cache", {"hits": 0})["hits"]
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    body = dict(model=MODEL_NAME, max_tokens=4, messages=[{"role": "user", "content": "Cache me if you can"}])
    first = client.messages.create(**body)
    again = client.messages.create(**body)
    # Anthropic's semantics: input_tokens leaves out what was read from the cache.
    prompt_tokens = client.messages.count_tokens(model=MODEL_NAME, messages=body["messages"]).input_tokens
    assert first.usage.input_tokens + first.usage.cache_read_input_tokens == prompt_tokens
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == prompt_tokens
    with client.messages.stream(**body) as stream:
        streamed = stream.get_final_message().usage
    assert streamed.cache_read_input_tokens > 0
    assert streamed.input_tokens + streamed.cache_read_input_tokens == prompt_tokens
    # The next heartbeat has it.
    wait_for(lambda: server.health()["worker"]["prefix_cache"]["hits"] > before, 3, "the cache hits to show")
    stats = server.health()["worker"]["prefix_cache"]
    assert stats["bytes"] > 0 and stats["entries"] > 0


def test_cache_can_be_turned_off(tiny_model, tmp_path):
    server = Server(["serve", "--model", str(tiny_model), "--served-model-name", MODEL_NAME,
                     "--prefix-cache-bytes", "0"], tmp_path / "serve.log")
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "Hello again"}]
        ask(client, messages)
        assert ask(client, messages).usage.prompt_tokens_details.cached_tokens == 0
    finally:
        server.stop()


def test_each_api_key_has_a_cache_of_its_own_unless_shared(tiny_model, tmp_path, reference):
    """How much of a prompt the cache holds shows in cached_tokens (and in the
    time to the first token): a key must not learn what another key's
    prompts were by guessing at them. With --share-prefix-cache, they reuse
    each other's."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which rule is the third?"}]
    prompt = reference.chat_prompt(messages)
    for shared in (False, True):
        server = Server(["serve", "--model", str(tiny_model), "--served-model-name", MODEL_NAME,
                         "--api-key", "alice-key", "--api-key", "bob-key",
                         *(["--share-prefix-cache"] if shared else [])], tmp_path / f"serve-{shared}.log")
        try:
            server.wait_ready()
            alice, bob = (openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
                          for key in ("alice-key", "bob-key"))
            first = ask(alice, messages)
            assert ask(alice, messages).usage.prompt_tokens_details.cached_tokens == len(prompt) - 1
            guess = ask(bob, messages)
            assert guess.usage.prompt_tokens_details.cached_tokens == (len(prompt) - 1 if shared else 0)
            assert guess.choices[0].message.content == first.choices[0].message.content
        finally:
            server.stop()
