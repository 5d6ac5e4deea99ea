"""The message types of the gateway <-> worker wire.

Every struct is encoded as a msgpack array whose first element is its tag, so
evolving the protocol has one rule: a struct only gains fields at the end, each
with a default. Anything else bumps PROTOCOL_VERSION, and the handshake refuses
a peer of another version with a message naming both.

`Hello.protocol_version` and `Refused.reason` sit right after the tag and stay
there forever, so peers of any version can read them.
"""

from __future__ import annotations

from typing import Literal

import msgspec

PROTOCOL_VERSION = 4


class _Message(msgspec.Struct, array_like=True, tag_field="type", omit_defaults=False):
    pass


class Sampling(msgspec.Struct, array_like=True):
    """How one request picks its tokens; temperature 0 means greedy."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    # None: no logprobs; k >= 0: the chosen token's logprob and the k most likely.
    logprobs: int | None = None
    # An llguidance grammar (JSON) the output must follow: structured output.
    grammar: str | None = None


# ---- gateway -> worker ------------------------------------------------------


class Welcome(_Message, tag="welcome"):
    """The gateway accepted the worker's Hello; it may expect requests now."""

    epoch: int


class Refused(_Message, tag="refused"):
    """The gateway will not talk to this worker; the worker exits."""

    reason: str


class Tensor(msgspec.Struct, array_like=True):
    """An array the model's processor made from a request's images (pixel
    values, image sizes...), passed to the vision model under `name`. Its
    bytes travel as a raw ZeroMQ frame after the message, never in it."""

    name: str
    shape: list[int]
    dtype: str  # a numpy dtype name: "float32", "int64"...


