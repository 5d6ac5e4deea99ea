"""Ollama's API (/api/*) on the same gateway: the same pool, keys, limits and
generation as the OpenAI and Anthropic APIs, in Ollama's shapes.

/api/chat and /api/generate become a Plan, as the other dialects' bodies do,
and stream NDJSON (a JSON object a line; streaming is Ollama's default)
through the shared Serving. /api/embed and /api/embeddings use the
embeddings of /v1/embeddings. /api/tags, /api/ps and /api/show describe the
served models; a name Ollama's clients write as `NAME:latest` reaches NAME.
Errors are Ollama's {"error": "..."} (gateway/errors.py).
"""

from __future__ import annotations

import abc
import hashlib
import math
import time
import uuid
from collections.abc import Sequence
from typing import TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from gateway.embeddings_api import EmbeddingsAPI, normalized
from gateway.errors import APIError, convert, decode_body
from gateway.images import ImageSource
from gateway.ollama_schema import (
    ChatChunk,
    ChatRequest,
    Details,
    Embed,
    EmbeddingsRequest,
    EmbedRequest,
    GenerateChunk,
    GenerateRequest,
    GenerationRequest,
    Logprob,
    Message,
    ModelEntry,
    Options,
    OutMessage,
    ShowRequest,
    TokenLogprob,
    ToolCall,
    ToolCallFunction,
    ToolDefinition,
)
from gateway.output_processor import Delta, RequestGroup, TokenInfo
from gateway.parsing import ToolCall as ParsedCall
from gateway.parsing import arguments_object, detect_reasoning, reasons
from gateway.plan import (
    ChatInput,
    Plan,
    SamplingParams,
    function_tool,
    keep_alive_seconds,
    nonempty_stops,
    reasoning_switches,
    template_message,
    template_tool_call,
    tool_definitions,
)
from gateway.responses import NDJSON, MsgspecResponse, json_line, timestamp
from gateway.security import keep_alive_for
from gateway.serving import OLLAMA_DEFAULT_TAG, Choice, Serving, takes_tools

