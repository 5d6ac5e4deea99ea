"""The served model's tokenizer, rebuilt in the gateway from the worker's Hello;
with a vision model, its processor too (image preprocessing runs here, never
on the worker's main thread).

Tokenizing a long prompt and preprocessing images can take milliseconds:
callers run them in a thread (a short prompt, quicker than the hop to a
thread and back, on the event loop: gateway/serving.py). Detokenizing a
step's tokens takes microseconds and runs on the event loop.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
from jinja2 import TemplateError
from tokenizers import Tokenizer as RustTokenizer
from tokenizers.decoders import DecodeStream

from gateway.call_ids import Style, call_id_style, fit_call_ids
from gateway.parsing import detect_reasoning, detect_tool_family
from gateway.pixtral import PixtralProcessor
from protocol import Tensor
from protocol.codec import TENSOR_DTYPES, files_digest, images_key

if TYPE_CHECKING:
    from transformers import ProcessorMixin

# transformers warns at import that PyTorch is missing; the gateway only needs
# its tokenizers and image processors, so that warning is noise (for the
# workers too, which inherit this environment and import it through mlx-lm).
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# What a processor makes of the prompt rather than its images: the token ids
# travel as such, and per-token masks would make the images' tensors (and so
# their cache keys in the worker) depend on the text around them.
PROMPT_ARRAYS = {"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"}


# transformers installs a lazy module in sys.modules before its import ends: a
# second thread's `import transformers` meanwhile gets it half made (no
# AutoTokenizer yet). Every import of it here goes through this lock.
_TRANSFORMERS_IMPORT = threading.Lock()


def transformers_module() -> ModuleType:
    """transformers, imported at its first use: its import is most of the
    gateway's start (over a second here), which `mlxd serve` spends beside
    its worker's own start (gateway/app.py) rather than before it."""
    with _TRANSFORMERS_IMPORT:
        import transformers
        _ = transformers.AutoTokenizer  # its lazy submodules, under the lock too
    return transformers


@functools.cache
def reserved_template_kwargs() -> frozenset[str]:
    """What a client's chat_template_kwargs may not set: apply_chat_template's
    own arguments (a template of the client's own, tokenizing, the
    conversation) and the messages the server renders."""
    apply = transformers_module().PreTrainedTokenizerBase.apply_chat_template
    return (frozenset(inspect.signature(apply).parameters) - {"self", "kwargs"}) | {"messages"}


class PromptError(ValueError):
    """A prompt the tokenizer or chat template cannot render; a 400 for the client."""


@dataclass
class Prompt:
    """A rendered prompt, its token ids and, with images, the arrays the
    vision model takes (their Tensor descriptions and their data)."""

    text: str
    token_ids: list[int]
    tensors: list[Tensor] = field(default_factory=list)
    arrays: list[np.ndarray] = field(default_factory=list)
    images_key: int = 0  # protocol.codec.images_key of the arrays


def _text_of(content: str | list[dict]) -> str:
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def _template_content(content: str | list[dict], vision: bool) -> str | list[dict]:
    """A message's content (text, or a list of text and image parts) as the
    chat template takes it: vision models' templates take the parts, text
    models' a string."""
    return content if vision else _text_of(content)


def _system_first(messages: list[dict]) -> list[dict]:
    """The messages with every system message's content joined, in order, into
    one leading system message; the same list when at most the first message
    is a system message, or when one to be moved holds an image (it would
    come before images it follows, which the processor pairs in order)."""
    systems = [m for m in messages if m["role"] == "system"]
    if not systems or systems == [messages[0]]:
        return messages
    moved = [m for m in systems if m is not messages[0]]
    if any(isinstance(m["content"], list) and any(p.get("type") == "image" for p in m["content"]) for m in moved):
        return messages
    contents = [m["content"] for m in systems]
    if all(isinstance(c, str) for c in contents):
        joined: str | list[dict] = "\n\n".join(contents)
    else:
        parts = [[{"type": "text", "text": c}] if isinstance(c, str) else c for c in contents]
        joined = [part for i, p in enumerate(parts) for part in ([{"type": "text", "text": "\n\n"}] if i else []) + p]
    return [{"role": "system", "content": joined}, *(m for m in messages if m["role"] != "system")]


