"""Where a prompt is tokenized: a short one on the event loop (cheaper than
the hop to a thread), a long one in a thread (it would hold every stream)."""

import asyncio
import threading

import pytest

from gateway.errors import APIError
from gateway.serving import INLINE_TOKENIZE_BYTES, tokenize
from gateway.tokenizer import PromptError


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
