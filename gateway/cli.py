"""The `mlxd` command.

  mlxd serve [--model M]            gateway + one supervised worker, in one command
  mlxd gateway ...                  the HTTP half (as launchd runs it)
  mlxd worker [--model M] ...       the MLX half (as launchd runs it)
  mlxd import-gguf FILE OUT_DIR     write an mlx-lm model directory for a llama GGUF
  mlxd prepare-model [--model M]    download/import a model into the cache
  mlxd launchd install|uninstall|status|restart-worker   run as launchd jobs on a Mac
  mlxd keys generate DIR --name N   a CURVE key pair, for a worker on another Mac (tcp://)

--model takes an mlx-lm directory, a .gguf file or a Hugging Face repo id; with
none, mlxd serves the embedded SmolLM2-135M-Instruct. Each command has --help.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import uvicorn

from gateway.app import create_app
from gateway.settings import GatewaySettings
from protocol.settings import add_arguments, parse_settings, resolve
from protocol.worker_settings import WorkerSettings

USAGE = __doc__

# Commands that run in the worker program, because they need MLX.
WORKER_COMMANDS = {"worker": [], "import-gguf": ["import-gguf"], "prepare-model": ["prepare-model"]}


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s mlxd-gateway[%(process)d] %(levelname)s %(message)s",
        stream=sys.stderr,
    )


class DrainingServer(uvicorn.Server):
    """uvicorn, plus our drain on the first SIGTERM/SIGINT: open streams get
    --drain-s to finish and are then ended cleanly, so shutdown never hangs."""

    def __init__(self, config: uvicorn.Config, begin_drain) -> None:
        super().__init__(config)
        self._begin_drain = begin_drain

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            self._begin_drain()
        super().handle_exit(sig, frame)


def _run_gateway(settings: GatewaySettings, worker_settings: WorkerSettings | None = None) -> int:
    app = create_app(settings, worker_settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        # The standard asyncio loop: pyzmq's asyncio sockets wake up later
        # under uvloop (measured: half the throughput at 8 streams).
        loop="asyncio",
        # uvicorn's C parser: measured 3-13% less gateway CPU per streamed token than h11.
        http="httptools",
        # A backstop only: the drain itself ends every stream after drain_s.
        timeout_graceful_shutdown=settings.drain_s + 3,
    )
    try:
        DrainingServer(config, app.state.begin_drain).run()
    finally:
        supervisor = app.state.supervisor
        if supervisor is not None and supervisor.process is not None and supervisor.process.returncode is None:
            # A second Ctrl-C skips the orderly stop; do not leave the worker behind.
            os.kill(supervisor.process.pid, signal.SIGTERM)
    return 0


def gateway_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mlxd gateway", description="The mlxd HTTP gateway.")
    settings = parse_settings(parser, GatewaySettings, argv)
    _configure_logging(settings.log_level)
    return _run_gateway(settings)


def serve_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="mlxd serve",
        description="Serve a model: the gateway plus one worker it starts and stops.",
        conflict_handler="resolve",
    )
    # The worker talks to this gateway alone, through a socket in a fresh
    # private (0700) directory, so the endpoint is not the user's to set.
    add_arguments(parser, WorkerSettings, exclude=frozenset({"worker_endpoint"}))
    add_arguments(parser, GatewaySettings, exclude=frozenset({"worker_endpoint"}))
    args = parser.parse_args(argv)
    runtime = tempfile.mkdtemp(prefix="mlxd-")
    args.worker_endpoint = f"ipc://{runtime}/worker.sock"
    try:
        gateway_settings = resolve(GatewaySettings, args)
        worker_settings = resolve(WorkerSettings, args)
    except ValueError as e:
        os.rmdir(runtime)
        parser.error(str(e))
    _configure_logging(gateway_settings.log_level)

    try:
        return _run_gateway(gateway_settings, worker_settings)
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
    args = parser.parse_args(argv)
    from gateway.curve import generate

    public, secret = generate(args.directory, args.name)
    print(f"public key: {public}\nsecret key: {secret} (keep it private)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command in WORKER_COMMANDS:
        # Replace this process with the worker program, so that MLX is never
        # imported by gateway code and launchd supervises the worker's own PID.
        os.execv(sys.executable, [sys.executable, "-m", "worker", *WORKER_COMMANDS[command], *rest])
    if command == "gateway":
        return gateway_main(rest)
    if command == "serve":
        return serve_main(rest)
    if command == "keys":
        return keys_main(rest)
    if command == "launchd":
        from gateway.launchd import main as launchd_main

        return launchd_main(rest)
    print(USAGE.strip(), file=sys.stderr if command not in ("-h", "--help") else sys.stdout)
    return 0 if command in ("-h", "--help") else 2