def load_processor(directory: str, tokenizer: Any) -> ProcessorMixin | PixtralProcessor:
    """The model's processor, from its files in `directory`. One whose video
    half needs PyTorch (Qwen2-VL's, SmolVLM's) is built from its image
    processor, the tokenizer and its own settings alone: mlxd sends it images
    only. Pixtral's needs PyTorch throughout; gateway.pixtral stands in."""
    transformers = transformers_module()
    try:
        return transformers.AutoProcessor.from_pretrained(directory)
    except ImportError:
        name = _settings(directory, "preprocessor_config.json").get("processor_class", "")
        if name == "PixtralProcessor":  # all of it needs PyTorch: mlxd's own
            return PixtralProcessor(transformers.AutoImageProcessor.from_pretrained(directory), tokenizer,
                                    _settings(directory, "processor_config.json"),
                                    _settings(directory, "chat_template.json").get("chat_template"))
        processor_class = getattr(transformers, name, None)
        if processor_class is None:
            raise
    # The class checks each part's type against its video processor's, which
    # is what cannot load; the parts given here are the ones that did.
    images_only = type(processor_class.__name__, (processor_class,),
                       {"check_argument_for_proper_class": lambda self, name, argument: type(argument)})
    settings = {k: v for k, v in _settings(directory, "processor_config.json").items() if k != "processor_class"}
    settings.setdefault("chat_template", _settings(directory, "chat_template.json").get("chat_template"))
    return images_only(image_processor=transformers.AutoImageProcessor.from_pretrained(directory), tokenizer=tokenizer,
                       video_processor=None, **settings)


def image_tokens(processor: Any) -> list[str]:
    """The text of each token that stands for an image in this processor's
    prompts: the placeholder a template writes, and the tokens the processor
    expands it to (Gemma 3's `<start_of_image>` becomes `<image_soft_token>`s)."""
    found = [getattr(owner, name, None) for owner in (processor, processor.tokenizer)
             for name in ("image_token", "boi_token", "video_token")]
    return list(dict.fromkeys(t for t in found if isinstance(t, str) and t))


def _settings(directory: str, name: str) -> dict:
    """A processor's JSON file (as AutoProcessor would read it); {} if there is none."""
    path = Path(directory) / name
    return json.loads(path.read_text()) if path.exists() else {}


