"""The worker's commands (run as `python -m worker`, or through `mlxd`):

  mlxd worker [--model M] ...       load a model and serve it to a gateway
  mlxd import-gguf FILE OUT_DIR     write an mlx-lm model directory for a llama GGUF
  mlxd prepare-model [--model M]    download/import a model into the cache, print its directory
  mlxd pull SOURCE [--name NAME]    a Hugging Face repo, or a .gguf file or URL, into the cache
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from protocol.log_file import LogSettings, follow_log_file
from protocol.settings import parse_settings
from protocol.worker_settings import WorkerSettings, split_model


def _start(settings: LogSettings | None = None) -> str:
    """Set up logging and BLAS; return which BLAS MLX runs on."""
    settings = settings or LogSettings()
    if settings.log_file:
        follow_log_file(settings.log_file)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s mlxd-worker[%(process)d] %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    # BLAS must be chosen before anything imports mlx, which is why the
    # modules that do are imported inside the commands, after this.
    from worker.blas import load_fast_blas

    return load_fast_blas()


def _fail(message: str) -> int:
    print(f"mlxd: error: {message}", file=sys.stderr)
    return 1


def serve_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="mlxd worker",
        description="Load a model and serve it to an mlxd gateway. The main thread makes "
        "every MLX call. MLXD_AFFINITY_AUDIT=1 records the thread of every MLX evaluation "
        "and reports any made off the main thread. With --distributed-hosts, start one rank per host "
        "(an mx.distributed group that serves as one worker); a process started with MLX_RANK set "
        "(by mlx.launch, or a host's own launchd job) is one rank of such a group.",
    )
    settings = parse_settings(parser, WorkerSettings, argv)
    blas = _start(settings)
    logging.getLogger("mlxd.worker").info("BLAS: %s", blas)
    if settings.distributed_hosts and "MLX_RANK" not in os.environ:  # not yet a rank: start the group's ranks
        from worker.group import run_group

        return run_group(settings)
    from worker.collective import GroupLost
    from worker.start import serve

    try:
        return serve(settings, audit=os.environ.get("MLXD_AFFINITY_AUDIT", "") not in ("", "0"))
    except GroupLost as e:  # a crash for its service to start it again, with its reason rather than a traceback
        logging.getLogger("mlxd.worker").error("%s; exiting", e)
        return 1


def import_gguf_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="mlxd import-gguf",
        description="Import a llama-architecture GGUF file into an mlx-lm model directory.",
    )
    parser.add_argument("file", help="the .gguf file")
    parser.add_argument("out_dir", help="the directory to create (must not exist, or be empty)")
    args = parser.parse_args(argv)
    _start()
    from worker.gguf import GGUFError, import_gguf

    try:
        print(import_gguf(args.file, args.out_dir))
    except (GGUFError, OSError) as e:
        return _fail(str(e))
    return 0


def prepare_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="mlxd prepare-model",
        description="Download or import a model into the cache without serving it; print its directory.",
    )
    parser.add_argument("--model", default=os.environ.get("MLXD_MODEL", ""), help="as for `mlxd worker --model`")
    args = parser.parse_args(argv)
    _start()
    from worker.gguf import GGUFError
    from worker.model_source import ModelNotFound, resolve_model

    try:
        print(resolve_model(split_model(args.model)[1])[0])
    except (ModelNotFound, GGUFError, OSError) as e:
        return _fail(str(e))
    return 0


def pull_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="mlxd pull",
        description="Put a model in the cache, to serve it later: a Hugging Face repo (owner/name), or a .gguf "
        "file on this machine or at an http(s) URL (imported as NAME; `--model NAME` serves it). Shows its "
        "progress; an interrupted download (a URL's, a Hugging Face repo's) continues where it stopped when run "
        "again; a file on this machine is copied whole.",
    )
    parser.add_argument("source", help="owner/name, path/to/model.gguf, or https://host/path/model.gguf")
    parser.add_argument("--name", help="the name a .gguf is cached and served under (default: its file name "
                        "without .gguf)")
    args = parser.parse_args(argv)
    _start(LogSettings(log_level="warning"))
    from worker.gguf import GGUFError
    from worker.model_source import ModelNotFound
    from worker.pull import PullError, pull

    try:
        directory, model = pull(args.source, args.name)
    except (PullError, ModelNotFound, GGUFError, OSError) as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        return _fail("interrupted; pull again to go on (a download continues where it stopped, and one whole is "
                     "imported without downloading it again; `mlxd rm NAME` removes it)")
    print(f"pulled {model} into {directory}; serve it with: mlxd serve --model {model}")
    return 0


COMMANDS = {"import-gguf": import_gguf_main, "prepare-model": prepare_main, "pull": pull_main}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]](argv[1:])
    return serve_main(argv)