# The Ollama release whose API this follows: clients check it before using newer features.
OLLAMA_VERSION = "0.12.0"
T = TypeVar("T")
ROLES = ("system", "user", "assistant", "tool")
def nanoseconds(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def tagged(name: str) -> str:
    """A served name as Ollama's clients list it: with a tag."""
    return name if ":" in name.rsplit("/", 1)[-1] else name + OLLAMA_DEFAULT_TAG


def decode_ollama(body: bytes, request_type: type[T]) -> T:
    """A body as Ollama (Go) reads it: a null is a field left out, in the body,
    its options and its messages (clients send them so), and a message's role
    is read in any case. Not deeper: a schema in `format` or a tool's
    arguments may hold nulls of their own."""
    raw = decode_body(body, object)
    if isinstance(raw, dict):
        raw = _present(raw)
        if isinstance(raw.get("options"), dict):
            raw["options"] = _present(raw["options"])
        if isinstance(raw.get("messages"), list):
            raw["messages"] = [_message(m) if isinstance(m, dict) else m for m in raw["messages"]]
    return convert(raw, request_type, "")


def _message(fields: dict) -> dict:
    """A message as Go reads it: its nulls left out, its role in lower case."""
    message = _present(fields)
    if isinstance(message.get("role"), str):
        message["role"] = message["role"].lower()
    return message


def _present(fields: dict) -> dict:
    return {name: value for name, value in fields.items() if value is not None}


def sampling(options: Options | None, logprobs: int | None) -> tuple[SamplingParams, list[str], int | None]:
    """The sampling, stop strings and token limit `options` ask for (the others it may hold are ignored);
    `logprobs`: how many of the likeliest tokens each token's log-probability comes with, if asked for."""
    o = options or Options()
    for name in ("temperature", "top_k", "min_p", "seed", "num_predict", "presence_penalty", "frequency_penalty"):
        value = getattr(o, name)
        if value is not None and not math.isfinite(value):  # "inf", a string the lax decoding takes
            raise APIError(400, f"options.{name} must be a finite number", param=f"options.{name}")
    # Clients that map OpenAI's fields onto these send a frequency_penalty of 0 as a repeat_penalty of 0.
    repeat_penalty = o.repeat_penalty if o.repeat_penalty is None or o.repeat_penalty > 0 else 1.0
    params = SamplingParams(temperature=o.temperature, top_p=None if o.top_p is None else min(o.top_p, 1.0),
                            top_k=None if o.top_k is None else int(o.top_k),
                            min_p=None if o.min_p is None else min(max(o.min_p, 0.0), 1.0),
                            repetition_penalty=repeat_penalty, presence_penalty=_penalty(o.presence_penalty),
                            frequency_penalty=_penalty(o.frequency_penalty),
                            # A negative seed is Ollama's (and llama.cpp's) "no seed": a new draw every time.
                            seed=int(o.seed) if o.seed is not None and o.seed >= 0 else None, logprobs=logprobs)
    limit = None if o.num_predict is None else int(o.num_predict)  # Go cuts a float to an integer (here too)
    max_tokens = limit if limit is not None and limit > 0 else None
    return params, nonempty_stops(o.stop or [], "options.stop"), max_tokens


def _penalty(value: float | None) -> float:
    """A presence or frequency penalty within the -2..2 that sampling takes (Ollama passes any on)."""
    return 0.0 if value is None else min(max(value, -2.0), 2.0)


def output_format(value: str | dict | None) -> tuple[bool, dict | None]:
    """`format`: nothing, "json", or a JSON schema -> (JSON output?, its schema)."""
    if value is None or value == "":
        return False, None
    if value == "json":
        return True, None
    if isinstance(value, dict):
        return True, value
    raise APIError(400, 'format must be "json" or a JSON schema', param="format")


def thinking(think: bool | str | None) -> dict | None:
    """`think`: on or off, or how hard to think ("low", "medium", "high",
    "max"), which is on, as in Ollama -> the chat template's switches."""
    if think is None or isinstance(think, bool):
        return reasoning_switches(None, think)
    if think in ("low", "medium", "high", "max"):
        return reasoning_switches(think, True)
    raise APIError(400, 'think must be true, false, "low", "medium", "high" or "max"', param="think")


def chat_input(messages: list[Message], think: bool | str | None, param: str = "messages",
               truncate: bool = True) -> ChatInput:
    """The messages as chat templates take them, and their images in order.

    Calls carry the ids the answers gave them, and a `tool` message the
    `tool_call_id` of the call it answers, where clients send them back
    (templates that pair a tool's result with its call by id use them: Kimi's,
    Mistral's); where they do not, a call gets an id made from its place, and
    a `tool` message the id of its turn's next call (of its `tool_name`, when
    it names one). Longer than the context, the conversation loses its oldest
    turns, unless `truncate` is false (Ollama's field): then it is a 400."""
    out, images = [], []
    unanswered: list[dict] = []  # the calls of the latest assistant message not answered yet
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role  # OpenAI's newer name, which clients pass on
        if role not in ROLES:
            raise APIError(400, f"{param}[{i}].role must be one of {', '.join(ROLES)}", param=f"{param}[{i}].role")
        content: str | list[dict] = m.content
        if m.images:
            images += [ImageSource(f"{param}[{i}].images[{j}]", data=image) for j, image in enumerate(m.images)]
            content = [{"type": "image"} for _ in m.images] + [{"type": "text", "text": m.content}]
        calls = [template_tool_call(c.id or f"c{i:05d}{k:03d}", c.function.name, c.function.arguments)
                 for k, c in enumerate(m.tool_calls or [])]
        if calls:
            unanswered = list(calls)
        extra = {"name": m.tool_name} if m.tool_name else {}
        if role == "tool":
            answered = next((c for c in unanswered if c["id"] == m.tool_call_id), None) or \
                next((c for c in unanswered if m.tool_name in (None, "", c["function"]["name"])), None)
            if answered is not None:
                unanswered.remove(answered)
                extra["tool_call_id"] = answered["id"]
        out.append(template_message(role, content, calls, m.thinking or "", **extra))
    return ChatInput(out, images, thinking(think), fit_context=truncate)


def plan(prompt: ChatInput | str, body: GenerationRequest, tools: list[ToolDefinition] | None,
         param: str) -> Plan:
    params, stops, max_tokens = sampling(body.options, body.top_logprobs if body.logprobs else None)
    model, fmt, stream, keep_alive, think = body.model, body.format, body.stream, body.keep_alive, body.think
    json_output, schema = output_format(fmt)
    functions = [function_tool(t.function.name, t.function.description, t.function.parameters) for t in tools or []]
    return Plan(model=model, prompt=prompt, sampling=params, stops=stops, stream=stream, max_tokens=max_tokens,
                max_tokens_param="options.num_predict", tools=tool_definitions(functions, "auto"),
                json_output=json_output, json_schema=schema, json_schema_param="format", messages_param=param,
                keep_alive_s=keep_alive_seconds(keep_alive),
                # Ollama refuses them for a model that does not think, or has no tools in its template,
                # and clients retry without them.
                thinking_param="think" if think not in (None, False) else None, tools_param="tools")


def calls_of(calls: list[ParsedCall], first: int = 0) -> list[ToolCall] | None:
    """Tool calls as Ollama writes them: arguments as an object; `first`: the
    index of the first (the answer's calls written before them)."""
    return [ToolCall(ToolCallFunction(c.name, arguments_object(c.arguments) or {}, first + i), c.id)
            for i, c in enumerate(calls)] or None


def logprobs_of(tokens: Sequence[TokenInfo]) -> list[Logprob] | None:
    """Each token's log-probability as Ollama writes it, with its bytes and the likeliest tokens beside it."""
    return [Logprob(t.text, t.logprob, list(t.raw), [TokenLogprob(text, logprob, list(raw))
                                                     for text, raw, logprob in t.top] or None)
            for t in tokens] or None


def line(chunk: msgspec.Struct | dict) -> bytes:
    """One NDJSON line: the `ollama` client reads them with httpx's iter_lines,
    which also ends a line at U+2028, U+2029 and U+0085 (json_line escapes them)."""
    return json_line(chunk) + b"\n"


class _Output(abc.ABC):
    """One request's renderer (serving.Renderer): NDJSON lines, the last with
    `done`, its reason and its counts and durations; or that last object whole."""

    media_type = NDJSON

    def __init__(self, model: str, arrived: float) -> None:
        self.id = f"ollama-{uuid.uuid4().hex}"
        self.model = model
        self._arrived = arrived
        self._length = False  # ended by its token limit
        self._calls_sent = 0

    def opening(self, group: RequestGroup) -> list[bytes]:
        return []

    def delta(self, delta: Delta) -> list[bytes]:
        self._length |= delta.finish_reason == "length"
        if not (delta.text or delta.reasoning or delta.tool_calls or delta.logprobs):
            return []
        calls = calls_of(delta.tool_calls, self._calls_sent)
        self._calls_sent += len(delta.tool_calls)
        return [line(self.piece(delta.text, delta.reasoning, calls, False, delta.logprobs))]

    def keepalive(self) -> list[bytes]:
        return []  # Ollama's lines are all chunks of the answer, and Ollama sends none between them

    def ending(self, group: RequestGroup, error: APIError | None) -> list[bytes]:
        if error is not None:
            return [line({"error": error.message})]
        return [line(self.last("", "", None, group))]

    def body(self, choices: list[Choice], group: RequestGroup) -> msgspec.Struct:
        choice = choices[0]
        self._length = choice.finish_reason == "length"
        return self.last(choice.text, choice.reasoning, calls_of(choice.tool_calls), group, choice.logprobs)

    def last(self, text: str, reasoning: str, calls: list[ToolCall] | None, group: RequestGroup,
             logprobs: Sequence[TokenInfo] = ()) -> msgspec.Struct:
        now = time.monotonic()
        first = group.first_token_at or now
        return msgspec.structs.replace(
            self.piece(text, reasoning, calls, True, logprobs), done_reason="length" if self._length else "stop",
            total_duration=nanoseconds(now - self._arrived), load_duration=nanoseconds(group.ready_at - self._arrived),
            prompt_eval_count=group.prompt_tokens, prompt_eval_duration=nanoseconds(first - group.ready_at),
            eval_count=group.completion_tokens, eval_duration=nanoseconds(now - first))

    @abc.abstractmethod
    def piece(self, text: str, reasoning: str, calls: list[ToolCall] | None, done: bool,
              logprobs: Sequence[TokenInfo] = ()) -> msgspec.Struct: ...


class ChatOutput(_Output):
    def piece(self, text: str, reasoning: str, calls: list[ToolCall] | None, done: bool,
              logprobs: Sequence[TokenInfo] = ()) -> ChatChunk:
        return ChatChunk(model=self.model, created_at=timestamp(), done=done,
                         message=OutMessage("assistant", text, reasoning or None, calls),
                         logprobs=logprobs_of(logprobs))


class GenerateOutput(_Output):
    def piece(self, text: str, reasoning: str, calls: list[ToolCall] | None, done: bool,
              logprobs: Sequence[TokenInfo] = ()) -> GenerateChunk:
        return GenerateChunk(model=self.model, created_at=timestamp(), done=done, response=text,
                             thinking=reasoning or None, logprobs=logprobs_of(logprobs))


class OllamaAPI:
    def __init__(self, serving: Serving, embeddings: EmbeddingsAPI) -> None:
        self.serving = serving
        self.embeddings = embeddings

    async def version(self, _request: Request) -> Response:
        return MsgspecResponse({"version": OLLAMA_VERSION})

    async def manage(self, request: Request) -> Response:
        """Ollama's model management (pull, push, create, copy, delete, blobs): models come
        and go through mlxd's own commands on the server, not through this API."""
        raise APIError(501, f"mlxd does not manage models through Ollama's API ({request.url.path}): on the "
                            "server, `mlxd pull NAME` downloads a model, `mlxd rm NAME` removes one, and "
                            "`mlxd serve --model` serves them")

    async def running(self, _request: Request) -> Response:
        """`/`: what Ollama answers there; its CLI checks it (HEAD) before every command."""
        return PlainTextResponse("Ollama is running")

    async def chat(self, request: Request) -> Response:
        body = decode_ollama(await self.serving.read_body(request), ChatRequest)
        if not body.messages:
            return await self._load_or_unload(request, body.model, body.keep_alive, ChatOutput(body.model, 0.0))
        renderer = ChatOutput(body.model, request.scope["state"]["arrived"])
        prompt = chat_input(body.messages, body.think, truncate=body.truncate)
        return await self.serving.respond(request, plan(prompt, body, body.tools, "messages"), renderer)

    async def generate(self, request: Request) -> Response:
        body = decode_ollama(await self.serving.read_body(request), GenerateRequest)
        for name, value, why in (("suffix", body.suffix, "fill-in-the-middle is not supported"),
                                 ("template", body.template, "mlxd renders the model's own chat template; "
                                  "send raw: true with a prompt of your own"),
                                 ("context", body.context, "it is deprecated in Ollama; send the conversation "
                                  "to /api/chat")):
            if value:
                raise APIError(400, f"{name}: {why}", param=name)
        if not body.prompt and not body.images:
            return await self._load_or_unload(request, body.model, body.keep_alive, GenerateOutput(body.model, 0.0))
        prompt: ChatInput | str
        if body.raw:
            if body.images:
                raise APIError(400, "images need the chat template: send them without raw", param="images")
            if body.system:
                raise APIError(400, "raw takes the prompt as it is, with no template to put a system prompt in: "
                                    "write it into the prompt", param="system")
            thinking(body.think)  # checked all the same: no template takes it here
            prompt = body.prompt
        else:
            messages = [Message("system", body.system)] if body.system else []
            prompt = chat_input([*messages, Message("user", body.prompt, body.images)], body.think, "prompt",
                                body.truncate)
            prompt.untemplated = None if body.images else body.prompt
        renderer = GenerateOutput(body.model, request.scope["state"]["arrived"])
        return await self.serving.respond(request, plan(prompt, body, None, "prompt"), renderer)

    async def _load_or_unload(self, request: Request, model: str, keep_alive: str | float | None,
                              output: _Output) -> Response:
        """Ollama's way to load a model (an empty prompt) or, with keep_alive 0, to unload it."""
        serving = self.serving
        keep_alive_s = keep_alive_seconds(keep_alive)
        if keep_alive_s == 0:
            keep_alive_for(request, keep_alive_s)  # a 403 for an API key where admin keys are set
            name = serving.served_name(model, serving.model_names())
            pooled = serving.pool.find(name)
            if pooled is not None and not pooled.pinned:  # an operator's pin outlasts a client's unload
                await serving.pool.unload(name)
            reason = "unload"
        else:
            await self._load(request, model, keep_alive_s)
            reason = "load"
        return MsgspecResponse(msgspec.structs.replace(output.piece("", "", None, True), done_reason=reason))

    async def _load(self, request: Request, model: str, keep_alive_s: float | None) -> None:
        """Load the model (or keep it loaded) and run nothing on it."""
        lease, _ = await self.serving.lease(model, keep_alive_s, request=request)
        lease.release()

    async def embed(self, request: Request) -> Response:
        body = decode_ollama(await self.serving.read_body(request), EmbedRequest)
        started = time.monotonic()
        if body.input in ("", []):  # Ollama's way to load an embedding model
            await self._load(request, body.model, keep_alive_seconds(body.keep_alive))
            return MsgspecResponse(Embed(body.model, [], nanoseconds(time.monotonic() - started), 0, 0))
        inputs: list[str | list[int]] = [body.input] if isinstance(body.input, str) else list(body.input)
        vectors, tokens = await self.embeddings.vectors(request, body.model, body.keep_alive, inputs,
                                                        body.dimensions, body.truncate)
        # Ollama's /api/embed answers vectors of length 1, whatever the model's files say.
        return MsgspecResponse(Embed(body.model, [normalized(v).tolist() for v in vectors],
                                     nanoseconds(time.monotonic() - started), 0, tokens))

    async def embeddings_v1(self, request: Request) -> Response:
        """The older /api/embeddings: one prompt, one vector (none for no prompt, which loads the model)."""
        body = decode_ollama(await self.serving.read_body(request), EmbeddingsRequest)
        if not body.prompt:
            await self._load(request, body.model, keep_alive_seconds(body.keep_alive))
            return MsgspecResponse({"embedding": []})
        vectors, _ = await self.embeddings.vectors(request, body.model, body.keep_alive, [body.prompt], None)
        return MsgspecResponse({"embedding": vectors[0].tolist()})

    async def tags(self, _request: Request) -> Response:
        return MsgspecResponse({"models": [self._entry(name) for name in self.serving.model_names()]})

    async def ps(self, _request: Request) -> Response:
        serving, pool = self.serving, self.serving.pool
        now = time.time()
        loaded, seen = [], set()
        for name in serving.model_names():
            pooled = pool.find(name)
            # A model once, under its first name: its other names (--served-model-name) are the same memory.
            model = pooled or serving.link.worker_of(name)
            if pool.status(name) != "loaded" or id(model) in seen:
                continue
            seen.add(id(model))
            charge = pool.charge(name)
            unloads_in = (pooled.idle_until - time.monotonic()) if pooled is not None and not pooled.users else math.inf
            entry = self._entry(name)
            entry.expires_at = timestamp(now + unloads_in)
            # All of it in the GPU's (unified) memory: `ollama ps` shows "100% GPU" when the two agree.
            entry.size = entry.size_vram = charge.total if charge is not None else entry.size
            loaded.append(entry)
        return MsgspecResponse({"models": loaded})

    async def show(self, request: Request) -> Response:
        body = decode_ollama(await self.serving.read_body(request), ShowRequest)
        if not (body.model or body.name):
            raise APIError(400, "model is required", param="model")
        name = self.serving.served_name(body.model or body.name, self.serving.model_names())
        entry = self._entry(name)
        worker = self.serving.link.worker_of(name)
        if worker is not None:
            template, tools = worker.tokenizer.chat_template, takes_tools(worker)
            thinking, vision = reasons(template, worker.reasoning_markers), worker.hello.vision
        else:  # not loaded: what its files say (apps ask before any load, to offer it for tools or images)
            facts = self.serving.model_facts(name)
            template, tools = facts.chat_template, facts.takes_tools
            thinking, vision = reasons(template, detect_reasoning(template, set())), facts.vision
        capabilities = ["completion"] + [c for c, has in (("tools", tools),
                                                          ("thinking", thinking), ("vision", vision)) if has]
        family = entry.details.family
        info: dict = {"general.architecture": family}
        if (context := entry.context_length) is not None:
            info[f"{family or 'general'}.context_length"] = context
        return MsgspecResponse({"modelfile": "", "parameters": "", "template": template, "details": entry.details,
                                "model_info": info, "capabilities": capabilities, "modified_at": entry.modified_at})

    def _entry(self, name: str) -> ModelEntry:
        facts = self.serving.model_facts(name)
        # The same whether the model is loaded or not, and another once its files change (clients cache by it).
        digest = hashlib.sha256(f"{name}\0{facts.size}\0{facts.modified}".encode()).hexdigest()
        details = Details(format=facts.format, family=facts.family, families=[facts.family] if facts.family else [],
                          parameter_size=facts.parameter_size, quantization_level=facts.quantization)
        return ModelEntry(name=tagged(name), model=tagged(name), modified_at=timestamp(facts.modified or
                                                                                      self.serving.started),
                          size=facts.size, digest=digest, details=details, context_length=facts.context_length)
