import asyncio
import time

import pytest

from gateway.output_processor import KEEPALIVE, Delta, OutputProcessor, RequestGroup, RequestState, RequestStatus
from gateway.tokenizer import Tokenizer
from protocol import RequestOutput, Sampling, StepOutput


@pytest.fixture(scope="module")
def tokenizer(tiny_model) -> Tokenizer:
    return Tokenizer({p.name: p.read_bytes() for p in tiny_model.iterdir() if p.suffix == ".json"})


WORKER = b"worker-1"


def stream(tokenizer: Tokenizer, request_id: str = "r1", stop: list[str] | None = None) -> RequestState:
    queue: asyncio.Queue[Delta] = asyncio.Queue()
    state = RequestState(request_id, queue, [1, 2], Sampling(max_tokens=100), tokenizer, stop or [])
    state.worker = WORKER  # running there
    return state


def drained(s: RequestState) -> list[Delta]:
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
    assert processor.process(step(RequestOutput("r1", ids[:2])), WORKER) == []
    assert processor.process(step(RequestOutput("r1", ids[2:], "length")), WORKER) == []
    deltas = drained(s)
    assert "".join(d.text for d in deltas) == "The quick brown fox"
    assert deltas[-1].finish_reason == "length" and len(processor) == 0
    assert s.status is RequestStatus.FINISHED


def test_a_stop_string_ends_the_request_and_asks_for_an_abort(tokenizer):
    processor = OutputProcessor()
    s = stream(tokenizer, stop=["brown"])
    processor.add(s)
    ids = tokenizer.encode_text("The quick brown fox jumps")
    assert processor.process(step(RequestOutput("r1", ids)), WORKER) == ["r1"]
    (delta,) = drained(s)
    assert delta.text == "The quick " and delta.stop_string == "brown" and delta.finish_reason == "stop"
    assert processor.get("r1") is None and s.status is RequestStatus.STOPPED


def test_outputs_for_unknown_or_ended_requests_reach_nobody_and_are_aborted_again(tokenizer):
    """The worker may not have heard the first Abort (sent while its tcp connection was down)."""
    processor = OutputProcessor()
    s = stream(tokenizer)
    processor.add(s)
    assert processor.process(step(RequestOutput("ghost", [5])), WORKER) == ["ghost"]
    assert processor.abort("r1") and s.status is RequestStatus.ABORTED
    assert processor.process(step(RequestOutput("r1", [5])), WORKER) == ["r1"] and drained(s) == []
    assert processor.process(step(RequestOutput("r1", [5], "length")), WORKER) == []  # it ended there too


def test_outputs_from_a_worker_the_request_moved_on_from_reach_nobody_and_are_aborted(tokenizer):
    """A worker given up on (unreachable) may come back still running a request that resumed elsewhere."""
    processor = OutputProcessor()
    s = stream(tokenizer)
    processor.add(s)
    assert processor.process(step(RequestOutput("r1", [5])), b"worker-0") == ["r1"]
    assert drained(s) == [] and processor.get("r1") is s
    assert processor.process(step(RequestOutput("r1", [5])), WORKER) == [] and len(drained(s)) == 1


def test_one_step_serves_every_request_in_it(tokenizer):
    processor = OutputProcessor()
    a, b = stream(tokenizer, "a"), stream(tokenizer, "b")
    processor.add(a)
    processor.add(b)
    ids = tokenizer.encode_text("Paris")
    processor.process(step(RequestOutput("a", ids, "length"), RequestOutput("b", ids)), WORKER)
    assert "".join(d.text for d in drained(a)) == "Paris" and len(processor) == 1
    assert [x.request_id for x in processor] == ["b"]


def test_fail_delivers_an_error_once(tokenizer):
    processor = OutputProcessor()
    s = stream(tokenizer)
    processor.add(s)
    assert processor.fail("r1", "the worker was lost", 503)
    assert not processor.fail("r1", "again", 503)
    (delta,) = drained(s)
    assert delta.finish_reason == "error" and delta.error_status == 503 and s.status is RequestStatus.FAILED


def group_of(tokenizer: Tokenizer, n: int) -> RequestGroup:
    queue: asyncio.Queue[Delta] = asyncio.Queue()
    return RequestGroup([RequestState(f"r{i}", queue, [1, 2], Sampling(max_tokens=9), tokenizer, [], i)
                         for i in range(n)], queue, time.monotonic())


async def read(group: RequestGroup, deadline: float | None = None) -> list[Delta]:
    return [d async for d in group.deltas(deadline)]


def test_a_group_merges_piled_up_text_and_ends_when_every_choice_has(tokenizer):
    group = group_of(tokenizer, 2)
    for delta in (Delta("a", 0), Delta("b", 0), Delta("x", 1), Delta("c", 0, finish_reason="stop"),
                  Delta("y", 1, finish_reason="length")):
        group.queue.put_nowait(delta)
    deltas = asyncio.run(read(group))
    assert [(d.index, d.text, d.finish_reason) for d in deltas] == [
        (0, "ab", None), (1, "x", None), (0, "c", "stop"), (1, "y", "length")]


def test_piled_up_reasoning_after_text_is_not_merged_before_it(tokenizer):
    group = group_of(tokenizer, 1)
    for delta in (Delta("", 0, reasoning="think "), Delta("answer", 0), Delta("", 0, reasoning="again"),
                  Delta("end", 0, finish_reason="stop")):
        group.queue.put_nowait(delta)
    deltas = asyncio.run(read(group))
    assert [(d.reasoning, d.text) for d in deltas] == [("think ", "answer"), ("again", ""), ("", "end")]


