"""The worker process's start, on its main thread: load the model (or tell
the gateway why it cannot), build the engine and the Hello, and hand over to
the serving loop (worker/serve.py) until a signal drains it.

With --distributed-hosts, the process started without MLX_RANK starts the
group (worker/group.py); each rank it starts comes here with MLX_RANK set,
joins the mx.distributed group and loads its shard. Rank 0 serves the
gateway; the others follow it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import signal
import threading
import time
from pathlib import Path

import mlx.core as mx
import zmq

from protocol import EXIT_LOAD_FAILED, PROTOCOL_VERSION, Hello, LoadFailed, encode
from protocol.codec import files_digest
from protocol.packages import MLX_PACKAGES, installed_version
from protocol.worker_settings import WorkerSettings, model_source, split_model
from worker.audit import AffinityAudit
from worker.collective import (
    RankChannel,
    RankSetup,
    RankState,
    group_differences,
    prefix_cache_budget,
    summed_footprint,
    this_rank,
)
from worker.disk_cache import DiskCache, layout_of, open_directory
from worker.embed import UnsupportedPooling, embedder_for, pooling_of
from worker.engine import Engine
from worker.footprint import kv_footprint, probe_cache, set_limits, weights_bytes
from worker.grammar import Grammars
from worker.model import LoadedModel, Sharding, load_model
from worker.model_source import ModelNotFound
from worker.prefix_cache import PrefixCache
from worker.serve import Follower, Worker
from worker.transport import TransportError, connect
from worker.vision import FeatureCache, VisionPrefill

log = logging.getLogger("mlxd.worker")

# What a worker's log says before the reason it cannot load its model: a group's
# launcher reads another rank's reason there (worker.group).
LOAD_FAILURE_LOGGED = "cannot load the model: "
# How long a worker that cannot load its model tries to tell the gateway why.
LOAD_FAILED_DELIVERY_MS = 2000
# Rank 0 of a group learns the pid the gateway knows the worker by, its
# launcher's (worker/group.py): a hung group is killed by it.
GROUP_PID_ENV = "MLXD_GROUP_PID"
# Beside MLX_PACKAGES, what every rank of a group must run alike (rank_setup): what turns text into
# tokens and grammars into masks.
GROUP_PACKAGES = ("transformers", "tokenizers", "llguidance")


def load_failed(settings: WorkerSettings, reason: str) -> int:
    """Tell the gateway why this worker cannot serve (it shows the reason in
    /health and its 503s; `mlxd serve` stops with it), then exit. A rank
    other than 0 of a group only logs it: rank 0 alone speaks to the gateway."""
    log.error("%s%s", LOAD_FAILURE_LOGGED, reason)
    if os.environ.get("MLX_RANK", "0") != "0":
        return EXIT_LOAD_FAILED
    context = zmq.Context()
    try:
        socket = connect(context, settings, f"worker-{time.time_ns()}-failed")
    except TransportError as e:
        log.error("%s", e)
    else:
        if socket.poll(LOAD_FAILED_DELIVERY_MS, zmq.POLLOUT):
            socket.send(encode(LoadFailed(os.getpid(), settings.model, reason)))
        socket.close(linger=LOAD_FAILED_DELIVERY_MS)
    context.term()
    return EXIT_LOAD_FAILED


def serve(settings: WorkerSettings, *, audit: bool) -> int:
    affinity = AffinityAudit().install() if audit else None
    if affinity:
        log.info("affinity audit on: every MLX evaluation's thread is recorded")
    channel, sharding = None, None
    if settings.distributed_hosts:
        if settings.prefix_cache_dir:  # each rank's disk could fail apart from the others', and the ranks part ways
            return load_failed(settings, "--prefix-cache-dir is not available to a distributed group")
        # MLX waits for every rank, without a bound: a rank missing (its number taken twice, a hostfile of
        # another length) leaves this one waiting, which the log should say.
        log.info("rank %s of the group in %s: waiting for the other ranks", os.environ.get("MLX_RANK", "?"),
                 settings.distributed_hosts)
        try:
            group = mx.distributed.init(backend=settings.distributed_backend, strict=True)
        except RuntimeError as e:  # a port in use, a host that never answered, no RDMA device
            return load_failed(settings, f"cannot join the distributed group: {e}")
        finally:
            if GROUP_PID_ENV in os.environ:  # mlxd's own launcher wrote these for MLX, in temporary files
                for written in ("MLX_HOSTFILE", "MLX_IBV_DEVICES"):
                    with contextlib.suppress(KeyError, OSError):
                        os.unlink(os.environ[written])
        channel, sharding = RankChannel(group), Sharding(group, settings.sharding == "pipeline")
        _stop_with_parent(settings.parent_pid)
        log.info("rank %d of %d", group.rank(), group.size())
    cache_dir = None
    if settings.prefix_cache_dir:
        try:
            cache_dir = open_directory(Path(settings.prefix_cache_dir))
        except (OSError, ValueError) as e:
            return load_failed(settings, f"--prefix-cache-dir: {e}")
    started = time.monotonic()
    loaded: LoadedModel | None = None
    failure = ""
    try:
        loaded = load_model(model_source(settings), settings.context_length, settings.cpu_dequantize, sharding)
    except (ModelNotFound, OSError, ValueError) as e:  # GGUFError is a ValueError
        failure = str(e)
    except Exception as e:  # an unexpected failure in a loader: the reason still reaches the operator
        log.exception("loading the model failed")
        return load_failed(settings, f"{type(e).__name__}: {e}")
    ranks = []
    if channel is not None:
        assert sharding is not None
        if loaded is None and not sharding.loaded:
            try:
                channel.meet_load_barrier()
            except RuntimeError:  # MLX's: another rank is gone too; this one's reason is all there is
                return load_failed(settings, failure)
        mine = RankSetup(this_rank(channel.rank), rank_setup(loaded, settings) if loaded else {}, failure)
        setups = channel.gather(mine)
        if failed := [s for s in setups if s.failure]:  # every rank says why, rank 0 to the gateway
            return load_failed(settings, "; ".join(f"rank {s.rank.rank} ({s.rank.host}) cannot load "
                                                   f"{settings.model}: {s.failure}" for s in failed))
        if differing := group_differences(setups):  # every rank sees it, and every rank stops
            return load_failed(settings, f"the ranks of {settings.model} differ in their {differing}: give every "
                                         "host the same snapshot of the model, the same install and the same flags")
        ranks = [s.rank for s in setups]
    if loaded is None:
        return load_failed(settings, failure)
    log.info("loaded %s from %s in %.1fs", loaded.name, loaded.path, time.monotonic() - started)
    weights = weights_bytes(loaded.model)
    set_limits(settings.memory_limit_bytes, weights)
    vision = None
    prefix_cache_bytes = settings.prefix_cache_bytes
    if loaded.image_token_id is not None:
        # An eighth of the reuse budget keeps image features, the rest KV state.
        features = FeatureCache(prefix_cache_bytes // 8) if prefix_cache_bytes else None
        prefix_cache_bytes -= features.budget if features else 0
        vision = VisionPrefill(loaded.model, loaded.image_token_id, settings.prefill_chunk, features)
    text_model = vision.language_model if vision else loaded.model
    probed = probe_cache(text_model)
    footprint = kv_footprint(probed)
    if channel is not None:
        states = channel.gather(RankState(weights, footprint, prefix_cache_bytes))
        weights, footprint = sum(s.weights_bytes for s in states), summed_footprint(states)
        prefix_cache_bytes = prefix_cache_budget(states, channel.rank, loaded.context_length)
    disk = None
    if cache_dir:
        try:
            disk = DiskCache(cache_dir, settings.prefix_cache_disk_bytes, model_identity(loaded), layout_of(probed))
        except (OSError, ValueError) as e:  # its model's directory in it: not this user's own, not writable
            return load_failed(settings, f"--prefix-cache-dir: {e}")
    engine = Engine(
        text_model,
        eos_token_ids=loaded.eos_token_ids,
        vocab_size=loaded.vocab_size,
        context_length=loaded.context_length,
        capacity=settings.max_batch,
        prefill_batch_size=settings.prefill_batch,
        prefill_step_size=settings.prefill_chunk,
        grammars=Grammars(loaded.hf_tokenizer, loaded.vocab_size, loaded.eos_token_ids),
        prefix_cache=PrefixCache(prefix_cache_bytes, disk, windowed=bool(footprint.windowed),
                                 agree=channel.common_prefix if channel else None)
        if prefix_cache_bytes or disk else None,
        vision=vision,
    )
    embedder = embedder_for(loaded.model, loaded.path) if not vision else None
    if channel is not None:
        channel.watch(settings.group_stall_s)
    if channel is not None and channel.rank > 0:
        # A terminal's Ctrl-C reaches every process of its group: rank 0
        # drains, and tells this rank when to exit.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return Follower(engine, embedder, channel).run()
    hello = Hello(
        protocol_version=PROTOCOL_VERSION,
        epoch=time.time_ns(),
        pid=int(os.environ.get(GROUP_PID_ENV, os.getpid())) if channel else os.getpid(),
        model=split_model(settings.model)[0] or loaded.name,
        context_length=loaded.context_length,
        vocab_size=loaded.vocab_size,
        capacity=settings.max_batch,
        eos_token_ids=loaded.eos_token_ids,
        tokenizer_files=loaded.tokenizer_files,
        vision=vision is not None,
        model_digest=loaded.digest,
        tool_parser=loaded.tool_parser,
        reasoning_markers=loaded.reasoning_markers,
        weights_bytes=weights,
        kv_footprint=footprint,
        ranks=ranks,
    )
    try:
        worker = Worker(settings, engine, hello, affinity, embedder, channel)
    except TransportError as e:
        log.error("%s", e)
        return 1

    def stop(signum, _frame):
        log.info("received %s; draining for up to %gs", signal.Signals(signum).name, settings.drain_s)
        worker.drain(settings.drain_s)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("serving %s on %s", loaded.name, settings.worker_endpoint)
    try:
        return worker.run()
    finally:
        if disk is not None:
            disk.close()


def _stop_with_parent(parent_pid: int | None) -> None:
    """A rank waiting in a collective never returns to its loop to notice
    that its group's process is gone: a thread (no MLX) ends it instead."""
    if parent_pid is None:
        return

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        log.error("the group's process is gone; exiting")
        os._exit(1)

    threading.Thread(target=watch, name="mlxd-parent-watch", daemon=True).start()