class Tokenizer:
    def __init__(self, files: dict[str, bytes], vision: bool = False) -> None:
        self.digest = files_digest(files)
        self.processor = None
        with tempfile.TemporaryDirectory(prefix="mlxd-tokenizer-") as tmp:
            for name, data in files.items():
                (Path(tmp) / Path(name).name).write_bytes(data)
            self._tok = transformers_module().AutoTokenizer.from_pretrained(tmp)
            # The Rust tokenizer itself: streamed tokens are decoded by it
            # (IncrementalDetokenizer), and transformers' decode wraps it in a
            # Python layer that costs three times the decode.
            rust = getattr(self._tok, "backend_tokenizer", None)
            if rust is None:
                raise PromptError(f"the model's tokenizer ({type(self._tok).__name__}) has no fast (Rust) "
                                  "version, which the gateway needs to stream its text")
            self.rust: RustTokenizer = rust
            # Logprobs' tokens, each decoded once (a cache of this tokenizer's own, gone with it).
            self.token_text = functools.lru_cache(maxsize=1 << 16)(self.token_text)  # type: ignore[method-assign]
            if vision:
                self.processor = load_processor(tmp, self._tok)
                # Vision models often keep their chat template with the processor.
                self._tok.chat_template = self._tok.chat_template or self.processor.chat_template

    @functools.cached_property
    def added_tokens(self) -> dict[str, int]:
        """Every token added to the base vocabulary (special or not): its id by its text."""
        return {token.content: token_id for token_id, token in self.rust.get_added_tokens_decoder().items()}

    @property
    def chat_template(self) -> str:
        """The model's chat template ("" without one); Ollama's /api/show shows it."""
        template = self._tok.chat_template
        return template if isinstance(template, str) else ""

    @property
    def every_template(self) -> str:
        """Every chat template the model has, named ones too (a `tool_use` one beside the default), as one
        text: where the gateway looks for what they render."""
        templates = self._tok.chat_template
        if isinstance(templates, dict):
            return "\n".join(str(t) for t in templates.values())
        if isinstance(templates, list):
            return "\n".join(str(t.get("template", "")) for t in templates if isinstance(t, dict))
        return templates or ""

    @property
    def has_chat_template(self) -> bool:
        return bool(self._tok.chat_template)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    template_kwargs: dict | None = None, continue_final: bool = False) -> str:
        """The prompt text: messages (and tools) through the model's chat template.

        A message's content is its text, or a list of parts ({"type": "text", "text": ...}, {"type": "image"}).
        """
        if not self.has_chat_template:
            raise PromptError("this model has no chat template; use /v1/completions")
        if not messages:
            raise PromptError("there is nothing to answer: the conversation has no message with content")
        if reserved := sorted(reserved_template_kwargs().intersection(template_kwargs or ())):
            raise PromptError(f"chat_template_kwargs may not set {', '.join(reserved)}: the server renders the "
                              "model's own chat template over the request's messages")
        template_tools: list[dict[str, Any] | Callable[..., Any]] | None = list(tools) if tools else None
        vision = self.processor is not None
        messages = [{**m, "content": _template_content(m["content"], vision)}
                    for m in fit_call_ids(messages, self._call_id_style)]
        # A template that rewrites the last message's text cannot continue it (transformers
        # finds it no more): the answer then opens a turn of its own, as without a prefill.
        # One that refuses a system message anywhere but first (Qwen 3.5's), where Claude Code
        # and Codex put them, gets every system message's text in one leading message.
        continuations = dict.fromkeys((continue_final, False))
        attempts = [(messages, c) for c in continuations]
        if (leading := _system_first(messages)) is not messages:
            attempts += [(leading, c) for c in continuations]
        error: Exception | None = None
        for attempt, continuing in attempts:
            try:
                text = self._tok.apply_chat_template(
                    attempt, tools=template_tools, add_generation_prompt=not continuing,
                    continue_final_message=continuing, tokenize=False, **(template_kwargs or {})
                )
                break
            except (TemplateError, TypeError, ValueError) as e:  # the last two: chat_template_kwargs it cannot use
                error = error or e
            except RecursionError:  # transformers and the template walk nested values recursively
                raise PromptError("the messages or tools nest values too deeply for the chat template") from None
        else:
            raise PromptError(f"the model's chat template rejected these messages: {error}") from None
        assert isinstance(text, str)  # tokenize=False
        return text

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None,
                    template_kwargs: dict | None = None, images: list | None = None,
                    continue_final: bool = False) -> Prompt:
        """The rendered prompt and its token ids; with images (one per image
        part of the messages, in order), each image placeholder expanded to
        the image's tokens, and the arrays the vision model takes."""
        text = self.render_chat(messages, tools, template_kwargs, continue_final)
        if not images:
            # encode_batch_fast, not encode: it lets go of the GIL while it works (encode
            # holds it: an agent's 100k-token context would stop every stream for a tenth
            # of a second or more, thread or not) and skips the offsets nobody reads.
            return Prompt(text, self.rust.encode_batch_fast([text], add_special_tokens=False)[0].ids)
        assert self.processor is not None, "images reach only a vision model's tokenizer"
        # Written in what the template renders (a message, a tool's definition, a call's
        # arguments), an image token is an image position more than the images fill.
        written = "".join(_text_of(m["content"]) for m in messages) + json.dumps(
            [tools, [m.get("tool_calls") for m in messages]], ensure_ascii=False, default=str)
        if held := [token for token in image_tokens(self.processor) if token in written]:
            raise PromptError(f"the request's text (its messages, tools or tool calls) holds the model's image "
                              f"token {held[0]!r}, which stands for an image here; write it otherwise")
        # Some templates leave out the images of some messages (Gemma 3's and Mistral's
        # of a system message), and some processors then fill the placeholders left
        # with the first images: the model would be shown another image than asked.
        placeholder = getattr(self.processor, "boi_token", None) or getattr(self.processor, "image_token", None)
        if isinstance(placeholder, str) and placeholder and (placed := text.count(placeholder)) != len(images):
            raise PromptError(f"the model's chat template placed {placed} of the request's {len(images)} images "
                              "in the prompt (templates leave out images in some messages, such as a system "
                              "message's); send images in user messages")
        try:
            out = self.processor(text=[text], images=images, return_tensors="np", add_special_tokens=False)
        except (ValueError, TypeError) as e:
            raise PromptError(f"the model's processor rejected these images: {e}") from None
        tensors, arrays = [], []
        for name, value in out.items():
            if name in PROMPT_ARRAYS:
                continue
            array = np.ascontiguousarray(value)
            if array.dtype == np.float64:
                array = array.astype(np.float32)
            if array.dtype.name not in TENSOR_DTYPES:
                raise PromptError(f"the model's processor made {name} of dtype {array.dtype}, which mlxd cannot send")
            tensors.append(Tensor(name, list(array.shape), array.dtype.name))
            arrays.append(array)
        return Prompt(text, out["input_ids"][0].tolist(), tensors, arrays, images_key(arrays))

    def encode_text(self, text: str, limit: int | None = None) -> list[int]:
        """limit: at most so many tokens, the text's end cut off and what the tokenizer
        adds around it (an embedding model's EOS, which it pools on) kept."""
        # As mlx-lm does: add the BOS token unless the prompt already starts with it.
        bos = self._tok.bos_token
        special = bos is None or not text.startswith(bos)
        ids = self._tok.encode(text, add_special_tokens=special)
        if limit is None or len(ids) <= limit:
            return ids
        # Cut here, not by the tokenizer's own truncation: that is a setting of the
        # tokenizer every thread shares, and a text tokenized meanwhile in another
        # thread was cut by this one's limit, or this one not at all.
        around = self._tok.encode("", add_special_tokens=special)  # what it adds before and after a text
        before = next(k for k in range(len(around), -1, -1) if ids[:k] == around[:k])
        after = len(around) - before
        return ids[:max(limit - after, before)] + ids[len(ids) - after:]

    def encode_texts(self, texts: list[str], limit: int | None = None) -> list[list[int]]:
        """Each text as encode_text makes it: a request's inputs in one call (and one thread)."""
        return [self.encode_text(text, limit) for text in texts]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.rust.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text as it reads inside a text (logprobs' tokens): a
        SentencePiece tokenizer decodes a word's token alone without its
        leading space, so it is decoded after a plain letter and that is taken off.
        A special token reads as itself (`<|im_end|>`): an empty string among
        the likeliest tokens would not say that the model weighed ending there."""
        anchor = self.rust.token_to_id("a")
        if anchor is None:
            return self.decode([token_id], False)
        return self.decode([anchor, token_id], False).removeprefix(self.decode([anchor], False))

    def token_bytes(self, token_id: int) -> bytes:
        """One token's bytes (logprobs' `bytes`): its text's, unless it holds
        only part of a character (its text reads U+FFFD), whose bytes the
        vocabulary entry gives: SentencePiece's byte tokens (`<0xE2>`), or
        byte-level BPE's characters, one per byte."""
        text = self.token_text(token_id)
        piece = self.rust.id_to_token(token_id)
        if "\ufffd" not in text or piece is None:
            return text.encode()
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            with contextlib.suppress(ValueError):
                return bytes([int(piece[3:5], 16)])
        byte_of_char = _byte_of_char()
        if all(c in byte_of_char for c in piece):
            return bytes(byte_of_char[c] for c in piece)
        return text.encode()

    @functools.cached_property
    def tool_family(self) -> str:
        return detect_tool_family(self._tok.chat_template or "")

    @functools.cached_property
    def _call_id_style(self) -> Style:
        return call_id_style(self.chat_template)

    @functools.cached_property
    def reasoning_markers(self) -> tuple[str, str] | None:
        return detect_reasoning(self._tok.chat_template or "", set(self._tok.get_vocab()))


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE (GPT-2's scheme) writes each byte of a token as one character."""
    transformers_module()
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    return {char: byte for byte, char in bytes_to_unicode().items()}


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas, exact at every step.

    tokenizers' own DecodeStream (Rust) does the work: it holds back a token
    that ends inside a multi-byte character, or whose text depends on the
    next one, until its text is certain. Measured at 1.30 us a token against
    2.72 us for decoding a window of recent tokens twice in Python (SmolLM2,
    one token at a time, identical text; docs/benchmarks.md). At the end, what it still
    holds back (a character the output never completed) is flushed as a full
    decode shows it: U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        # Kept when parsing tool calls or reasoning, whose markers may be special tokens.
        self._skip_special = skip_special_tokens
        self._step = DecodeStream(skip_special_tokens=skip_special_tokens).step
        self._rust = tokenizer.rust
        self._held: list[int] = []  # tokens whose text the stream has not given yet

    def add(self, token_ids: list[int]) -> str:
        text = ""
        for token_id in token_ids:  # usually one: a step's new token
            piece = self._step(self._rust, token_id)
            if piece is None:
                self._held.append(token_id)
            else:
                if self._held:
                    self._held = []
                text += piece
        return text

    def flush(self) -> str:
        held, self._held = self._held, []
        return self._tokenizer.decode(held, self._skip_special) if held else ""