def test_nothing_of_a_choice_comes_after_its_final_delta(tokenizer):
    group = group_of(tokenizer, 2)
    group.queue.put_nowait(Delta("", 0, finish_reason="stop"))
    group.queue.put_nowait(Delta("", 0, finish_reason="error", error="late"))
    group.queue.put_nowait(Delta("", 1, finish_reason="stop"))
    assert [d.error for d in asyncio.run(read(group))] == [None, None]


def test_end_reaches_the_reader_even_after_a_choice_finished(tokenizer):
    group = group_of(tokenizer, 2)
    group.queue.put_nowait(Delta("", 0, finish_reason="stop"))

    async def ended() -> list[Delta]:  # on the event loop, as a cancel or the server's stop ends it
        group.end("the request was cancelled", 499)
        return await read(group)

    deltas = asyncio.run(ended())
    assert deltas[-1].error == "the request was cancelled" and deltas[-1].index == 1


def test_a_group_past_its_deadline_raises_timeout(tokenizer):
    group = group_of(tokenizer, 1)

    async def past_deadline() -> None:
        await read(group, asyncio.get_running_loop().time() + 0.01)

    with pytest.raises(TimeoutError):
        asyncio.run(past_deadline())


def test_the_deadline_stops_the_work_while_the_reader_is_held_elsewhere(tokenizer):
    """A reader held at a send to a client that stopped reading pulls nothing: the deadline stops the
    group's work itself (it only queued a marker the reader would see once it read again)."""
    group = group_of(tokenizer, 1)
    stopped: list[float] = []
    group.stop = lambda: stopped.append(time.monotonic())

    async def held_reader() -> None:
        group.queue.put_nowait(Delta("a", 0))
        deltas = group.deltas(asyncio.get_running_loop().time() + 0.05)
        assert (await anext(deltas)).text == "a"
        await asyncio.sleep(0.2)  # held: nothing pulls the next Delta
        assert len(stopped) == 1
        with pytest.raises(TimeoutError):
            await anext(deltas)

    asyncio.run(held_reader())


def test_a_cancel_that_lands_with_a_delta_still_ends_the_reader(tokenizer):
    """The client leaves just as the worker's next text arrives: the reader must
    end there (asyncio.wait_for on Python 3.11 returned the Delta instead, and
    the request ran on in the worker to its end)."""
    group = group_of(tokenizer, 1)

    async def cancelled_as_text_arrives() -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.create_task(read(group, loop.time() + 5))
        await asyncio.sleep(0)  # the reader now waits on the queue
        group.queue.put_nowait(Delta("text", 0))
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader

    asyncio.run(cancelled_as_text_arrives())


class BrokenParser:
    """A request whose output cannot be rendered (any fault in its parsing)."""

    def feed(self, text: str, final: bool):
        raise RuntimeError("cannot parse")


def test_a_request_that_cannot_be_rendered_costs_no_other_its_output(tokenizer):
    processor = OutputProcessor()
    broken = RequestState("broken", asyncio.Queue(), [1, 2], Sampling(max_tokens=100), tokenizer, [], 0, BrokenParser())
    broken.worker = WORKER
    fine = stream(tokenizer, "fine")
    processor.add(broken)
    processor.add(fine)
    ids = tokenizer.encode_text("The quick brown fox")
    assert processor.process(step(RequestOutput("broken", ids), RequestOutput("fine", ids)), WORKER) == ["broken"]
    assert "".join(d.text for d in drained(fine)) == "The quick brown fox"
    (error,) = drained(broken)
    assert error.finish_reason == "error" and error.error_status == 500
    assert processor.get("broken") is None and processor.get("fine") is fine


def test_keepalives_come_through_a_silence_and_stop_with_the_group(tokenizer):
    group = group_of(tokenizer, 1)

    async def silent_then_done() -> list[Delta]:
        loop = asyncio.get_running_loop()
        loop.call_later(0.45, group.queue.put_nowait, Delta("hi", 0))
        loop.call_later(0.47, group.queue.put_nowait, Delta("", 0, finish_reason="stop"))
        deltas = [d async for d in group.deltas(None, keepalive_s=0.1)]
        await asyncio.sleep(0.15)  # the timer is gone with the reader
        assert group.queue.empty()
        return deltas

    deltas = asyncio.run(silent_then_done())
    *silence, answer, end = deltas
    assert len(silence) >= 2 and all(d is KEEPALIVE for d in silence)  # about four: the loop may run late
    assert (answer.text, end.finish_reason) == ("hi", "stop") and KEEPALIVE.text == ""


def test_keepalives_come_only_when_the_writer_has_written_nothing_for_that_long(tokenizer):
    """Text written every 50 ms: no keep-alive at 100 ms. Then Deltas that write
    nothing (text a parser holds back): keep-alives come between them."""

    async def read_and_write(writes: bool) -> list[Delta]:
        group, loop = group_of(tokenizer, 1), asyncio.get_running_loop()
        for i in range(10):
            loop.call_later(0.05 * (i + 1), group.queue.put_nowait, Delta("x", 0))
        loop.call_later(0.55, group.queue.put_nowait, Delta("", 0, finish_reason="stop"))
        out = []
        async for delta in group.deltas(None, keepalive_s=0.1):
            out.append(delta)
            if writes:
                group.written_at = loop.time()
        return out

    flowing = asyncio.run(read_and_write(writes=True))
    assert not any(d is KEEPALIVE for d in flowing) and len(flowing) == 11
    held = asyncio.run(read_and_write(writes=False))
    assert sum(d is KEEPALIVE for d in held) >= 3  # about five: the loop may run late
