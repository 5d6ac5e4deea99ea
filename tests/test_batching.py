"""Concurrent requests decode together, and each still gets its own greedy output."""

from __future__ import annotations

import json
import threading
import time

import httpx

from tests.conftest import MODEL_NAME, wait_for

TOKENS = 256  # enough to outlast the streams' staggered starts


def stream_completion(url: str, prompt: str, max_tokens: int, **fields) -> tuple[str, list[float]]:
    """(text, arrival time of each chunk) of one streaming completion; `fields` join its body."""
    text, times = [], []
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            **fields}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0]["text"]:
                    text.append(choices[0]["text"])
                    times.append(time.monotonic())
    return "".join(text), times


def test_eight_streams_decode_together(server):
    # Every stream runs its whole length (a stream ending early at EOS
    # would not overlap one that started a few steps late).
    prompts = [f"Once upon a time {i}" for i in range(8)]
    alone = [stream_completion(server.url, p, TOKENS, ignore_eos=True)[0] for p in prompts]

    results: list = [None] * len(prompts)
    barrier = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        barrier.wait()
        results[i] = stream_completion(server.url, prompts[i], TOKENS, ignore_eos=True)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert [text for text, _ in results] == alone
    # Decoded together: every stream's first chunk arrived before any stream's last.
    firsts = [times[0] for _, times in results]
    lasts = [times[-1] for _, times in results]
    assert max(firsts) < min(lasts)


def test_requests_joining_a_busy_batch_answer_as_alone(server, reference):
    """A request joins the running batch with its last prompt token still to
    compute, in the batch's next step (worker/joins.py): that token is neither
    an output, nor counted against max_tokens, nor matched as a stop."""
    eos = reference.tokenizer.eos_token_ids
    prompt = reference.text_prompt("The lighthouse keeper said")
    cases = [(prompt + [sorted(eos)[0]], 8), (prompt, 1)]  # a prompt ending in the stop token; one token
    expected = [reference.greedy(prompt_ids, max_tokens) for prompt_ids, max_tokens in cases]
    busy = threading.Thread(target=stream_completion, args=(server.url, "Once upon a time", 1500),
                            kwargs={"ignore_eos": True})
    busy.start()
    wait_for(lambda: server.health()["worker"]["running"] >= 1, 10, "the long stream to be running")
    for (prompt_ids, max_tokens), want in zip(cases, expected):
        body = {"model": MODEL_NAME, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0}
        answer = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        assert answer["choices"][0]["text"] == want.text
        assert answer["choices"][0]["finish_reason"] == want.finish_reason
        assert answer["usage"]["completion_tokens"] == len(want.token_ids)
    # The worker's running count comes with its heartbeat and may still hold a finished request.
    assert busy.is_alive(), "the answers came while the long stream still ran"
    busy.join(60)
