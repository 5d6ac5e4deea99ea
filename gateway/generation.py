"""One request's journey from worker tokens to client text.

`render` runs on the link's detokenizer thread, once per step output; the
resulting Delta is handed to the request's queue on the event loop, where the
HTTP handler turns it into SSE chunks or one JSON body.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import msgspec

from gateway.tokenizer import IncrementalDetokenizer, Tokenizer
from protocol import AddRequest, RequestOutput, Sampling


@dataclass(slots=True)
class Delta:
    text: str
    # "stop" (EOS, stop token or stop string), "length", or "error"
    finish_reason: str | None = None
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

    def feed(self, text: str, final: bool) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was hit)."""
        self._pending += text
        hits = [i for i in (self._pending.find(s) for s in self._stops) if i >= 0]
        if hits:
            out, self._pending = self._pending[: min(hits)], ""
            return out, True
        if final or not self._hold:
            out, self._pending = self._pending, ""
        else:
            cut = max(len(self._pending) - self._hold, 0)
            out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, False


class RequestStream:
    def __init__(
        self, request_id: str, prompt: list[int], sampling: Sampling, tokenizer: Tokenizer, stop: list[str]
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.sampling = sampling
        # Every token the worker produced, so that a lost worker's requests
        # can continue on the next one from exactly where they were.
        self.generated: list[int] = []
        self.worker_losses = 0
        self.tokenizer_digest = tokenizer.digest  # a request resumes only on the same model
        self.finished = False
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._stops = StopMatcher(stop)
        self._rendered_final = False

    def render(self, output: RequestOutput) -> Delta | None:
        """Detokenizer thread: the text this step adds. None once finished."""
        if self._rendered_final:
            return None
        token_ids = output.token_ids
        self.generated += token_ids
        if output.finish_reason == "stop":
            token_ids = token_ids[:-1]
        final = output.finish_reason is not None
        text = self._detokenizer.add(token_ids)
        if final:
            text += self._detokenizer.flush()
        text, hit = self._stops.feed(text, final)
        self._rendered_final = final or hit
        if hit:
            return Delta(text, "stop", abort_worker=not final)
        return Delta(text, output.finish_reason)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def completion_tokens(self) -> int:
        return len(self.generated)

    def add_request(self) -> AddRequest:
        """The request for a worker: the whole of it, or after a lost worker,
        the rest of it (the prompt followed by what was already generated)."""
        if not self.generated:
            return AddRequest(self.request_id, self.prompt, self.sampling)
        rest = msgspec.structs.replace(self.sampling, max_tokens=self.sampling.max_tokens - len(self.generated))
        return AddRequest(self.request_id, self.prompt + self.generated, rest)

    def fail(self, message: str, status: int) -> Delta:
        self._rendered_final = True
        return Delta("", "error", error=message, error_status=status)

    async def deltas(self, deadline: float | None = None):
        """Every Delta until the final one (which is yielded too).

        Raises TimeoutError at `deadline` (event-loop time) if not finished.
        """
        loop = asyncio.get_running_loop()
        while not self.finished:
            timeout = None if deadline is None else max(deadline - loop.time(), 0)
            delta = await asyncio.wait_for(self.queue.get(), timeout)
            self.finished = delta.finish_reason is not None
            yield delta