def rank_setup(loaded: LoadedModel, settings: WorkerSettings) -> dict[str, str]:
    """What every rank of a group must share, part by part, each a digest:
    the weights, the tokenizer's files (generation_config.json's
    end-of-sequence ids among them), the embeddings' pooling, the versions of
    what runs them, and the flags that shape the engine's batches. A rank
    that ended a request at another token, refused a grammar, pooled
    otherwise or batched otherwise would run other steps than the others
    (ranks started by hand, a launchd job per Mac, each have their own flags)."""
    try:
        pooling = repr(pooling_of(loaded.path))
    except UnsupportedPooling as e:
        pooling = str(e)
    return {
        "weights": loaded.digest,
        "tokenizer files": files_digest(loaded.tokenizer_files).hex(),
        "embeddings' pooling": _digest(pooling),
        "package versions": _digest([(p, installed_version(p)) for p in (*MLX_PACKAGES, *GROUP_PACKAGES)]),
        "engine flags (context length, --max-batch, --prefill-batch, --prefill-chunk, --sharding)": _digest(
            [loaded.context_length, settings.max_batch, settings.prefill_batch, settings.prefill_chunk,
             settings.sharding]),
    }


def _digest(value: object) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()


def model_identity(loaded: LoadedModel) -> bytes:
    """What KV state on disk is filed under: the weights' digest, the
    tokenizer's files (its chat template among them) and the versions of the
    MLX packages and of mlxd (its own positions for images, its dequantizing),
    which compute the state, so that blocks of another model, quantization or
    template, or of a model's code before an upgrade, never match."""
    identity = hashlib.sha256(loaded.digest.encode())
    for package in (*MLX_PACKAGES, "mlxd"):
        identity.update(f"{package}={installed_version(package)}\0".encode())
    identity.update(files_digest(loaded.tokenizer_files))
    return identity.digest()
