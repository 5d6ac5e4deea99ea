"""Continuous batching over mlx-lm's BatchGenerator, keyed by request id.

Runs on the worker's main thread only; every method may call into MLX.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from time import perf_counter

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.sample_utils import make_frequency_penalty, make_logits_processors, make_presence_penalty

from protocol import AddRequest, PrefixCacheStats, RequestOutput, TokenLogprob
from protocol.codec import images_key, scoped_images_key
from worker.grammar import GrammarError, Grammars
from worker.joins import fold_joins, running_kv_view
from worker.prefix_cache import PrefixCache
from worker.sampling import make_sampler
from worker.vision import VisionPrefill

log = logging.getLogger("mlxd.worker")

MAX_TOP_LOGPROBS = 20
# Side work in a step that also decodes (images encoded, embeddings) is held
# to this share of a decode step's time, so running text streams slow to at
# most about 1.5 times their pace meanwhile.
IMAGE_WORK_SHARE = 0.5


def over_completion(processor: Callable, start: int) -> Callable:
    """A logits processor that sees the context's tokens from `start` on."""
    return lambda tokens, logits: processor(tokens[start:], logits)


class InvalidRequest(ValueError):
    """An AddRequest the engine will not run; the message says why."""


@dataclass(slots=True)
class Admitted:
    """One request in the engine, from add to finish or abort."""

    request_id: str
    top_logprobs: int | None  # alternatives wanted with each token's logprob; None: no logprobs
    cached_tokens: int | None  # prompt tokens from the prefix cache, until the first output reports them
    cache_key: list[int] | None = None  # a request with images: its prefix-cache key (see worker.vision)
    cache_scope: str = ""  # whose prefix cache it reads and adds to (AddRequest.cache_scope)
    uid: int | None = None  # the BatchGenerator's, once it joined the batch
    waiting: bool = True  # not prefilled yet
    on_disk: bool = False  # its prompt's KV state was handed to the disk tier


@dataclass(slots=True)
class Joining:
    """What mlx-lm's batch takes for a request besides its prompt and cache."""

    admitted: Admitted
    max_tokens: int
    sampler: Callable[[mx.array], mx.array]
    processors: list
    stop_sequences: StopSequences


