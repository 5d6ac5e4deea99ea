"""What an API request asks for, whatever its dialect.

Each API (gateway/openai_api.py, gateway/anthropic_api.py) turns its body into
a `Plan` with the helpers here, which both share: chat messages as templates
take them, tool definitions narrowed by the tool choice, stop strings. From a
Plan and a worker, `Serving` (gateway/serving.py) builds the grammar and one
`Sampling` per choice.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec

from gateway.errors import APIError
from gateway.images import ImageSource
from gateway.parsing import arguments_object
from gateway.sampling_defaults import SamplingDefaults
from gateway.structured import OPENING, Thinking, answer_grammar, json_schema_grammar, named_tool
from protocol import Sampling
from protocol.units import parse_duration

TOKEN_ID = re.compile(r"-?[0-9]+")  # ASCII digits alone: str.isdigit takes "²", which int() refuses


@dataclass
class ChatInput:
    """A conversation: messages as chat templates take them, and its images in order."""

    messages: list[dict]
    images: list[ImageSource] = field(default_factory=list)
    template_kwargs: dict | None = None
    # The last message is the start of the assistant's answer, which the model
    # continues (Anthropic's prefill): no new turn is opened after it.
    continue_final: bool = False
    # Ollama's chats and Responses' truncation "auto": a conversation longer than
    # the context loses its oldest turns until it fits (system messages stay), not a 400.
    fit_context: bool = False
    # Ollama's /api/generate: the text a model without a chat template completes as
    # it is (Ollama's default template is the prompt alone), rather than a 400.
    untemplated: str | None = None


class DocumentStart:
    """A prompt that is only the start of a new document (OpenAI's `prompt: null`)."""


DOCUMENT_START = DocumentStart()


@dataclass
class SamplingParams:
    """The sampling a body asks for; None where it is silent (the model's defaults apply)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # with a seed, choice i samples with seed + i
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None  # token id (as text) -> bias
    logprobs: int | None = None  # how many alternatives per token, when asked for
    n: int = 1

    def samplings(self, defaults: SamplingDefaults, vocab_size: int, max_tokens: int,
                  grammar: str | None) -> list[Sampling]:
        """One Sampling per choice."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not TOKEN_ID.fullmatch(key) or not 0 <= int(key) < vocab_size:
                raise APIError(400, f"logit_bias key {key!r} is not a token id of this model (0..{vocab_size - 1})",
                               param="logit_bias")
            bias[int(key)] = value
        temperature = defaults.temperature if self.temperature is None else self.temperature
        top_p = defaults.top_p if self.top_p is None else self.top_p
        if top_p == 0:  # keeps the likeliest token alone: greedy decoding
            temperature, top_p = 0.0, 1.0
        base = Sampling(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=defaults.top_k if self.top_k is None else max(self.top_k, 0),
            min_p=defaults.min_p if self.min_p is None else self.min_p,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=defaults.repetition_penalty if self.repetition_penalty is None
            else self.repetition_penalty,
            logit_bias=bias,
            logprobs=self.logprobs,
            grammar=grammar,
        )
        if self.seed is None:
            return [base] * self.n
        return [msgspec.structs.replace(base, seed=self.seed + i) for i in range(self.n)]


@dataclass
class Plan:
    model: str
    prompt: ChatInput | str | list[int] | DocumentStart  # a conversation, a text, token ids, or nothing
    sampling: SamplingParams
    stops: list[str]
    stream: bool = False
    max_tokens: int | None = None  # None: as many as the context leaves
    max_tokens_param: str = "max_tokens"
    tools: list[dict] | None = None  # in OpenAI's function shape, narrowed by the tool choice
    force_tool_call: bool = False  # the output must be a call of one of `tools`
    # A tool asked for strict calls: under tool_choice auto, the model's calls follow their schemas too.
    strict_tools: bool = False
    parallel_tool_calls: bool = True  # False: only a choice's first call is returned
    json_output: bool = False  # the output must be JSON ...
    json_schema: dict | None = None  # ... following this schema, when there is one
    json_schema_strict: bool = False  # a keyword the grammar cannot enforce is a 400 (else it goes unenforced)
    json_schema_param: str = "response_format"  # the body's name for the output's format, for errors
    messages_param: str = "messages"  # the body's name for the conversation, for errors
    keep_alive_s: float | None = None  # how long the model stays loaded once idle (None: --keep-alive)
    # The parameter that asked the model to think, where one that cannot is a 400 (Ollama's `think`).
    thinking_param: str | None = None
    # The parameter that gave tools, where a model whose template takes none is a 400 (Ollama's `tools`).
    tools_param: str | None = None

    @property
    def prompt_param(self) -> str:
        return self.messages_param if isinstance(self.prompt, ChatInput) else "prompt"

    def grammar(self, tool_family: str | None, tokens: Mapping[str, int] | None = None,
                thinking: Thinking | None = None) -> str | None:
        """The grammar the output must follow: a forced tool call (in the
        model's tool-call format, `tool_family`; None: one with no grammar;
        `tokens`: the model's added tokens), JSON, or beside tools the model
        may call, JSON or a call (an agent asked for a typed final answer);
        after the model's reasoning, where it has a block for it (`thinking`);
        or, for strict tools, text or calls that follow their schemas (where
        the format has an opening for a call: not Llama 3's bare JSON)."""
        if self.force_tool_call and self.tools:  # a call is the answer, whatever the response_format
            if tool_family is None:
                raise APIError(400, "a forced tool_choice is not supported for this model's tool-call format; "
                               "use tool_choice auto", param="tool_choice")
            return answer_grammar(self.tools, tool_family, tokens, thinking=thinking)
        if not self.json_output:
            if self.strict_tools and self.tools and tool_family in OPENING:
                return answer_grammar(self.tools, tool_family, tokens, thinking=thinking, prose=True,
                                      several=self.parallel_tool_calls)
            return None
        answer = self.json_schema or {"type": "object"}
        if self.calls_beside_json(tool_family):
            assert self.tools is not None and tool_family is not None
            return answer_grammar(self.tools, tool_family, tokens, answer_schema=answer,
                                  answer_param=self.json_schema_param, strict=self.json_schema_strict,
                                  thinking=thinking)
        if thinking is not None:
            return answer_grammar([], "", tokens, answer_schema=answer, answer_param=self.json_schema_param,
                                  strict=self.json_schema_strict, thinking=thinking)
        return json_schema_grammar(self.json_schema, self.json_schema_param, strict=self.json_schema_strict)

    def calls_beside_json(self, tool_family: str | None) -> bool:
        """Whether a JSON response_format leaves the model its tools: where their
        calls have a grammar and do not read as JSON answers (llama3's calls
        are bare JSON objects)."""
        return bool(self.tools) and tool_family not in (None, "llama3")

    def parsed_tools(self, tool_family: str | None) -> list[dict] | None:
        """The tools whose calls are read from the output: none where a JSON
        response_format holds the answer to JSON alone (a "name" in it is data)."""
        calls = not self.json_output or self.force_tool_call or self.calls_beside_json(tool_family)
        return self.tools if calls else None


@dataclass(frozen=True)
class NamedTool:
    """A tool choice that names the one function to call."""

    name: str


def tool_definitions(tools: list[dict], choice: str | NamedTool) -> list[dict] | None:
    """The tools to render into the prompt, in OpenAI's function shape: none with
    the choice "none", only the named one with a named choice.

    choice: "auto", "none", "required" (a call of any tool), or a NamedTool.
    """
    if not tools or choice == "none":
        if choice == "required" or isinstance(choice, NamedTool):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    if isinstance(choice, NamedTool):
        return named_tool(tools, choice.name)
    return tools


def nonempty_stops(stops: list[str], param: str) -> list[str]:
    """A request's stop strings; an empty one (which would end every request at once) is a 400."""
    if any(not s for s in stops):
        raise APIError(400, f"{param}: stop strings must not be empty", param=param)
    return stops


def streamed(stream: bool | None, stream_options: object | None) -> bool:
    """Whether an OpenAI request streams; its stream_options without `stream: true` are a 400, as
    OpenAI has it (its spec: "Only set this when you set stream: true"), not options silently unused."""
    if stream_options is not None and not stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    return bool(stream)


def template_message(role: str, content: str | list[dict], tool_calls: list[dict] | None = None,
                     reasoning: str = "", **extra: str) -> dict:
    """One chat message as templates take it: its text or parts (text, image),
    the calls it made, the reasoning before them (`reasoning_content`, which
    templates that replay it render: Qwen 3's, after the last user message),
    and any other keys (tool_call_id, name)."""
    message: dict = {"role": role, "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    if reasoning:
        message["reasoning_content"] = reasoning
    message.update(extra)
    return message


def function_tool(name: str, description: str | None, parameters: dict | None) -> dict:
    """A tool in OpenAI's function shape, which chat templates expect (no parameters: an empty object's)."""
    return {"type": "function", "function": {"name": name, "description": description or "",
                                             "parameters": parameters or {"type": "object"}}}


def template_tool_call(call_id: str, name: str, arguments: str | dict) -> dict:
    """A call an assistant message made, with its arguments as an object (as
    templates expect) where the JSON text is one."""
    if isinstance(arguments, str):
        parsed = arguments_object(arguments or "{}")  # "": a call of no arguments, as some clients send it back
        arguments = arguments if parsed is None else parsed
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def reasoning_switches(effort: str | None, thinking: bool | None = None) -> dict | None:
    """The chat template's reasoning switches for an API's reasoning effort
    and thinking on/off: `reasoning_effort` (low, medium or high: stronger
    efforts are high, "minimal" and "none" are low) and `enable_thinking`
    (off for a low effort unless `thinking` says otherwise). A template
    without such a switch ignores it."""
    kwargs: dict = {}
    if effort is not None:
        low = effort in ("none", "minimal", "low")
        kwargs["reasoning_effort"] = "low" if low else "medium" if effort == "medium" else "high"
        kwargs["enable_thinking"] = not low
    if thinking is not None:
        kwargs["enable_thinking"] = thinking
    return kwargs or None


def keep_alive_seconds(value: str | float | None) -> float | None:
    """A body's `keep_alive` in seconds (math.inf: forever); a 400 for one that is not a duration."""
    if value is None:
        return None
    try:
        return parse_duration(value)
    except ValueError as e:
        raise APIError(400, f"keep_alive: {e}", param="keep_alive") from None
