"""A request's journey from worker tokens to client text.

`RequestStream.render` runs on the event loop as the link receives each step
output; the resulting Delta goes to the queue of the request's
`RequestGroup` (one request, or `n` of them sampled from one prompt) on the
event loop, where an API handler turns Deltas into SSE events or one body.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

import msgspec

from gateway.parsing import ReasoningSplitter, ToolCall, ToolCallParser
from gateway.tokenizer import IncrementalDetokenizer, Tokenizer
from protocol import AddRequest, RequestOutput, Sampling, Tensor, TokenLogprob


@dataclass(slots=True)
class TokenInfo:
    """One generated token's text and log-probabilities, for an API's logprobs."""

    text: str
    logprob: float
    top: list[tuple[str, float]]


@dataclass(slots=True)
class Delta:
    text: str  # content
    index: int = 0  # which of the group's choices
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    # "stop" (EOS, stop token or stop string), "length", or "error"
    finish_reason: str | None = None
    stop_string: str | None = None  # the stop string that ended it, if one did
    logprobs: list[TokenInfo] = field(default_factory=list)
    error: str | None = None
    # The HTTP status an error maps to when no 200 has been sent yet.
    error_status: int = 500
    # True when a stop string ended the request and the worker, which knows
    # nothing of strings, must be told to abort it.
    abort_worker: bool = False


class StopMatcher:
    """Finds stop strings across token boundaries and never lets one out.

    Holds back the last len(longest stop) - 1 characters, which may be the
    start of a stop string still arriving.
    """

    def __init__(self, stops: list[str]) -> None:
        self._stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._pending = ""

    def feed(self, text: str, final: bool) -> tuple[str, str | None]:
        """(text safe to emit, the stop string hit or None)."""
        self._pending += text
        hits = [(i, s) for s in self._stops if (i := self._pending.find(s)) >= 0]
        if hits:
            at, stop = min(hits)
            out, self._pending = self._pending[:at], ""
            return out, stop
        if final or not self._hold:
            out, self._pending = self._pending, ""
        else:
            cut = max(len(self._pending) - self._hold, 0)
            out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, None


class RequestStream:
    def __init__(
        self,
        request_id: str,
        queue: asyncio.Queue[Delta],
        prompt: list[int],
        sampling: Sampling,
        tokenizer: Tokenizer,
        stop: list[str],
        index: int = 0,
        reasoning: ReasoningSplitter | None = None,
        tools: ToolCallParser | None = None,
        images: tuple[list[Tensor], list] = ([], []),
    ) -> None:
        self.request_id = request_id
        self.index = index
        self.prompt = prompt
        self.sampling = sampling
        # The image tensors the prompt's placeholders stand for, and their
        # arrays: kept until the request ends, since a resumed request needs them again.
        self.tensors, self.buffers = images
        # Every token the worker produced, so that a lost worker's requests
        # can continue on the next one from exactly where they were.
        self.generated: list[int] = []
        self.worker_losses = 0
        self.cached_tokens = 0  # prompt tokens the worker took from its prefix cache
        # The weights it runs on (Hello.model_digest): it resumes only on the same.
        self.model_digest = ""
        self.finished = False
        self.queue = queue  # its group's: where its Deltas go
        self._tokenizer = tokenizer
        self._reasoning = reasoning
        self._tools = tools
        self._detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=not (reasoning or tools))
        self._stops = StopMatcher(stop)
        self._rendered_final = False

    def render(self, output: RequestOutput) -> Delta | None:
        """The text this step adds. None once finished."""
        if self._rendered_final:
            return None
        token_ids = output.token_ids
        if output.cached_tokens is not None and not self.generated:
            self.cached_tokens = output.cached_tokens
        self.generated += token_ids
        if output.finish_reason == "stop":
            token_ids = token_ids[:-1]
        final = output.finish_reason is not None
        text = self._detokenizer.add(token_ids)
        if final:
            text += self._detokenizer.flush()
        text, stop = self._stops.feed(text, final)
        ended = final or stop is not None
        self._rendered_final = ended
        reasoning = ""
        if self._reasoning is not None:
            reasoning, text = self._reasoning.feed(text, ended)
        calls: list[ToolCall] = []
        if self._tools is not None:
            text, calls = self._tools.feed(text, ended)
        finish: str | None = "stop" if stop is not None else output.finish_reason
        if finish == "stop" and self._tools is not None and self._tools.calls:
            finish = "tool_calls"
        logprobs = self._token_infos(token_ids, output.logprobs) if output.logprobs else []
        return Delta(text, self.index, reasoning, calls, finish, stop, logprobs,
                     abort_worker=stop is not None and not final)

    def _token_infos(self, token_ids: list[int], logprobs: list[TokenLogprob]) -> list[TokenInfo]:
        decode = self._tokenizer.decode
        return [
            TokenInfo(decode([t]), lp.logprob, [(decode([a]), alp) for a, alp in zip(lp.top_ids, lp.top_logprobs)])
            for t, lp in zip(token_ids, logprobs)
        ]

    @property
    def completion_tokens(self) -> int:
        return len(self.generated)

    def add_request(self) -> AddRequest:
        """The request for a worker: the whole of it, or after a lost worker,
        the rest of it (the prompt followed by what was already generated)."""
        if not self.generated:
            return AddRequest(self.request_id, self.prompt, self.sampling, self.tensors)
        rest = msgspec.structs.replace(self.sampling, max_tokens=self.sampling.max_tokens - len(self.generated))
        return AddRequest(self.request_id, self.prompt + self.generated, rest, self.tensors)

    def fail(self, message: str, status: int) -> Delta:
        self._rendered_final = True
        return Delta("", self.index, finish_reason="error", error=message, error_status=status)


def _plain(delta: Delta) -> bool:
    """Text (or reasoning) only: safe to merge with the next one of its choice."""
    return delta.finish_reason is None and not delta.tool_calls


class RequestGroup:
    """The streams of one API request (n > 1 samples n of them), read as one."""

    def __init__(self, streams: list[RequestStream], queue: asyncio.Queue[Delta]) -> None:
        """`queue`: the one every stream of the group delivers to."""
        self.streams = streams
        self.queue = queue

    @property
    def prompt_tokens(self) -> int:
        return len(self.streams[0].prompt)

    @property
    def completion_tokens(self) -> int:
        return sum(s.completion_tokens for s in self.streams)

    @property
    def cached_tokens(self) -> int:
        return self.streams[0].cached_tokens

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.streams)

    async def deltas(self, deadline: float | None = None):
        """Every Delta of every stream until each has its final one.

        Text that piled up while the client was slower than the worker comes
        as one Delta: one event instead of many, less work per token just
        when the gateway is behind. Raises TimeoutError at `deadline`
        (event-loop time) if not finished.
        """
        loop = asyncio.get_running_loop()
        backlog: deque[Delta] = deque()
        while not self.finished:
            if backlog:
                delta = backlog.popleft()
            else:
                timeout = None if deadline is None else max(deadline - loop.time(), 0)
                delta = await asyncio.wait_for(self.queue.get(), timeout)
            while _plain(delta) and not self.queue.empty():
                waiting = self.queue.get_nowait()
                if waiting.index != delta.index or not _plain(waiting):
                    backlog.append(waiting)
                    break
                delta.text += waiting.text
                delta.reasoning += waiting.reasoning
                delta.logprobs += waiting.logprobs
            stream = self.streams[delta.index]
            if stream.finished:
                continue  # e.g. an error that crossed the final delta
            stream.finished = delta.finish_reason is not None
            yield delta
