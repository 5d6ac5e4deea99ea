"""The `mlxd` command.

  mlxd serve [--model M]...         gateway + a supervised worker per model, in one command
  mlxd gateway ...                  the HTTP half (as launchd runs it)
  mlxd worker [--model M] ...       the MLX half (as launchd runs it)
  mlxd import-gguf FILE OUT_DIR     write an mlx-lm model directory for a llama GGUF
  mlxd prepare-model [--model M]    download/import a model into the cache
  mlxd launchd install|uninstall|status|restart-worker   run as launchd jobs on a Mac
  mlxd keys generate DIR --name N   a CURVE key pair, for a worker on another Mac (tcp://)
  mlxd pull SOURCE [--name NAME]    a Hugging Face repo, or a .gguf file or URL, into the cache (resumable)
  mlxd list                         the models in the cache: size, format, quantization, context
  mlxd rm NAME...                   remove models from the cache
  mlxd ps [--url U] [--api-key K]   the workers of a running mlxd: model, pid, state, load, memory
  mlxd run NAME [--url U]           chat with a model of a running mlxd in the terminal
  mlxd --version                    mlxd's version, its protocol's, and the MLX packages'

--model takes an mlx-lm directory, a .gguf file, a Hugging Face repo id or the
name of a pulled model; with none, mlxd serves the embedded SmolLM2-135M-Instruct.
Each command has --help.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from gateway.settings import GatewaySettings, PoolSettings, check_model_names
from protocol import PROTOCOL_VERSION
from protocol.log_file import LogSettings, follow_log_file
from protocol.packages import MLX_PACKAGES, installed_version
from protocol.settings import add_arguments, parse_settings, resolve
from protocol.worker_settings import WorkerSettings, announced_name, model_workers, worker_command

USAGE = __doc__

# This module imports little: `mlxd worker` and friends hand over to the worker
# program, and `mlxd launchd`/`keys`/`--version` need no web stack. The HTTP
# server (gateway.server) is imported by the commands that run it.

# Commands that run in the worker program, because they need MLX.
WORKER_COMMANDS = {"worker": [], "import-gguf": ["import-gguf"], "prepare-model": ["prepare-model"],
                   "pull": ["pull"]}
# Commands on the cache and a running server (gateway/models_cli.py), by their function.
MODEL_COMMANDS = {"ps": "ps_main", "list": "list_main", "rm": "rm_main", "run": "run_main"}
# Worker settings that `mlxd serve` sets itself: its worker talks to this
# gateway alone, through a socket in a fresh private (0700) directory.
# Each worker's MLX memory limit is its share of --memory-budget.
SERVE_SETS = frozenset({"worker_endpoint", "parent_pid", "curve_secret_key", "curve_server_key",
                        "memory_limit_bytes"})


def _configure_logging(settings: LogSettings) -> None:
    if settings.log_file:
        follow_log_file(settings.log_file)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s mlxd-gateway[%(process)d] %(levelname)s %(message)s",
        stream=sys.stderr,
    )


def version() -> str:
    packages = ", ".join(f"{name} {installed_version(name)}" for name in MLX_PACKAGES)
    return f"mlxd {installed_version('mlxd')} (protocol {PROTOCOL_VERSION}; {packages})"


def gateway_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mlxd gateway", description="The mlxd HTTP gateway.")
    settings = parse_settings(parser, GatewaySettings, argv)
    _configure_logging(settings)
    from gateway.server import run_gateway

    return run_gateway(settings)


def serve_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="mlxd serve",
        description="Serve models: the gateway plus a worker per model, which it starts and stops.",
        conflict_handler="resolve",
    )
    add_arguments(parser, WorkerSettings, exclude=SERVE_SETS)
    add_arguments(parser, GatewaySettings, exclude=SERVE_SETS | {"curve_authorized_keys"})
    add_arguments(parser, PoolSettings)
    parser.add_argument("--model", dest="model", action="append", default=None, help=(
        "a model to serve, as SOURCE or NAME=SOURCE (NAME: what clients ask for; default: SOURCE): an mlx-lm "
        "model directory, a .gguf file, a Hugging Face repo id, or the NAME of a model `mlxd pull` fetched; "
        "repeatable, each model in a worker of its own (default: the embedded SmolLM2-135M-Instruct) "
        "[env MLXD_MODEL, comma-separated]"))
    args = parser.parse_args(argv)
    runtime = tempfile.mkdtemp(prefix="mlxd-")
    args.worker_endpoint = f"ipc://{runtime}/worker.sock"
    models = args.model or [m.strip() for m in os.environ.get("MLXD_MODEL", "").split(",") if m.strip()] or [""]
    args.model = None
    try:
        gateway_settings = resolve(GatewaySettings, args)
        pool_settings = resolve(PoolSettings, args)
        base = resolve(WorkerSettings, args, environ={k: v for k, v in os.environ.items() if k != "MLXD_MODEL"})
        worker_settings = model_workers(base, models)
        names = [announced_name(ws) for ws in worker_settings]
        if len(names) != len(set(names)):
            raise ValueError(f"--model: two models have one name ({', '.join(names)}); name them as NAME=SOURCE")
        check_model_names(gateway_settings, len(names))
    except ValueError as e:
        os.rmdir(runtime)
        parser.error(str(e))
    _configure_logging(gateway_settings)
    from gateway.server import run_gateway

    try:
        return run_gateway(gateway_settings, worker_settings, pool_settings)
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


def keys_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="mlxd keys",
        description="CURVE keys for a tcp:// worker endpoint. Generate one pair for the gateway and one "
        "per worker; give the gateway --curve-secret-key gateway.key_secret and --curve-authorized-keys "
        "DIR holding the workers' .key files; give each worker its .key_secret and the gateway's .key.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    generate_parser = commands.add_parser("generate", help="write NAME.key (public) and NAME.key_secret (0600)")
    generate_parser.add_argument("directory", type=Path)
    generate_parser.add_argument("--name", required=True, help="e.g. gateway, or the worker's host name")
    generate_parser.add_argument("--force", action="store_true", help="replace a key pair of that name")
    args = parser.parse_args(argv)
    from gateway.curve import CurveError, generate

    if not args.name or "/" in args.name or args.name.startswith("."):
        parser.error(f"--name {args.name!r}: a name is one file name, without / or a leading dot")
    existing = [p for p in (args.directory / f"{args.name}.key", args.directory / f"{args.name}.key_secret")
                if p.exists() or p.is_symlink()]
    if existing and not args.force:
        parser.error(f"{existing[0]} exists: replacing it locks out whatever uses the pair (--force to replace it)")
    try:
        public, secret = generate(args.directory, args.name)
    except OSError as e:
        parser.error(f"cannot write the keys: {e}")
    except CurveError as e:
        parser.error(str(e))
    print(f"public key: {public}\nsecret key: {secret} (keep it private)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command in ("--version", "version"):
        print(version())
        return 0
    if command in WORKER_COMMANDS:
        # Replace this process with the worker program, so that MLX is never
        # imported by gateway code and launchd supervises the worker's own PID.
        os.execv(sys.executable, worker_command([*WORKER_COMMANDS[command], *rest]))
    if command == "gateway":
        return gateway_main(rest)
    if command == "serve":
        return serve_main(rest)
    if command == "keys":
        return keys_main(rest)
    if command in MODEL_COMMANDS:
        from gateway import models_cli

        return getattr(models_cli, MODEL_COMMANDS[command])(rest)
    if command == "launchd":
        from gateway.launchd import main as launchd_main

        return launchd_main(rest)
    if command in ("-h", "--help"):
        print(USAGE.strip())
        return 0
    print(USAGE.strip() + (f"\n\nmlxd: unknown command {command!r}" if command else ""), file=sys.stderr)
    return 2
