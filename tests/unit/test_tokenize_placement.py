"""Where a prompt is tokenized: a short one on the event loop (cheaper than
the hop to a thread), a long one in a thread (it would hold every stream)."""

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from gateway.errors import APIError
from gateway.serving import INLINE_TOKENIZE_BYTES, tokenize
from gateway.tokenizer import PromptError, Tokenizer


def thread_of(size: float) -> threading.Thread:
    return asyncio.run(tokenize(size, threading.current_thread))


def test_a_short_prompt_is_tokenized_on_the_event_loop():
    assert thread_of(INLINE_TOKENIZE_BYTES) is threading.main_thread()


@pytest.mark.parametrize("size", [INLINE_TOKENIZE_BYTES + 1, float("inf")])
def test_a_long_prompt_or_an_image_is_tokenized_in_a_thread(size):
    assert thread_of(size) is not threading.main_thread()


@pytest.mark.parametrize("size", [10, INLINE_TOKENIZE_BYTES * 2])
def test_a_prompt_error_is_the_clients_400_wherever_it_runs(size):
    def refuse() -> None:
        raise PromptError("the model's chat template rejected these messages")

    with pytest.raises(APIError) as raised:
        asyncio.run(tokenize(size, refuse, param="messages"))
    assert raised.value.status == 400 and raised.value.param == "messages"


@pytest.mark.parametrize("how", ["chat", "completion"])
def test_tokenizing_a_long_prompt_lets_the_event_loop_run(tiny_model, how):
    """A thread helps only if the tokenizer lets go of the GIL: tokenizers'
    plain `encode` holds it to the end, and the loop (every stream) with it."""
    tokenizer = Tokenizer({p.name: p.read_bytes() for p in tiny_model.iterdir() if p.suffix == ".json"})
    text = "the keeper of the lighthouse watched the sea " * 40_000  # about a second to tokenize here
    if how == "chat":
        work = lambda: tokenizer.chat_prompt([{"role": "user", "content": text}])  # noqa: E731
    else:
        work = lambda: tokenizer.encode_text(text)  # noqa: E731

    async def longest_gap() -> tuple[float, float]:
        started = time.monotonic()
        tokenizing = asyncio.ensure_future(tokenize(len(text), work))
        gaps, last = [], time.monotonic()
        while not tokenizing.done():
            await asyncio.sleep(0.001)
            gaps.append(time.monotonic() - last)
            last = time.monotonic()
        await tokenizing
        return max(gaps), time.monotonic() - started

    gap, took = asyncio.run(longest_gap())
    assert took > 0.2, "too short a prompt to tell"
    assert gap < took / 4, f"the loop stood still {gap * 1000:.0f} ms of the {took * 1000:.0f} ms tokenizing took"


def test_a_text_cut_to_a_limit_cuts_no_text_tokenized_meanwhile(tiny_model):
    """Embedding inputs are tokenized in threads, some cut to the context. Cut
    by transformers' truncation, a setting of the tokenizer every thread
    shares, a text tokenized meanwhile came back cut by another's limit, or
    one that asked for a limit uncut."""
    tokenizer = Tokenizer({p.name: p.read_bytes() for p in tiny_model.iterdir() if p.suffix == ".json"})
    text = "the keeper of the lighthouse watched the sea " * 50
    whole = tokenizer.encode_text(text)
    cut = tokenizer.encode_text(text, 64)
    assert len(whole) > 64 and cut == whole[:64]

    def work(worker: int) -> list[bool]:
        return [tokenizer.encode_text(text, 64 if (worker + i) % 2 else None) == (cut if (worker + i) % 2 else whole)
                for i in range(150)]

    with ThreadPoolExecutor(4) as pool:
        assert all(all(right) for right in pool.map(work, range(4)))