class Engine:
    def __init__(
        self,
        model,
        *,
        eos_token_ids: list[int],
        vocab_size: int,
        context_length: int,
        capacity: int,
        prefill_batch_size: int,
        prefill_step_size: int,
        grammars: Grammars | None = None,
        prefix_cache: PrefixCache | None = None,
        vision: VisionPrefill | None = None,
        image_work_share: float = IMAGE_WORK_SHARE,
    ) -> None:
        self.grammars = grammars
        self.vision = vision
        self.image_work_share = image_work_share
        self.prefix_cache = prefix_cache
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.steps = 0
        self._generator = BatchGenerator(
            model,
            completion_batch_size=capacity,
            prefill_batch_size=min(prefill_batch_size, capacity),
            prefill_step_size=prefill_step_size,
        )
        fold_joins(self._generator)
        self._requests: dict[str, Admitted] = {}
        self._by_uid: dict[int, Admitted] = {}
        # Requests with images whose prompt is prefilled a piece per step
        # (worker.vision), oldest first; each joins the batch when done.
        self._prefilling: deque[tuple[Joining, list[int], Generator[None, float, list]]] = deque()
        self._decode_seconds: deque[float] = deque(maxlen=16)  # the latest plain decode steps' times
        # Read by the heartbeat thread: a plain counter, never an iteration
        # over a dict the main thread is changing.
        self.waiting = 0
        # Requests the engine dropped on its own, and why: the worker tells their clients.
        self.failed: list[tuple[str, str]] = []

    @property
    def has_work(self) -> bool:
        return bool(self._requests)

    def cache_stats(self) -> PrefixCacheStats | None:
        """The prefix cache's counters, and the image feature cache's (plain
        numbers: the heartbeat thread reads them)."""
        if self.prefix_cache is None:
            return None
        stats = self.prefix_cache.stats()
        features = self.vision.features if self.vision else None
        if features is not None:
            stats.image_hits, stats.image_bytes = features.hits, features.nbytes
        return stats

    @property
    def running(self) -> int:
        return len(self._requests) - self.waiting

    def _check(self, request: AddRequest) -> None:
        if request.request_id in self._requests:
            raise InvalidRequest(f"request id {request.request_id!r} is already running")
        prompt = request.prompt_token_ids
        if not prompt:
            raise InvalidRequest("empty prompt")
        if len(prompt) >= self.context_length:
            raise InvalidRequest(
                f"prompt of {len(prompt)} tokens leaves no room in a context of {self.context_length}"
            )
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary (size {self.vocab_size})")
        if not 0 <= request.generated_tokens < len(prompt):
            raise InvalidRequest(f"generated_tokens {request.generated_tokens} is not within the prompt")
        s = request.sampling
        if s.max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1")
        if not 0 <= s.temperature < math.inf or not 0 < s.top_p <= 1 or s.top_k < 0 or not 0 <= s.min_p <= 1:
            raise InvalidRequest(f"sampling parameters out of range: {s}")
        penalties = (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, *s.logit_bias.values())
        if not all(math.isfinite(p) for p in penalties) or s.repetition_penalty <= 0:
            raise InvalidRequest("penalties and logit biases must be finite, repetition_penalty > 0")
        bad = next((t for t in s.logit_bias if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"logit_bias names token id {bad}, outside the vocabulary (size {self.vocab_size})")
        if s.logprobs is not None and not 0 <= s.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
        if request.tensors:
            if self.vision is None:
                raise InvalidRequest("this worker's model is text-only: it takes no images")
            media = prompt[:len(prompt) - request.generated_tokens]
            if self.vision.image_token_id not in media or media[-1] == self.vision.image_token_id:
                raise InvalidRequest("a request with images needs image placeholder tokens, and text after them")

    def add(self, request: AddRequest, buffers: Sequence[memoryview] = ()) -> None:
        """Queue a request; `buffers` hold its tensors' bytes (its images)."""
        self._check(request)
        s = request.sampling
        stop_ids = [] if s.ignore_eos else self.eos_token_ids
        max_tokens = min(s.max_tokens, self.context_length - len(request.prompt_token_ids))
        # The repetition penalty looks back over the whole context; presence and frequency, as OpenAI
        # defines them, over the completion only: the tokens from `completion` on in mlx-lm's context
        # (the prompt, then each token as it is generated; a resumed request's own are in its prompt).
        processors = make_logits_processors(
            logit_bias=s.logit_bias or None,
            repetition_penalty=s.repetition_penalty if s.repetition_penalty != 1.0 else None,
            repetition_context_size=self.context_length,
        )
        completion = len(request.prompt_token_ids) - request.generated_tokens
        for make_penalty, penalty in ((make_presence_penalty, s.presence_penalty),
                                      (make_frequency_penalty, s.frequency_penalty)):
            if penalty:
                processors.append(over_completion(make_penalty(penalty, self.context_length), completion))
        if s.grammar is not None:
            if self.grammars is None:
                raise InvalidRequest("this worker cannot follow grammars")
            try:
                generated = request.prompt_token_ids[len(request.prompt_token_ids) - request.generated_tokens:]
                processors.append(self.grammars.processor(s.grammar, generated))
            except GrammarError as e:
                raise InvalidRequest(f"unusable grammar: {e}") from None
        prompt = request.prompt_token_ids
        vision = self.vision
        media_end = len(prompt) - request.generated_tokens  # image positions lie before it
        # The gateway sends the key; a request made in-process (tests, benchmarks) has it worked out here.
        images = scoped_images_key(request.images_key or images_key(buffers), request.cache_scope) \
            if vision is not None and request.tensors else None
        key = prompt if vision is None or images is None else vision.cache_key(prompt, media_end, images)
        scope = request.cache_scope
        cache, reused = self.prefix_cache.take(key, scope) if self.prefix_cache else (None, 0)
        admitted = Admitted(request.request_id, s.logprobs, reused, cache_scope=scope)
        # None is mlx-lm's "none" for a sampler (the batch's argmax), though its type hints do not say so.
        sampler = make_sampler(s, self.vocab_size, request.generated_tokens)
        joining = Joining(admitted, max_tokens, sampler, processors,  # type: ignore[arg-type]
                          StopSequences([[t] for t in stop_ids]))
        if vision is not None and images is not None:
            try:
                tensors = {t.name: np.frombuffer(b, dtype=t.dtype).reshape(t.shape)
                           for t, b in zip(request.tensors, buffers)}
                pieces = vision.prefill(prompt, media_end, images, tensors, cache, reused)
                next(pieces)  # builds the work: inputs this model cannot take show here
            except Exception as e:  # of whatever kind each family's code raises (an out-of-memory too): this request's
                raise InvalidRequest(f"the vision model cannot take these inputs: {e}") from None
            admitted.cache_key = key
            self._prefilling.append((joining, prompt, pieces))
        else:
            self._join(joining, prompt[reused:], prompt[:reused], vision.batch_cache(cache) if vision else cache)
        self._requests[request.request_id] = admitted
        self.waiting += 1

    def _join(self, joining: Joining, rest: list[int], done: list[int], cache: list | None) -> None:
        """Into mlx-lm's batch: `rest` of the prompt to prefill there, `done` in `cache`."""
        (uid,) = self._generator.insert(
            [rest],
            caches=[cache],  # type: ignore[list-item]  # None: a fresh one
            all_tokens=[done],
            max_tokens=[joining.max_tokens],
            samplers=[joining.sampler],
            logits_processors=[joining.processors],
            stop_sequences=[joining.stop_sequences],
        )
        joining.admitted.uid = uid
        self._by_uid[uid] = joining.admitted

    def _prefill_pieces(self) -> None:
        """This step's image work: pieces of the requests with images still
        prefilling, oldest first, until the step's budget is spent (one piece
        when nothing decodes); each request joins the batch for its last
        token once its prompt is in its cache."""
        budget = self.side_work_budget()
        deadline = perf_counter() + budget
        while self._prefilling:
            joining, prompt, pieces = self._prefilling[0]
            try:
                pieces.send(deadline - perf_counter())
            except StopIteration as finished:
                self._prefilling.popleft()
                self._join(joining, prompt[-1:], prompt[:-1], finished.value)
            except Exception as e:  # its image work alone failed (an out-of-memory in the tower): not the others'
                log.exception("the image work of request %s failed", joining.admitted.request_id)
                self._prefilling.popleft()
                self._finish(joining.admitted)
                self.failed.append((joining.admitted.request_id, f"its images could not be encoded: {e}"))
            if budget == math.inf or perf_counter() >= deadline:
                break

    def side_work_budget(self) -> float:
        """Seconds of work beside this step's decoding (image pieces, an
        embedding's piece): unbounded when nothing decodes (nobody waits on
        it), none before a decode step is timed (the least work a piece holds)."""
        if not self._by_uid:
            return math.inf
        if not self._decode_seconds:
            return 0.0
        return self.image_work_share * statistics.median(self._decode_seconds)

    def abort(self, request_ids: list[str], keep: bool = True) -> None:
        """Drop requests; unknown or finished ids are ignored (aborts are
        idempotent). Their KV state goes to the prefix cache unless not `keep`."""
        dropped = [self._requests[r] for r in dict.fromkeys(request_ids) if r in self._requests]
        if not dropped:
            return
        if joined := [r.uid for r in dropped if r.uid is not None]:
            keeper = self.prefix_cache if keep else None
            caches = self._generator.remove(joined, return_prompt_caches=keeper is not None)
            if keeper is not None:
                for uid, (cache, tokens) in caches.items():
                    admitted = self._by_uid[uid]
                    keeper.keep(self._cache_key(admitted, tokens), cache, admitted.cache_scope)
        if len(joined) < len(dropped):  # some were still prefilling their images
            ids = {r.request_id for r in dropped}
            self._prefilling = deque(p for p in self._prefilling if p[0].admitted.request_id not in ids)
        for admitted in dropped:
            self._finish(admitted)

    def abort_all(self, failed: bool = False) -> list[str]:
        """Drop every request. After a failed step nothing is kept: a step cut
        short inside mlx-lm may have moved a row's KV state and not its tokens."""
        ids = list(self._requests)
        self.abort(ids, keep=not failed)
        return ids

    def _finish(self, admitted: Admitted) -> None:
        """It finished or was aborted: the engine forgets it."""
        self._started(admitted)
        del self._requests[admitted.request_id]
        if admitted.uid is not None:
            del self._by_uid[admitted.uid]

    def _started(self, admitted: Admitted) -> None:
        """It is prefilled: no longer waiting."""
        if admitted.waiting:
            admitted.waiting = False
            self.waiting -= 1

    @staticmethod
    def _cache_key(admitted: Admitted, tokens: list[int]) -> list[int]:
        """What a request's KV state is filed under: its tokens, with image
        positions keyed by the images' content. The state may hold fewer
        tokens than the key (aborted before its last prompt token was fed)."""
        key = admitted.cache_key
        return tokens if key is None else key[:len(tokens)] + list(tokens[len(key):])

    def step(self) -> list[RequestOutput]:
        """One continuous-batching step: a prefill chunk and/or one decode token
        each, and image prefill pieces within the step's budget."""
        piece = bool(self._prefilling)
        if piece:
            self._prefill_pieces()
        started = perf_counter()
        prompt_responses, generation_responses = self._generator.next()
        # Timed only without image work beside it: the GPU runs the two at once,
        # and a budget that grew with the steps it lengthens would feed itself.
        # The first is timed regardless (its image work the least a piece holds):
        # under steady image traffic from the start, none would ever be.
        if generation_responses and not prompt_responses and (not piece or not self._decode_seconds):
            self._decode_seconds.append(perf_counter() - started)
        self.steps += 1
        for r in prompt_responses:
            self._started(self._by_uid[r.uid])
        outputs = []
        wanted = []
        finished = []
        disk = self.prefix_cache.disk if self.prefix_cache is not None else None
        for r in generation_responses:
            admitted = self._by_uid[r.uid]
            self._started(admitted)
            if disk is not None and not admitted.on_disk and r.finish_reason is None:
                # Now, not at its end: a worker lost mid-stream leaves the prompt on disk for the resumed request.
                # (One that ends here has left mlx-lm's batch already; keep() below writes it.)
                admitted.on_disk = True
                cache, tokens = running_kv_view(self._generator, r.uid)
                disk.save(self._cache_key(admitted, list(tokens)), cache, admitted.cache_scope)
            outputs.append(RequestOutput(admitted.request_id, [r.token], r.finish_reason,
                                         cached_tokens=admitted.cached_tokens))
            admitted.cached_tokens = None  # reported once, on the first output
            if admitted.top_logprobs is not None:
                wanted.append((outputs[-1], r, admitted.top_logprobs))
            if r.finish_reason is not None:
                if self.prefix_cache is not None:
                    self.prefix_cache.keep(self._cache_key(admitted, r.all_tokens), r.prompt_cache,
                                           admitted.cache_scope)
                finished.append(admitted)
        if wanted:
            self._attach_logprobs(wanted)
        # Forgotten once the step has all gone well: should any of it fail,
        # abort_all still names them, and their clients get an error.
        for admitted in finished:
            self._finish(admitted)
        return outputs

    @staticmethod
    def _attach_logprobs(wanted: list) -> None:
        """The chosen token's logprob and the k most likely, for each output
        that asked; every array evaluated in one go."""
        arrays = []
        for _, r, k in wanted:
            logprobs = r.logprobs
            top = mx.argpartition(-logprobs, kth=k - 1)[:k] if k else mx.array([], dtype=mx.uint32)
            arrays += [logprobs[r.token], top, logprobs[top]]
        mx.eval(arrays)
        for i, (output, _, _) in enumerate(wanted):
            chosen, top, top_logprobs = arrays[3 * i : 3 * i + 3]
            ranked = sorted(zip(top_logprobs.tolist(), top.tolist()), reverse=True)
            output.logprobs = [
                TokenLogprob(chosen.item(), [t for _, t in ranked], [lp for lp, _ in ranked])
            ]
