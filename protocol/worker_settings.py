"""How a worker is configured. It lives here, not in worker/, because `mlxd serve`
(gateway side) launches workers and must speak their flags without importing them."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from protocol.endpoints import default_worker_endpoint
from protocol.log_file import LogSettings

# The embedded default model, and the name a worker serves it under.
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def worker_command(arguments: list[str]) -> list[str]:
    """The command line that runs the worker program with `arguments`. With -P
    Python leaves the current directory off the module path: a worker.py
    where mlxd was started (a Celery project's) never runs in its place."""
    return [sys.executable, "-P", "-m", "worker", *arguments]


def cache_dir() -> Path:
    """mlxd's cache: imported and pulled models (models/), downloads, digests."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mlxd"


def pulled_model(name: str) -> Path | None:
    """The directory of the model `mlxd pull` cached as `name`, if there is one."""
    path = cache_dir() / "models" / name
    return path if name and "/" not in name and (path / "config.json").is_file() else None


def is_repo_id(source: str) -> bool:
    """Whether a --model value that names no file is a Hugging Face repo id (owner/name)."""
    return source.count("/") == 1 and not source.startswith((".", "/", "~")) and not source.endswith(".gguf")


class WorkerSettings(LogSettings, kw_only=True):
    model: Annotated[
        str,
        Meta(
            description="model to serve, as SOURCE or NAME=SOURCE (NAME: what clients ask for; default: "
            "SOURCE): an mlx-lm model directory, a .gguf file, a Hugging Face repo id, or the NAME of a model "
            "`mlxd pull` fetched (default: the embedded SmolLM2-135M-Instruct)"
        ),
    ] = ""
    worker_endpoint: Annotated[
        str, Meta(description="ZeroMQ endpoint of the gateway to connect to")
    ] = default_worker_endpoint()
    max_batch: Annotated[
        int, Meta(ge=1, description="requests decoded together in one batch (the worker's capacity)")
    ] = 32
    prefill_batch: Annotated[int, Meta(ge=1, description="prompts prefilled together in one step")] = 8
    prefill_chunk: Annotated[
        int, Meta(ge=16, description="prompt tokens per prefill step; bounds how long one step takes")
    ] = 2048
    context_length: Annotated[
        Annotated[int, Meta(ge=2)] | None, Meta(description="cap on the model's context length in tokens")
    ] = None
    cpu_dequantize: Annotated[
        bool,
        Meta(description="on MLX's CPU backend, run quantized models as float32 (much faster with BLAS)"),
    ] = True
    prefix_cache_bytes: Annotated[
        int, Meta(ge=0, description="memory for KV state kept to reuse shared prompt prefixes (a vision model "
                                    "keeps image features in an eighth of it); 0 turns it off")
    ] = 1 << 30
    prefix_cache_dir: Annotated[
        str | None,
        Meta(description="directory for KV state kept on disk across worker restarts (0700; blocks of 256 tokens "
                         "under the model's identity); unset: RAM only"),
    ] = None
    prefix_cache_disk_bytes: Annotated[
        int, Meta(ge=0, description="disk space for --prefix-cache-dir; the least recently used blocks go beyond it")
    ] = 10 << 30
    memory_limit_bytes: Annotated[
        int | None,
        Meta(description="MLX's memory limit for this worker (`mlxd serve` sets it to the model's share of "
                               "--memory-budget): MLX frees its buffer cache and waits on running work before growing past it"),
    ] = None
    heartbeat_s: Annotated[float, Meta(gt=0, description="seconds between heartbeats")] = 0.5
    drain_s: Annotated[
        float,
        Meta(ge=0, description="on SIGTERM, how long running requests may finish before they are handed back"),
    ] = 5.0
    parent_pid: Annotated[
        int | None, Meta(description="stop when this process is gone (`mlxd serve` sets it to itself)")
    ] = None
    curve_secret_key: Annotated[
        str | None, Meta(description="the worker's CURVE secret key file (`mlxd keys generate`); needed for tcp://")
    ] = None
    curve_server_key: Annotated[
        str | None, Meta(description="the gateway's CURVE public key file; needed for tcp://")
    ] = None
    distributed_hosts: Annotated[
        str,
        Meta(description="serve the model as one worker made of an mx.distributed group: one rank per "
                         "comma-separated IP address, rank 0 first (this machine; 127.0.0.1 for ranks on this "
                         "machine); each rank holds a shard of the model"),
    ] = ""
    distributed_backend: Annotated[
        Literal["ring", "jaccl"],
        Meta(description="the group's MLX backend: ring (TCP, any network) or jaccl (RDMA over Thunderbolt 5)"),
    ] = "ring"
    distributed_port: Annotated[
        int, Meta(ge=1, le=65535, description="the group's first TCP port; rank k listens on this + k (with "
                                              "several --model, the m-th model's group on this + m x hosts + k)")
    ] = 32323
    sharding: Annotated[
        Literal["tensor", "pipeline"],
        Meta(description="how the group splits the model: tensor (every layer across the ranks) or pipeline "
                         "(a run of layers per rank)"),
    ] = "tensor"
    group_stall_s: Annotated[
        float,
        Meta(gt=0, description="in a distributed group, how long a rank waits at one of the ranks' exchanges "
                               "between steps (which take them milliseconds) before it takes another rank as gone "
                               "and exits, for its service to start it again: MLX's ring backend may wait for good"),
    ] = 30.0


def group_hosts(settings: WorkerSettings) -> int:
    """The machines a worker's model is split across: its --distributed-hosts
    (a comma-separated list, or a JSON hostfile's entries), else 1."""
    spec = settings.distributed_hosts
    if not spec:
        return 1
    if spec.endswith(".json"):
        try:
            return max(1, len(json.loads(Path(spec).read_text())))
        except (OSError, ValueError, TypeError):
            return 1  # the worker says what is wrong with it when it starts
    return max(1, len([host for host in spec.split(",") if host.strip()]))


def model_workers(base: WorkerSettings, models: list[str]) -> list[WorkerSettings]:
    """A worker's settings for each model; with --distributed-hosts, each
    model's group on ports of its own, the next model's after the one
    before's: two groups listening on one port join each other's ranks."""
    hosts = group_hosts(base) if base.distributed_hosts else 0
    workers = [msgspec.structs.replace(base, model=model, distributed_port=base.distributed_port + i * hosts)
               for i, model in enumerate(models)]
    if workers[-1].distributed_port + hosts - 1 > 65535:
        raise ValueError(f"--distributed-port: {len(models)} groups of {hosts} ranks need ports "
                         f"{base.distributed_port}-{workers[-1].distributed_port + hosts - 1}, past 65535")
    return workers


def split_model(value: str) -> tuple[str, str]:
    """A --model value as (NAME, SOURCE): `NAME=SOURCE`, or a bare SOURCE with no
    name of its own ("") — a NAME holds no `/`, so a path or repo id with `=` stays whole."""
    name, equals, source = value.partition("=")
    if equals and name and "/" not in name:
        return name, source
    return "", value


def model_source(settings: WorkerSettings) -> str:
    """What the worker loads ("" for the embedded default)."""
    return split_model(settings.model)[1]


def announced_name(settings: WorkerSettings) -> str:
    """The model name a worker with these settings announces in its Hello."""
    name, source = split_model(settings.model)
    return name or source or DEFAULT_MODEL_NAME
