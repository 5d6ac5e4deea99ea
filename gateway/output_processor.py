"""Every request's output side: its state, and per worker step its tokens
turned into Deltas (detokenize, stop strings, reasoning and tool calls)
delivered to the queue its API handler reads.

The processor sends nothing: `process` returns the requests the worker must
be told to abort (a stop string ended them, which the worker cannot see), and
the link sends that. So the whole output path is testable without a socket.

Runs on the event loop: a step's worth of detokenizing (tens of microseconds a
request) costs less there than the hop to a thread and back, which the GIL
would serialize anyway (measured: 8-14% less gateway CPU per token).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

import msgspec

from gateway.parsing import StopMatcher, StreamParser, ToolCall
from gateway.tokenizer import IncrementalDetokenizer, Tokenizer
from protocol import AddRequest, RequestOutput, Sampling, StepOutput, Tensor, TokenLogprob

log = logging.getLogger("mlxd.gateway")


@dataclass(slots=True)
class TokenInfo:
    """One generated token's text and log-probabilities, for an API's logprobs."""

    text: str
    raw: bytes  # the token's own bytes (its text may read U+FFFD for part of a character)
    logprob: float
    top: list[tuple[str, bytes, float]]  # the likeliest tokens: text, bytes, logprob
    # The characters of text its step released (0 while the detokenizer holds its text back for the next
    # token's): its logprobs go out once the stop strings' matcher has released those too.
    chars: int = 0


@dataclass(slots=True)
class Delta:
    text: str  # content
    index: int = 0  # which of the group's choices
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    # "stop" (EOS, stop token or stop string), "length", "tool_calls", or "error"
    finish_reason: str | None = None
    stop_string: str | None = None  # the stop string that ended it, if one did
    logprobs: list[TokenInfo] = field(default_factory=list)
    error: str | None = None
    # The HTTP status an error maps to when no 200 has been sent yet.
    error_status: int = 500


class RequestStatus(enum.Enum):
    RUNNING = "running"  # in the worker, or waiting for the next one to resume on
    FINISHED = "finished"  # the worker ended it (EOS, stop token, length)
    STOPPED = "stopped"  # a stop string ended it here; the worker is told to drop it
    FAILED = "failed"  # ended with an error its client sees
    ABORTED = "aborted"  # its client is done with it before its end; the worker is told to drop it


class RequestState:
    """One request (one choice of an API request) from submission to its end."""

    def __init__(
        self,
        request_id: str,
        queue: asyncio.Queue[Delta],
        prompt: list[int],
        sampling: Sampling,
        tokenizer: Tokenizer,
        stop: list[str],
        index: int = 0,
        parser: StreamParser | None = None,
        images: tuple[list[Tensor], list, int] = ([], [], 0),
        cache_scope: str = "",
    ) -> None:
        self.request_id = request_id
        self.index = index
        self.prompt = prompt
        self.sampling = sampling
        self.status = RequestStatus.RUNNING
        # The image tensors the prompt's placeholders stand for, and their
        # arrays: kept until the request ends, since a resumed request needs them again.
        self.tensors, self.buffers, self.images_key = images
        self.cache_scope = cache_scope  # AddRequest.cache_scope
        # Every token the worker produced, so that a lost worker's requests
        # can continue on the next one from exactly where they were.
        self.generated: list[int] = []
        self.worker_losses = 0
        self.worker: bytes | None = None  # the identity of the worker running it (gateway/worker_link.py)
        self.sends = 0  # AddRequests made of it: each send after the first is an attempt of its own (wire_id)
        self.cached_tokens = 0  # prompt tokens the worker took from its prefix cache
        self.reasoning_tokens = 0  # generated inside the reasoning block, its markers included
        self._held_tokens = 0  # of the latest steps the parser held back whole (counted once it is known what they are)
        self._held_logprobs: list[TokenInfo] = []  # theirs: the content's only if they turn out to be text
        # Tokens whose text the stop strings' matcher still holds, and what it released of the first's:
        # a token's logprobs go out with its text, and none of a stop string's.
        self._unreleased: list[TokenInfo] = []
        self._released_chars = 0
        self.first_token_at: float | None = None  # time.monotonic() of its first token (Ollama's durations)
        # The weights it runs on (Hello.model_digest): it resumes only on the same.
        self.model_digest = ""
        self.model_names: list[str] = []  # the names its worker serves (for resuming on the same model)
        self.queue = queue  # shared by the streams of one API request: their RequestGroup reads it
        self._tokenizer = tokenizer
        self._parser = parser
        # Parsers look for markers, which may be special tokens.
        self._detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=parser is None)
        self._stops = StopMatcher(stop)

    @property
    def running(self) -> bool:
        return self.status is RequestStatus.RUNNING

    def render(self, output: RequestOutput) -> list[Delta]:
        """What this step adds: one Delta, or more where text came after a
        call in the last step (each in its order); the final Delta sets the status."""
        token_ids = output.token_ids
        if not self.generated:
            self.first_token_at = time.monotonic()
            if output.cached_tokens is not None:
                self.cached_tokens = output.cached_tokens
        self.generated += token_ids
        if output.finish_reason == "stop":
            token_ids = token_ids[:-1]
        final = output.finish_reason is not None
        # With logprobs, token by token: what text each completes.
        pieces = [self._detokenizer.add([t]) for t in token_ids] if output.logprobs else []
        text = "".join(pieces) if output.logprobs else self._detokenizer.add(token_ids)
        if final:
            flushed = self._detokenizer.flush()
            text += flushed
            if pieces:
                pieces[-1] += flushed
        text, stop = self._stops.feed(text, final)
        ended = final or stop is not None
        if ended:
            self.status = RequestStatus.STOPPED if stop is not None and not final else RequestStatus.FINISHED
        reasoning = ""
        calls: list[ToolCall] = []
        # OpenAI's logprobs are the message content's: not the reasoning's, nor a tool call's markup.
        logprobs = self._released(self._token_infos(token_ids, output.logprobs, pieces), len(text), ended) \
            if output.logprobs else []
        if self._parser is not None:
            thinking = self._parser.reasoning
            reasoning, text, calls = self._parser.feed(text, ended)
            if thinking or self._parser.reasoning:  # the step's tokens opened, continued or closed the block
                self.reasoning_tokens += len(output.token_ids) + self._held_tokens
                self._held_tokens, self._held_logprobs, logprobs = 0, [], []
            elif reasoning or text or calls:  # what was held turned out text, or markup (a call, a header)
                # The held tokens were text if the text released starts with theirs (a marker's start after all).
                held = self._held_logprobs if text.startswith("".join(i.text for i in self._held_logprobs)) else []
                logprobs = held + logprobs if text and not (reasoning or calls) else []
                self._held_tokens, self._held_logprobs = 0, []
            else:  # held back by the parser: perhaps the first tokens of an opening marker
                self._held_tokens += len(output.token_ids)
                self._held_logprobs, logprobs = self._held_logprobs + logprobs, []
        finish: str | None = "stop" if stop is not None else output.finish_reason
        if finish == "stop" and self._parser is not None and self._parser.calls:
            finish = "tool_calls"
        if not ended or self._parser is None or not self._parser.holds_text:
            return [Delta(text, self.index, reasoning, calls, finish, stop, logprobs)]
        deltas = [Delta(text, self.index, reasoning, calls, logprobs=logprobs)]
        while self._parser.holds_text:  # the text after a call (and any calls after that), each after the last
            _, text, calls = self._parser.feed("", True)
            deltas.append(Delta(text, self.index, tool_calls=calls))
        deltas[-1].finish_reason, deltas[-1].stop_string = finish, stop
        return deltas

    def _token_infos(self, token_ids: list[int], logprobs: list[TokenLogprob], pieces: list[str]) -> list[TokenInfo]:
        text, raw = self._tokenizer.token_text, self._tokenizer.token_bytes
        return [
            TokenInfo(text(t), raw(t), lp.logprob,
                      [(text(a), raw(a), alp) for a, alp in zip(lp.top_ids, lp.top_logprobs)], len(piece))
            for t, lp, piece in zip(token_ids, logprobs, pieces)
        ]

    def _released(self, infos: list[TokenInfo], released_chars: int, ended: bool) -> list[TokenInfo]:
        """The tokens whose text the stop strings' matcher has now released
        whole (`released_chars` more characters); at the end, none of those
        it never released (a stop string's, and what came after it)."""
        self._unreleased += infos
        self._released_chars += released_chars
        out = []
        while self._unreleased and self._unreleased[0].chars <= self._released_chars:
            self._released_chars -= self._unreleased[0].chars
            out.append(self._unreleased.pop(0))
        if ended:
            self._unreleased, self._released_chars = [], 0
        return out

    @property
    def wire_id(self) -> str:
        """Its id in the worker: the request's, with the attempt after the first
        (`id@1`...), so that what an earlier attempt still sends reaches nobody
        (a request taken back from a worker may resume on that same worker)."""
        return self.request_id if self.sends <= 1 else f"{self.request_id}@{self.sends - 1}"

    def add_request(self) -> AddRequest:
        """The request for a worker, as a new attempt: the whole of it, or after a
        lost worker, the rest of it (the prompt followed by what was already generated)."""
        self.sends += 1
        if not self.generated:
            return AddRequest(self.wire_id, self.prompt, self.sampling, self.tensors, images_key=self.images_key,
                              cache_scope=self.cache_scope)
        rest = msgspec.structs.replace(self.sampling, max_tokens=self.sampling.max_tokens - len(self.generated))
        return AddRequest(self.wire_id, self.prompt + self.generated, rest, self.tensors, len(self.generated),
                          self.images_key, self.cache_scope)

    def fail(self, message: str, status: int) -> Delta:
        self.status = RequestStatus.FAILED
        return Delta("", self.index, finish_reason="error", error=message, error_status=status)


class OutputProcessor:
    """The running requests, by id: each is here from submission until its status leaves RUNNING."""

    def __init__(self) -> None:
        self._requests: dict[str, RequestState] = {}
        self.tokens_generated = 0  # by every request delivered here, ever (the ops page's throughput)

    def add(self, state: RequestState) -> None:
        self._requests[state.request_id] = state

    def get(self, request_id: str) -> RequestState | None:
        return self._requests.get(request_id)

    def of_wire(self, wire_id: str) -> RequestState | None:
        """The running request a worker's id names, if that is its latest attempt."""
        state = self._requests.get(wire_id.partition("@")[0])
        return state if state is not None and state.wire_id == wire_id else None

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[RequestState]:
        """The running requests (a copy: ending one while iterating is fine)."""
        return iter(list(self._requests.values()))

    def process(self, step: StepOutput, sender: bytes) -> list[str]:
        """Deliver one worker step's outputs; return the ids to abort in the worker:
        those that met a stop string, failed to render, or ended here before."""
        aborts = []
        for output in step.outputs:
            state = self.of_wire(output.request_id)
            if state is None or state.worker != sender:
                # Ended here already (aborted, failed), or moved on to another worker:
                # told again, for the worker may not have heard (an Abort sent while
                # its tcp connection was down, or none at all to a worker given up on).
                if output.finish_reason is None:
                    aborts.append(output.request_id)
                continue
            self.tokens_generated += len(output.token_ids)
            try:
                deltas = state.render(output)
            except Exception:  # one request's rendering must not cost the others in this step their outputs
                log.exception("rendering the output of request %s failed", state.request_id)
                self.fail(state.request_id, "the server could not render this request's output", 500)
                aborts.append(output.request_id)
                continue
            for delta in deltas:
                state.queue.put_nowait(delta)
            if not state.running:
                del self._requests[state.request_id]
                if state.status is RequestStatus.STOPPED:
                    aborts.append(output.request_id)
        return aborts

    def abort(self, request_id: str) -> bool:
        """Its client is done with it (no word to the client); True if it was running."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return False
        state.status = RequestStatus.ABORTED
        return True

    def fail(self, request_id: str, message: str, status: int) -> bool:
        """End a running request with an error its client sees; True if it was running."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return False
        state.queue.put_nowait(state.fail(message, status))
        return True


# What a group's deadline puts in its queue (never merged: it has a finish reason).
_TIMED_OUT = Delta("", -1, finish_reason="timeout")
# What a group's keep-alive timer puts in its queue, and its reader passes on as it is.
KEEPALIVE = Delta("", -1)
# How long a stream ended from outside (a timeout, a cancel, the server
# stopping) waits for its writer to take the error queued for it. A writer
# held at a send to a client that reads no more never does; past this, its
# response is cut, which gives back its slot among the requests in flight.
STUCK_WRITER_S = 5.0


def _plain(delta: Delta) -> bool:
    """Text (or reasoning) only: safe to merge with the next one of its choice."""
    return delta.finish_reason is None and not delta.tool_calls


class RequestGroup:
    """The requests of one API request (n > 1 samples n of them), read as one."""

    def __init__(self, states: list[RequestState], queue: asyncio.Queue[Delta], ready_at: float) -> None:
        """`queue`: the one every request of the group delivers to; `ready_at`:
        time.monotonic() once a worker of its model was ready (Ollama's load time ends there)."""
        self.states = states
        self.queue = queue
        self.ready_at = ready_at
        # Ends its work at once, whether its reader reads or not (a client that stops reading holds the
        # reader at a send): its server's, which aborts it in the worker and gives its lease back.
        self.stop: Callable[[], None] = lambda: None
        # Cuts its response off (a stream's: EventStream.cut), for a writer stuck at a send.
        self.cut: Callable[[], None] = lambda: None
        # When its stream last wrote to the client (event-loop time): a Delta may write nothing (text a
        # parser holds back, omitted reasoning), so the keep-alive timer asks the writer.
        self.written_at = 0.0

    @property
    def prompt_tokens(self) -> int:
        return len(self.states[0].prompt)

    @property
    def completion_tokens(self) -> int:
        return sum(len(s.generated) for s in self.states)

    @property
    def cached_tokens(self) -> int:
        return self.states[0].cached_tokens

    @property
    def reasoning_tokens(self) -> int:
        return sum(s.reasoning_tokens for s in self.states)

    @property
    def first_token_at(self) -> float | None:
        return min((s.first_token_at for s in self.states if s.first_token_at is not None), default=None)

    def end(self, message: str, status: int) -> None:
        """Make the reader's next Delta an error that ends the group (cancel,
        shutdown): one for every choice, so that one still open gets it."""
        for state in self.states:
            self.queue.put_nowait(Delta("", state.index, finish_reason="error", error=message, error_status=status))
        self._stop_from_outside()

    def _time_out(self) -> None:
        self.queue.put_nowait(_TIMED_OUT)
        self._stop_from_outside()

    def _stop_from_outside(self) -> None:
        self.stop()
        asyncio.get_running_loop().call_later(STUCK_WRITER_S, self.cut)

    async def deltas(self, deadline: float | None = None, keepalive_s: float | None = None) -> AsyncIterator[Delta]:
        """Every Delta of every request until each has its final one.

        Text that piled up while the client was slower than the worker comes
        as one Delta: one event instead of many, less work per token just
        when the gateway is behind. Raises TimeoutError at `deadline`
        (event-loop time) if not finished. With `keepalive_s`, KEEPALIVE
        comes once the stream has written nothing that long (its writer sets
        `written_at`), for it to show its client that it lives through a
        long prefill, hidden reasoning or a tool call's arguments held back.
        """
        # One timer for the whole request rather than a timeout around every
        # wait: entering asyncio.timeout for each token was 6-8% of the
        # gateway's CPU at 32 streams (docs/benchmarks.md, issue 18).
        loop = asyncio.get_running_loop()
        timer = loop.call_at(deadline, self._time_out) if deadline is not None else None
        pinger: asyncio.TimerHandle | None = None
        self.written_at = loop.time()

        # Not moved at every write (a timer handle per token): it looks at written_at when it fires.
        def keep_alive(every_s: float) -> None:
            nonlocal pinger
            quiet_s = loop.time() - self.written_at
            if quiet_s >= every_s:
                self.queue.put_nowait(KEEPALIVE)
                quiet_s = 0.0
            pinger = loop.call_later(every_s - quiet_s, keep_alive, every_s)

        if keepalive_s is not None:
            pinger = loop.call_later(keepalive_s, keep_alive, keepalive_s)
        backlog: deque[Delta] = deque()
        open_choices = set(range(len(self.states)))
        try:
            while open_choices:
                delta = backlog.popleft() if backlog else await self.queue.get()
                if delta is _TIMED_OUT:
                    raise TimeoutError
                if delta is KEEPALIVE:
                    if keepalive_s is not None and loop.time() - self.written_at >= keepalive_s:
                        yield delta  # else one more that piled up while the writer was held at a send
                    continue
                while _plain(delta) and not self.queue.empty():
                    waiting = self.queue.get_nowait()
                    # Reasoning after text stays apart: merged, it would read as coming first.
                    if waiting.index != delta.index or not _plain(waiting) or delta.text and waiting.reasoning:
                        backlog.append(waiting)
                        break
                    delta.text += waiting.text
                    delta.reasoning += waiting.reasoning
                    delta.logprobs += waiting.logprobs
                if delta.index not in open_choices:
                    continue  # e.g. an error that crossed the final delta
                if delta.finish_reason is not None:
                    open_choices.discard(delta.index)
                yield delta
        finally:
            for handle in (timer, pinger):
                if handle is not None:
                    handle.cancel()
