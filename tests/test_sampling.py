"""OpenAI sampling parameters through the whole stack, against mlx-lm in-process."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import openai
import pytest
from mlx_lm.sample_utils import make_frequency_penalty, make_logits_processors, make_presence_penalty

from tests.conftest import MODEL_NAME

MESSAGES = [{"role": "user", "content": "Tell me a story"}]
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


EXTENSIONS = {"top_k", "min_p", "repetition_penalty", "ignore_eos"}  # not in the openai SDK's signature


def chat(client, **kwargs):
    extra = {k: kwargs.pop(k) for k in list(kwargs) if k in EXTENSIONS}
    return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, extra_body=extra or None, **kwargs)


def test_n_choices_greedy(client, reference):
    expected = reference.greedy(reference.chat_prompt(MESSAGES), 24)
    response = chat(client, n=3, max_tokens=24, temperature=0)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert all(c.message.content == expected.text for c in response.choices)
    assert response.usage.completion_tokens == 3 * len(expected.token_ids)
    assert response.usage.prompt_tokens == len(reference.chat_prompt(MESSAGES))


def test_n_choices_streamed(client):
    chunks = list(chat(client, n=2, max_tokens=16, temperature=1.0, seed=7, stream=True))
    texts = {0: "", 1: ""}
    finishes = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert set(finishes) == {0, 1}
    again = chat(client, n=2, max_tokens=16, temperature=1.0, seed=7)
    assert [c.message.content for c in again.choices] == [texts[0], texts[1]]
    assert texts[0] != texts[1]  # choice i samples with seed + i


def test_same_seed_concurrently_gives_the_same_text(client):
    results = [None] * 4

    def run(i: int) -> None:
        seed = 1234 if i < 2 else 99
        results[i] = chat(client, max_tokens=32, temperature=1.0, seed=seed, ignore_eos=True).choices[0].message.content

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[0] == results[1]
    assert results[2] == results[3]
    assert results[0] != results[2]


@pytest.mark.parametrize("params", [{"top_k": 1}, {"min_p": 1.0}, {"top_p": 0.001}, {"top_p": 0}])
def test_filters_that_leave_one_token_are_greedy(client, reference, params):
    expected = reference.greedy(reference.chat_prompt(MESSAGES), 20)
    text = chat(client, max_tokens=20, temperature=1.5, seed=3, **params).choices[0].message.content
    assert text == expected.text


def test_top_k_of_the_whole_vocabulary_filters_nothing(client, reference):
    """Found by the fuzzer: top_k equal to the vocabulary size was a 500."""
    vocab = reference.model.args.vocab_size
    texts = [
        chat(client, max_tokens=16, temperature=1.0, seed=5, ignore_eos=True, top_k=k).choices[0].message.content
        for k in (0, vocab, 10**6)
    ]
    assert texts[0] == texts[1] == texts[2]


@pytest.mark.parametrize(
    "params",
    [
        {"presence_penalty": 2.0},
        {"frequency_penalty": 1.0},
        {"repetition_penalty": 1.8},
        {"logit_bias": {"42": 12.0, "7": -100}},
    ],
    ids=lambda p: next(iter(p)),
)
def test_penalties_and_bias_match_mlx_lm(client, reference, server, params):
    context = server.health()["worker"]["context_length"]
    bias = {int(k): v for k, v in params.get("logit_bias", {}).items()}
    # mlx-lm's processors; presence and frequency over the completion only, as OpenAI defines them
    # (mlx-lm's look back over the prompt too).
    processors = make_logits_processors(
        logit_bias=bias or None,
        repetition_penalty=params.get("repetition_penalty"), repetition_context_size=context,
    )
    completion_penalties = [make(params[key], context) for key, make in (
        ("presence_penalty", make_presence_penalty), ("frequency_penalty", make_frequency_penalty)) if key in params]
    # A conversation whose greedy output the parameter changes (on a random
    # model its effect depends on the margins between logits).
    for i in range(20):
        messages = [{"role": "user", "content": f"Story number {i}"}]
        prompt = reference.chat_prompt(messages)
        over_completion = [lambda tokens, logits, p=p, n=len(prompt): p(tokens[n:], logits) for p in completion_penalties]
        expected = reference.greedy(prompt, 32, processors=processors + over_completion)
        if expected.text != reference.greedy(prompt, 32).text:
            break
    else:
        raise AssertionError(f"{params} changed none of the outputs")
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=32, temperature=0,
        **{k: v for k, v in params.items() if k not in EXTENSIONS},
        extra_body={k: v for k, v in params.items() if k in EXTENSIONS} or None,
    )
    assert response.choices[0].message.content == expected.text


def top_k(logprobs: mx.array, k: int) -> list[tuple[int, float]]:
    values = np.array(logprobs.astype(mx.float32))
    return [(int(i), float(values[i])) for i in np.argsort(-values)[:k]]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_match_mlx_lm(client, reference, stream):
    expected = reference.greedy(reference.chat_prompt(MESSAGES), 12)
    kwargs = dict(max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
    if stream:
        content = [lp for c in chat(client, stream=True, **kwargs) if c.choices and c.choices[0].logprobs
                   for lp in c.choices[0].logprobs.content]
    else:
        content = chat(client, **kwargs).choices[0].logprobs.content
    assert len(content) == len(expected.token_ids) - (expected.finish_reason == "stop")
    for item, token, logprobs in zip(content, expected.token_ids, expected.logprobs):
        assert item.token == reference.decode([token])
        assert abs(item.logprob - float(logprobs[token])) < 1e-3
        top = top_k(logprobs, 3)
        assert [t.token for t in item.top_logprobs] == [reference.token_text(i) for i, _ in top]
        assert np.allclose([t.logprob for t in item.top_logprobs], [lp for _, lp in top], atol=1e-3)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_match_mlx_lm(client, reference, stream):
    prompt = reference.text_prompt(PROMPT)
    expected = reference.greedy(prompt, 10, ignore_eos=True)
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    if stream:
        choices = [c.choices[0] for c in client.completions.create(stream=True, **kwargs) if c.choices]
        text = "".join(c.text for c in choices)
        parts = [c.logprobs for c in choices if c.logprobs]
        token_logprobs = [lp for p in parts for lp in p.token_logprobs]
        tokens = [t for p in parts for t in p.tokens]
        offsets = [o for p in parts for o in p.text_offset]
    else:
        choice = client.completions.create(**kwargs).choices[0]
        text, logprobs = choice.text, choice.logprobs
        token_logprobs, tokens, offsets = logprobs.token_logprobs, logprobs.tokens, logprobs.text_offset
        assert len(logprobs.top_logprobs) == len(tokens)
    assert tokens == [reference.decode([t]) for t in expected.token_ids]
    # Where each token's text begins in the choice's text, across a stream's chunks too (the random
    # model's tokens hold parts of characters: one such begins where its character does, in the text).
    assert offsets == sorted(offsets) and offsets[-1] < len(text)
    for token, offset in zip(tokens, offsets):
        assert "\ufffd" in token or text[offset:offset + len(token)] == token
    for logprob, token, reference_logprobs in zip(token_logprobs, expected.token_ids, expected.logprobs):
        assert abs(logprob - float(reference_logprobs[token])) < 1e-3
