"""The served model's recommended sampling, for requests that leave it out.

Read from the model's generation_config.json (which the worker sends in its
Hello with the tokenizer files), as vLLM and Ollama do: a model tuned to be
sampled at temperature 0.2 gives nonsense at the APIs' own default of 1.0.
Only the keys a request can also set are taken (`do_sample` is not: an
explicit temperature decides), and a value out of range is ignored.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated

import msgspec
from msgspec import Meta

log = logging.getLogger("mlxd.gateway")


class SamplingDefaults(msgspec.Struct, frozen=True):
    """What a request that says nothing gets: the APIs' defaults unless the model recommends others."""

    temperature: Annotated[float, Meta(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Meta(ge=0)] = 0
    min_p: Annotated[float, Meta(ge=0, le=1)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0, le=10)] = 1.0


def sampling_defaults(files: dict[str, bytes]) -> SamplingDefaults:
    """The defaults from a model's generation_config.json, key by key."""
    raw = files.get("generation_config.json")
    if raw is None:
        return SamplingDefaults()
    try:
        config = json.loads(raw)
    except ValueError as e:
        log.warning("ignored the model's generation_config.json: %s", e)
        return SamplingDefaults()
    if not isinstance(config, dict):
        return SamplingDefaults()
    taken = {}
    for name in SamplingDefaults.__struct_fields__:
        if name not in config:
            continue
        try:
            msgspec.convert({name: config[name]}, SamplingDefaults)
        except msgspec.ValidationError as e:
            log.warning("ignored %s=%r from the model's generation_config.json: %s", name, config[name], e)
            continue
        taken[name] = config[name]
    return msgspec.convert(taken, SamplingDefaults)
