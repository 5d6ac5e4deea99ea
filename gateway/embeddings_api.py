"""POST /v1/embeddings, in OpenAI's shape: the model's pooled hidden states
(worker/embed.py), from the same pool, ledger and admission as generation."""

from __future__ import annotations

import asyncio
import base64
import math
import uuid
from array import array

from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import CANCELLED, APIError, decode_body
from gateway.openai_schema import Embedding, EmbeddingList, EmbeddingRequest, EmbeddingUsage
from gateway.plan import keep_alive_seconds
from gateway.pool import Unavailable
from gateway.responses import MsgspecResponse
from gateway.serving import Serving, refused, tokenize, unavailable, unless_client_leaves
from gateway.worker_link import WorkerRejected, WorkerState, WorkerUnavailable
from protocol import Embeddings


def inputs_of(value: str | list) -> list[str | list[int]]:
    """The body's `input` as a list of texts or token-id lists (a 400 for anything else)."""
    if isinstance(value, str):
        return [value]
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [value]
    if all(isinstance(v, str) for v in value):
        return list(value)
    if all(isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v) for v in value):
        return list(value)
    raise APIError(400, "input must be a string, a list of strings, a list of token ids, or a list of token-id lists",
                   param="input")


class EmbeddingsAPI:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def create(self, request: Request) -> Response:
        body = decode_body(await self.serving.read_body(request), EmbeddingRequest)
        vectors, tokens = await self.vectors(request, body.model, body.keep_alive, inputs_of(body.input),
                                             body.dimensions)
        data = [Embedding(index, base64.b64encode(vector.tobytes()).decode()
                          if body.encoding_format == "base64" else vector.tolist())
                for index, vector in enumerate(vectors)]
        return MsgspecResponse(EmbeddingList(data, body.model, EmbeddingUsage(tokens, tokens)))

    async def vectors(self, request: Request, model: str, keep_alive: str | float | None,
                      inputs: list[str | list[int]], dimensions: int | None,
                      truncate: bool = False) -> tuple[list[array], int]:
        """One vector per input (shortened to `dimensions` when asked), and the tokens they took.
        Every API's embeddings are made here (OpenAI's, Ollama's). With `truncate`, an input longer
        than the context is cut to it, its start kept (Ollama's default), instead of a 400."""
        serving = self.serving
        if not inputs or any(len(i) == 0 for i in inputs):
            raise APIError(400, "an input is empty" if inputs else "there is no input", param="input")
        lease, worker = await serving.lease(model, keep_alive_seconds(keep_alive), request=request)
        try:
            token_lists = await self._token_lists(worker, inputs, truncate)
            # What a forward pass holds is the KV state of its tokens, as a prefill's; the worker
            # runs the inputs one after another, so the largest is what the request holds at once.
            footprint = worker.hello.kv_footprint
            timeout = serving.settings.request_timeout_s

            async def embedded() -> Embeddings:
                await lease.reserve(footprint, other=max(footprint.bytes_for(len(t)) for t in token_lists),
                                    wait_s=serving.room_wait_s)
                # Given up on (the client gone, or past --request-timeout-s), the request's Abort
                # drops the rest of its inputs in the worker, where later requests wait behind them.
                return await asyncio.wait_for(serving.link.embed(f"embd-{uuid.uuid4().hex}", token_lists, worker),
                                              timeout or None)

            # A client that leaves while its request waits for room leaves the line then.
            result = await unless_client_leaves(request, embedded())
            if result is None:
                raise APIError(CANCELLED, "the client went away")
        except TimeoutError:
            raise serving.timed_out() from None
        except Unavailable as e:
            raise refused(e) from None
        except WorkerUnavailable as e:
            raise unavailable(str(e)) from None
        except WorkerRejected as e:
            if e.internal:
                raise APIError(500, str(e), type="server_error") from None
            raise APIError(400, str(e), param="model") from None
        finally:
            lease.release()
        flat = array("f", result.vectors)
        width = result.dimensions
        if dimensions is not None and dimensions > width:
            raise APIError(400, f"dimensions is {dimensions}; this model's embeddings have {width}",
                           param="dimensions")
        vectors = [flat[index * width:(index + 1) * width] for index in range(len(token_lists))]
        if dimensions is not None and dimensions < width:
            vectors = [shortened(vector, dimensions) for vector in vectors]
        return vectors, sum(len(t) for t in token_lists)

    async def _token_lists(self, worker: WorkerState, inputs: list[str | list[int]],
                           truncate: bool) -> list[list[int]]:
        """Each input's token ids, within the model's vocabulary and context (400s; cut to the context
        with `truncate`). The texts are tokenized in one call, on the event loop only when they are
        small all together: two thousand short inputs one after another held it for seconds."""
        context, vocab = worker.hello.context_length, worker.hello.vocab_size
        texts = [value for value in inputs if isinstance(value, str)]
        encoded = iter(await tokenize(sum(map(len, texts)), worker.tokenizer.encode_texts, texts,
                                      context if truncate else None, param="input") if texts else [])
        token_lists = []
        for value in inputs:
            if isinstance(value, str):
                tokens = next(encoded)
            elif (bad := next((t for t in value if not 0 <= t < vocab), None)) is not None:
                raise APIError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="input")
            else:
                tokens = value
            if truncate:
                tokens = tokens[:context]
            elif len(tokens) > context:
                raise APIError(400, f"an input has {len(tokens)} tokens; this model's context is {context}",
                               param="input", code="context_length_exceeded")
            token_lists.append(tokens)
        return token_lists


def shortened(vector: array, dimensions: int) -> array:
    """The first `dimensions` values, normalized again (how Matryoshka-trained models, e.g. Qwen3-Embedding,
    are shortened; OpenAI's `dimensions` does the same)."""
    return normalized(vector[:dimensions])


def normalized(vector: array) -> array:
    """The vector at length 1 (a zero vector as it is)."""
    norm = math.sqrt(sum(v * v for v in vector)) or 1.0
    return array("f", (v / norm for v in vector))