class AddRequest(_Message, tag="add"):
    """A request to run. With `tensors`, the message is followed by one raw
    frame per tensor, in order (see protocol.codec)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    tensors: list[Tensor] = []
    # Resumed after a lost worker: the prompt ends with this many tokens the
    # request itself generated, which are text whatever their ids (a model may
    # write its image placeholder token; only the original prompt holds images).
    generated_tokens: int = 0
    # With tensors: images_key() of their bytes, worked out by the gateway in
    # the thread that made them (hashing a large image's pixels on the worker's
    # main thread held every stream for tens of milliseconds).
    images_key: int = 0
    # Whose prompts the request may reuse from the prefix cache and leaves there
    # (its API key's id; "": everyone's): what another client's cache holds
    # would show in cached_tokens and in the time to the first token.
    cache_scope: str = ""


class Abort(_Message, tag="abort"):
    """Drop these requests before the next step. Unknown ids are ignored."""

    request_ids: list[str]


class Embed(_Message, tag="embed"):
    """Embed each input (token ids) with the model's final hidden states,
    pooled as the model says (worker/embed.py); answered by one Embeddings."""

    request_id: str
    inputs: list[list[int]]


ToWorker = Welcome | Refused | AddRequest | Abort | Embed


# ---- worker -> gateway ------------------------------------------------------


class KVFootprint(msgspec.Struct, array_like=True, frozen=True):
    """The bytes of KV state one request holds, as measured on the worker's own
    cache layers: full-attention layers grow with every token, sliding-window
    layers stop growing at their window, and recurrent (SSM, linear-attention)
    layers hold a fixed state."""

    per_token: int = 0  # full-attention layers, per token
    windowed: tuple[tuple[int, int], ...] = ()  # (bytes per token, window in tokens) per sliding-window layer
    fixed: int = 0  # recurrent layers' state, whatever the length

    def bytes_for(self, tokens: int) -> int:
        """The KV state of a sequence of `tokens` tokens."""
        return self.per_token * tokens + sum(b * min(tokens, window) for b, window in self.windowed) + self.fixed


class Rank(msgspec.Struct, frozen=True):
    """One process of a worker that is an mx.distributed group."""

    rank: int
    host: str
    pid: int  # on its own host


class Hello(_Message, tag="hello"):
    """Sent when a worker connects (and again until welcomed).

    It carries the tokenizer's files, so the gateway needs no model
    configuration of its own and the worker may live on another machine.
    """

    protocol_version: int
    epoch: int
    pid: int
    model: str
    context_length: int
    vocab_size: int
    capacity: int
    eos_token_ids: list[int]
    tokenizer_files: dict[str, bytes]  # with a vision model, its processor's files too
    # A vision-language model: requests may carry images (AddRequest.tensors).
    vision: bool = False
    # The identity of the weights (and config) this worker serves: a request
    # resumes after a lost worker only on one whose digest is the same.
    model_digest: str = ""
    # The tool-call parser mlx-lm chose for the model from its chat template
    # (a module of mlx_lm.tool_parsers, e.g. "qwen3_coder"); "" for none.
    tool_parser: str = ""
    # The reasoning block's markers mlx-lm found for the model ([start, end],
    # e.g. ["<think>", "</think>"] or Gemma's ["<|channel>thought", "<channel|>"]); [] for none.
    reasoning_markers: list[str] = []
    # The loaded weights' bytes (every parameter array, as it sits in memory).
    weights_bytes: int = 0
    # What a request's KV state costs: the gateway's memory ledger reserves it before admitting one.
    kv_footprint: KVFootprint = KVFootprint()
    # A worker that is an mx.distributed group: one entry per rank (its
    # weights_bytes and kv_footprint are the ranks' sums); [] for one process.
    ranks: list[Rank] = []


FinishReason = Literal["stop", "length"]


class TokenLogprob(msgspec.Struct, array_like=True):
    """Log-probabilities (natural log, of the model's distribution) at one position."""

    logprob: float  # of the chosen token
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class RequestOutput(msgspec.Struct, array_like=True):
    """New tokens of one request in one step.

    finish_reason "stop" means the last token is an EOS token: it counts as
    generated but is not text.
    logprobs: one per token, when the request asked for them.
    """

    request_id: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    # On a request's first output: how many prompt tokens came from the prefix cache.
    cached_tokens: int | None = None


class StepOutput(_Message, tag="step"):
    """Everything one engine step produced, for every active request."""

    step: int
    outputs: list[RequestOutput]


class AffinityReport(msgspec.Struct, array_like=True):
    """MLX evaluations the worker triggered, and how many ran off its main thread."""

    evaluations: int
    off_main_thread: int


class PrefixCacheStats(msgspec.Struct, array_like=True):
    hits: int
    cached_tokens: int  # prompt tokens whose KV state was reused, in total
    bytes: int
    entries: int
    # A vision model's image features kept for reuse (worker.vision.FeatureCache).
    image_hits: int = 0  # requests whose images skipped the vision tower
    image_bytes: int = 0
    # The disk tier (worker.disk_cache), where there is one.
    disk_tokens: int = 0  # prompt tokens whose KV state was read back from disk, in total (within cached_tokens)
    disk_hits: int = 0
    disk_bytes: int = 0
    lookups: int = 0  # prompts looked up: hits / lookups is the hit rate
    prefilled_tokens: int = 0  # prompt tokens that found no KV state to reuse, in total
    disk_budget: int = 0  # what the disk tier may hold now: --prefix-cache-disk-bytes, less while its disk is full


class MemoryStats(msgspec.Struct, array_like=True):
    """MLX's allocator, as the main thread last read it (after the latest step)."""

    active: int  # bytes in arrays now
    peak: int  # the most active at once since the worker started
    cache: int  # freed buffers MLX keeps for reuse


class Heartbeat(_Message, tag="heartbeat"):
    """Sent at a fixed interval by a thread of its own (which never touches
    MLX), so a worker whose main thread is stuck in one step still beats but
    its step counter stalls: that is how the gateway tells hung from busy."""

    epoch: int
    step: int
    running: int
    waiting: int
    affinity: AffinityReport | None = None
    prefix_cache: PrefixCacheStats | None = None
    memory: MemoryStats | None = None
    # The process's CPU time, all threads: a step that runs long on MLX's CPU backend keeps it
    # rising, a stuck one (or one waiting on a GPU that never answers) does not. None from a
    # group: its rank 0 spins in a collective while it waits for a stuck rank.
    cpu_s: float | None = None


class Draining(_Message, tag="draining"):
    """The worker is stopping (SIGTERM): send it nothing new. Its running
    requests finish or are handed back in the Goodbye."""

    reason: str


class Error(_Message, tag="error"):
    """A message the worker could not act on. request_id names the request
    that failed, or is None when the message itself was unreadable."""

    request_id: str | None
    message: str
    # The worker failed at it (an out-of-memory), not the request: the client's 500, not its 400.
    internal: bool = False


class Goodbye(_Message, tag="goodbye"):
    """The worker's last message. handed_back: requests it did not finish,
    for the gateway to resume elsewhere; any other unfinished request of this
    worker was lost."""

    reason: str
    handed_back: list[str] = []
    # It stopped as asked (a drain, an unload), not for a failure: no loss.
    clean: bool = False


class LoadFailed(_Message, tag="load_failed"):
    """Sent instead of a Hello by a worker that cannot load its model, just
    before it exits with EXIT_LOAD_FAILED: the gateway shows the reason in
    /health and in its 503s, and `mlxd serve` fails at start-up with it."""

    pid: int
    model: str
    reason: str


# The exit status of a worker whose model cannot be loaded (after LoadFailed).
EXIT_LOAD_FAILED = 3

class Embeddings(_Message, tag="embeddings"):
    """The vectors of an Embed's inputs, in order: float32, little-endian,
    `dimensions` values each, one after another."""

    request_id: str
    dimensions: int
    vectors: bytes


FromWorker = Hello | StepOutput | Heartbeat | Draining | Error | Goodbye | LoadFailed | Embeddings
