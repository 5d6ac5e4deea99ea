import asyncio

import pytest

from gateway.generation import Delta, RequestStream
from gateway.output_processor import OutputProcessor
from gateway.tokenizer import Tokenizer
from protocol import RequestOutput, Sampling, StepOutput


@pytest.fixture(scope="module")
def tokenizer(tiny_model) -> Tokenizer:
    return Tokenizer({p.name: p.read_bytes() for p in tiny_model.iterdir() if p.suffix == ".json"})


def stream(tokenizer: Tokenizer, request_id: str = "r1", stop: list[str] | None = None) -> RequestStream:
    queue: asyncio.Queue[Delta] = asyncio.Queue()
    return RequestStream(request_id, queue, [1, 2], Sampling(max_tokens=100), tokenizer, stop or [])


def drained(s: RequestStream) -> list[Delta]:
    out = []
    while not s.queue.empty():
        out.append(s.queue.get_nowait())
    return out


def step(*outputs: RequestOutput) -> StepOutput:
    return StepOutput(1, list(outputs))


def test_tokens_become_text_and_the_end_forgets_the_request(tokenizer):
    processor = OutputProcessor()
    s = stream(tokenizer)
    processor.add(s)
    ids = tokenizer.encode_text("The quick brown fox")
    assert processor.process(step(RequestOutput("r1", ids[:2]))) == []
    assert processor.process(step(RequestOutput("r1", ids[2:], "length"))) == []
    deltas = drained(s)
    assert "".join(d.text for d in deltas) == "The quick brown fox"
    assert deltas[-1].finish_reason == "length" and len(processor) == 0


def test_a_stop_string_ends_the_request_and_asks_for_an_abort(tokenizer):
    processor = OutputProcessor()
    s = stream(tokenizer, stop=["brown"])
    processor.add(s)
    ids = tokenizer.encode_text("The quick brown fox jumps")
    assert processor.process(step(RequestOutput("r1", ids))) == ["r1"]
    (delta,) = drained(s)
    assert delta.text == "The quick " and delta.stop_string == "brown" and delta.finish_reason == "stop"
    assert processor.get("r1") is None


def test_outputs_for_unknown_or_finished_requests_are_ignored(tokenizer):
    processor = OutputProcessor()
    s = stream(tokenizer)
    processor.add(s)
    assert processor.process(step(RequestOutput("ghost", [5]))) == []
    processor.forget("r1")
    assert processor.process(step(RequestOutput("r1", [5]))) == [] and drained(s) == []


def test_one_step_serves_every_request_in_it(tokenizer):
    processor = OutputProcessor()
    a, b = stream(tokenizer, "a"), stream(tokenizer, "b")
    processor.add(a)
    processor.add(b)
    ids = tokenizer.encode_text("Paris")
    processor.process(step(RequestOutput("a", ids, "length"), RequestOutput("b", ids)))
    assert "".join(d.text for d in drained(a)) == "Paris" and len(processor) == 1
    assert [x.request_id for x in processor] == ["b"]


def test_fail_delivers_an_error_once(tokenizer):
    processor = OutputProcessor()
    s = stream(tokenizer)
    processor.add(s)
    assert processor.fail("r1", "the worker was lost", 503)
    assert not processor.fail("r1", "again", 503)
    (delta,) = drained(s)
    assert delta.finish_reason == "error" and delta.error_status == 503
