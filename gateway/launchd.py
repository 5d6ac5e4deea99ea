"""`mlxd launchd ...`: run mlxd on a Mac as launchd jobs: the gateway, and a worker per model.

Jobs of their own, so that ops can restart a worker alone (`restart-worker`,
which is `launchctl kickstart -k`) while the gateway keeps every client
connected: the worker drains and hands its requests back, the gateway resumes
them on the next worker. One model's worker is `com.mlxd.worker`; with several
`--model NAME=SOURCE`, each has its own job, `com.mlxd.worker.NAME`, always
loaded (launchd keeps it running, as `mlxd serve --pin` would).

Secrets never sit in a world-readable file: --api-key values go to a key file
(0600) that the gateway's plist names, and the plists themselves are 0600. An
install whose gateway would be refused at every start (beyond loopback with no
key) is refused now.

  install [--system] [--dry-run --output DIR] [--model NAME=SOURCE ...] [settings...]
  uninstall [--system]
  status [--system]
  restart-worker [--system] [--model NAME]
"""

from __future__ import annotations

import argparse
import contextlib
import grp
import os
import plistlib
import pwd
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import TypeVar

import msgspec

from gateway.security import KeyRing, keys_required
from gateway.settings import GatewaySettings, check_model_names
from protocol.settings import add_arguments, resolve, to_environment
from protocol.worker_settings import WorkerSettings, announced_name, model_workers, split_model

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
PREFIX = "com.mlxd."
NEWSYSLOG = Path("/etc/newsyslog.d/mlxd.conf")


class LaunchdError(Exception):
    pass


class Layout:
    """Where an install puts things: per-user LaunchAgents, or system LaunchDaemons run as a user."""

    def __init__(self, system: bool, user: str) -> None:
        self.system = system
        self.user = pwd.getpwnam(user)
        home = Path(self.user.pw_dir)
        self.home = home
        if system:
            self.plist_dir = Path("/Library/LaunchDaemons")
            self.log_dir = Path("/Library/Logs/mlxd")
            self.domain = "system"
        else:
            self.plist_dir = home / "Library/LaunchAgents"
            self.log_dir = home / "Library/Logs/mlxd"
            self.domain = f"gui/{self.user.pw_uid}"
        # The worker socket's directory; the gateway creates it 0700.
        self.endpoint = f"ipc://{home}/.mlxd/run/worker.sock"
        # Where --api-key values go (0600), for the gateway's --api-key-file.
        self.key_file = home / ".mlxd" / "api-keys"

    def target(self, job: str) -> str:
        return f"{self.domain}/{PREFIX}{job}"

    def installed(self) -> list[str]:
        """The jobs installed here: the gateway, then its workers ("worker", "worker.NAME")."""
        workers = sorted(p.name[len(PREFIX):-len(".plist")] for p in self.plist_dir.glob(f"{PREFIX}worker*.plist"))
        return ["gateway", *(workers or ["worker"])]


def _fill(value, names: dict[str, str]):
    if isinstance(value, str):
        for key, replacement in names.items():
            value = value.replace(f"@{key}@", replacement)
        return value
    if isinstance(value, list):
        return [_fill(v, names) for v in value]
    if isinstance(value, dict):
        return {k: _fill(v, names) for k, v in value.items()}
    return value


def mlxd_executable() -> Path:
    """This install's `mlxd`, by absolute path (launchd has no useful PATH)."""
    path = Path(sys.executable).parent / "mlxd"
    if not path.exists():
        raise LaunchdError(f"{path} does not exist; install mlxd (make install) first")
    return path


def checked_gateway(layout: Layout, gateway: GatewaySettings) -> tuple[GatewaySettings, list[str]]:
    """The gateway's settings as its plist will carry them, and the keys to
    write to layout.key_file (none when the keys already live in a file).

    Raises LaunchdError for an install whose gateway would be refused at
    every start: beyond loopback with no key, or a key file with none.
    """
    if gateway.api_key and gateway.api_key_file:
        raise LaunchdError("give the API keys either as --api-key or in --api-key-file, not both")
    if gateway.api_key_file:
        try:
            KeyRing([], gateway.api_key_file)
        except OSError as e:
            raise LaunchdError(f"cannot read --api-key-file {gateway.api_key_file}: {e}") from None
        except ValueError as e:
            raise LaunchdError(f"--api-key-file {e}: the gateway would be refused at every start") from None
        return gateway, []
    if not gateway.api_key:
        if keys_required(gateway):
            raise LaunchdError(
                f"the gateway would listen on {gateway.host} without an API key and be refused at every start: "
                "add --api-key KEY (or --api-key-file FILE), or, on a network you trust completely, --insecure-no-auth"
            )
        return gateway, []
    return msgspec.structs.replace(gateway, api_key=[], api_key_file=str(layout.key_file)), gateway.api_key


S = TypeVar("S", GatewaySettings, WorkerSettings)

# The settings that name files or directories: the jobs run in the user's home
# directory, so a path given relative to where `install` ran is made absolute.
PATH_SETTINGS = {"api_key_file", "prefix_cache_dir"}


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().absolute())


def absolute_paths(settings: S) -> S:
    """`settings` with each path among PATH_SETTINGS absolute, and a
    --distributed-hosts that names a hostfile here (not a list of hosts)."""
    paths = {name: _absolute(value) for name in PATH_SETTINGS
             if isinstance(value := getattr(settings, name, None), str) and value}
    hosts = getattr(settings, "distributed_hosts", None)
    if isinstance(hosts, str) and hosts and Path(hosts).expanduser().is_file():
        paths["distributed_hosts"] = _absolute(hosts)
    return msgspec.structs.replace(settings, **paths)


def absolute_model(model: str) -> str:
    """A --model value whose SOURCE is here (a directory, a .gguf file), made
    absolute (a hub repo id, which is nothing here, stays as it is)."""
    name, source = split_model(model)
    if not source or not Path(source).expanduser().exists():
        return model
    return f"{name}={_absolute(source)}" if name else _absolute(source)


def worker_jobs(worker: WorkerSettings, models: list[str]) -> dict[str, WorkerSettings]:
    """The worker jobs: "worker" for one model, "worker.NAME" for each of several (named NAME=SOURCE)."""
    if len(models) <= 1:
        return {"worker": msgspec.structs.replace(worker, model=models[0]) if models else worker}
    jobs = {worker_job(announced_name(settings)): settings for settings in model_workers(worker, models)}
    if len(jobs) != len(models):
        raise LaunchdError(f"--model: two models would have one worker job ({', '.join(models)}: their names are "
                           "one, or differ only in characters a job's name cannot hold); name each as NAME=SOURCE")
    return jobs


# Where models are found (mlxd's cache, huggingface_hub's), as the installing
# shell sets them: the jobs look where `mlxd pull` put them, not download again.
HUB_VARIABLES = ("XDG_CACHE_HOME", "HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE")


def hub_variables() -> dict[str, str]:
    return {name: str(Path(os.path.expandvars(value)).expanduser().absolute()) if name != "HF_HUB_OFFLINE" else value
            for name in HUB_VARIABLES if (value := os.environ.get(name))}


def worker_job(model: str) -> str:
    """A model's worker job: its name made a label and a file name (a hub repo id's "/" is neither)."""
    return "worker." + re.sub(r"[^\w.-]", "_", model)


def render(layout: Layout, gateway: GatewaySettings, workers: dict[str, WorkerSettings]) -> dict[str, dict]:
    """The job definitions (the gateway, then each worker), as dicts ready for plistlib."""
    names = {"MLXD": str(mlxd_executable()), "LOG_DIR": str(layout.log_dir), "HOME": str(layout.home)}
    common = {"HOME": str(layout.home), "PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "MLXD_WORKER_ENDPOINT": layout.endpoint,
              **hub_variables()}
    jobs = {}
    for job, settings in (("gateway", gateway), *workers.items()):
        with open(DEPLOY / f"{PREFIX}{job.partition('.')[0]}.plist", "rb") as f:
            plist = _fill(plistlib.load(f), names)
        plist["Label"] = PREFIX + job
        log = f"{layout.log_dir}/{job}.log"
        # launchd opens the log for what comes before mlxd reads its settings; --log-file then opens it again
        # whenever log rotation (newsyslog) has moved it, which launchd's own opening never does.
        plist["StandardOutPath"] = plist["StandardErrorPath"] = log
        env = to_environment(msgspec.structs.replace(settings, log_file=log))
        env.update(common)
        plist["EnvironmentVariables"] = dict(sorted(env.items()))
        # launchd's SIGKILL must not cut the drain short.
        plist["ExitTimeOut"] = int(max(gateway.drain_s, *(w.drain_s for w in workers.values()))) + 10
        if layout.system:
            plist["UserName"] = layout.user.pw_name
        jobs[job] = plist
    return jobs


def newsyslog(layout: Layout, jobs: list[str]) -> str:
    """The log rotation entries: the template's comments, then its line for each job's log."""
    group = grp.getgrgid(layout.user.pw_gid).gr_name
    text = _fill((DEPLOY / "newsyslog.conf").read_text(),
                 {"LOG_DIR": str(layout.log_dir), "OWNER": f"{layout.user.pw_name}:{group}"})
    comments = [line for line in text.splitlines() if line.startswith("#")]
    line = next(line for line in text.splitlines() if "@JOB@" in line)
    return "\n".join([*comments, *(line.replace("@JOB@", job) for job in jobs)]) + "\n"


def _need_launchctl() -> None:
    if shutil.which("launchctl") is None:
        raise LaunchdError("launchctl not found: launchd runs mlxd as a service on macOS only")


def _launchctl(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    _need_launchctl()
    result = subprocess.run(["launchctl", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise LaunchdError(f"launchctl {' '.join(args)} failed: {result.stderr.strip() or result.returncode}")
    return result


def write_private(path: Path, data: bytes, owner: pwd.struct_passwd | None = None) -> None:
    """Write a file only its owner can read (0600) from the first byte on.

    With `owner` (root installing for a user), the file is in a directory
    that user controls: everything is done through the directory's
    descriptor, opened without following a link, and the new file's own, so
    that a link the user puts in the path's place meanwhile cannot turn a
    root-owned write, removal or chown onto another file."""
    flags = os.O_RDONLY | os.O_DIRECTORY | (os.O_NOFOLLOW if owner is not None else 0)
    directory = os.open(path.parent, flags)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path.name, dir_fd=directory)
        fd = os.open(path.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=directory)
    finally:
        os.close(directory)
    with os.fdopen(fd, "wb") as f:
        if owner is not None:
            os.fchown(f.fileno(), owner.pw_uid, owner.pw_gid)
        f.write(data)


def write_key_file(layout: Layout, keys: list[str]) -> None:
    """The API keys in the service user's ~/.mlxd/api-keys (0600). Under
    --system, root makes ~/.mlxd the user's (the gateway, run as the user,
    makes its socket directory in it) and refuses one that is a link."""
    directory = layout.key_file.parent
    if layout.system and directory.is_symlink():
        raise LaunchdError(f"{directory} is a symbolic link; the API key file goes in a directory of the user's own")
    if not directory.exists():
        directory.mkdir(mode=0o700, parents=True)
        if layout.system:
            os.lchown(directory, layout.user.pw_uid, layout.user.pw_gid)
    write_private(layout.key_file, key_file_text(keys), layout.user if layout.system else None)


def key_file_text(keys: list[str]) -> bytes:
    return ("# API keys for the mlxd gateway, one per line; `kill -HUP` the gateway after editing\n"
            + "".join(f"{k}\n" for k in keys)).encode()


def install(layout: Layout, jobs: dict[str, dict], keys: list[str], output: Path | None) -> None:
    if output is not None:
        output.mkdir(parents=True, exist_ok=True)
        for job, plist in jobs.items():
            write_private(output / f"{PREFIX}{job}.plist", plistlib.dumps(plist))
        (output / "mlxd.newsyslog.conf").write_text(newsyslog(layout, list(jobs)))
        if keys:
            write_private(output / layout.key_file.name, key_file_text(keys))
        print(f"wrote {', '.join(f'{PREFIX}{job}.plist' for job in jobs)}, mlxd.newsyslog.conf"
              f"{f' and {layout.key_file.name} (installed as {layout.key_file})' if keys else ''} to {output}")
        return
    _need_launchctl()  # before anything is written
    layout.plist_dir.mkdir(parents=True, exist_ok=True)
    layout.log_dir.mkdir(parents=True, exist_ok=True)
    layout.log_dir.chmod(0o700)  # the logs are the job's user's: with --log-prompts they hold the prompts
    if layout.system:
        os.chown(layout.log_dir, layout.user.pw_uid, layout.user.pw_gid)
    if keys:
        write_key_file(layout, keys)
        print(f"API keys: {layout.key_file} (0600; add or revoke keys there, then `launchctl kill HUP` the gateway)")
    for job in layout.installed()[1:]:
        if job not in jobs:  # an earlier install's worker of a model this one does not serve
            _launchctl("bootout", layout.target(job), check=False)
            (layout.plist_dir / f"{PREFIX}{job}.plist").unlink(missing_ok=True)
    for job in jobs:
        path = layout.plist_dir / f"{PREFIX}{job}.plist"
        _launchctl("bootout", layout.target(job), check=False)  # an earlier install, if any
        # 0600: the gateway's environment may hold a metrics key.
        write_private(path, plistlib.dumps(jobs[job]))
        _launchctl("bootstrap", layout.domain, str(path))
        print(f"installed and started {layout.target(job)} ({path})")
    try:
        NEWSYSLOG.write_text(newsyslog(layout, list(jobs)))
        print(f"log rotation: {NEWSYSLOG}")
    except PermissionError:
        print(f"log rotation needs root: sudo tee {NEWSYSLOG} <<'EOF'\n{newsyslog(layout, list(jobs))}EOF")
    print(f"logs: {', '.join(f'{layout.log_dir}/{job}.log' for job in jobs)}")


def uninstall(layout: Layout) -> None:
    for job in reversed(layout.installed()):
        _launchctl("bootout", layout.target(job), check=False)
        path = layout.plist_dir / f"{PREFIX}{job}.plist"
        path.unlink(missing_ok=True)
        print(f"removed {layout.target(job)}")


def status(layout: Layout, port: int | None) -> None:
    for job in layout.installed():
        result = _launchctl("print", layout.target(job), check=False)
        keep = ("state =", "pid =", "last exit code =", "runs =")
        lines = [line.strip() for line in result.stdout.splitlines() if line.strip().startswith(keep)]
        print(f"{layout.target(job)}: " + ("; ".join(lines) if result.returncode == 0 else "not loaded"))
    url = gateway_url(layout, port)
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            print(f"/health: {r.read().decode()}")
    except OSError as e:
        print(f"/health: no answer ({e})")


def gateway_url(layout: Layout, port: int | None) -> str:
    """Where the installed gateway listens: its plist's port and host (`port`, if given, wins)."""
    env: dict = {}
    with contextlib.suppress(OSError, plistlib.InvalidFileException):
        with open(layout.plist_dir / f"{PREFIX}gateway.plist", "rb") as f:
            env = plistlib.load(f).get("EnvironmentVariables", {})
    defaults = GatewaySettings()
    host = env.get("MLXD_HOST", defaults.host)
    if host in ("0.0.0.0", "::", ""):  # every address: this machine's own answers too
        host = "127.0.0.1"
    return f"http://{f'[{host}]' if ':' in host else host}:{port or env.get('MLXD_PORT', defaults.port)}"


def restart_worker(layout: Layout, model: str | None) -> None:
    """Restart one model's worker (`model`: its NAME), or every worker."""
    workers = layout.installed()[1:]
    if model is not None:
        # Its job as named now, or as an install before names were made labels wrote it.
        jobs = [job for job in dict.fromkeys((worker_job(model), f"worker.{model}")) if job in workers]
        if not jobs:
            raise LaunchdError(f"no worker job for the model {model!r} (installed: {', '.join(workers)})")
        workers = jobs[:1]
    for job in workers:
        _launchctl("kickstart", "-k", layout.target(job))
        print(f"restarted {layout.target(job)}: it drains, hands its requests back, and a new one takes over")


# Flags of `mlxd serve` that the jobs would not use: refused rather than dropped.
UNUSED_FLAGS = ("--log-file", "--curve-secret-key", "--curve-server-key", "--curve-authorized-keys")


def refuse_unused_flags(args: argparse.Namespace, layout: Layout) -> None:
    """Each job's log is its own, and the gateway and its workers meet on a
    local socket."""
    if args.log_file:
        raise LaunchdError(f"--log-file is not taken here: each job logs to {layout.log_dir}/JOB.log "
                           "(gateway.log, worker.log), which the newsyslog entry rotates")
    curve = [flag for flag in UNUSED_FLAGS[1:] if getattr(args, flag[2:].replace("-", "_"))]
    if curve:
        raise LaunchdError(f"{', '.join(curve)}: the jobs meet on a local socket ({layout.endpoint}), which "
                           "needs no CURVE keys; those are for workers on other machines (docs/security.md)")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mlxd launchd", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("install", "uninstall", "status", "restart-worker"):
        sub = commands.add_parser(name, conflict_handler="resolve")
        sub.add_argument("--system", action="store_true", help="LaunchDaemons (boot-time, run as --user) "
                         "instead of the current user's LaunchAgents")
        sub.add_argument("--user", default=os.environ.get("SUDO_USER") or pwd.getpwuid(os.getuid()).pw_name,
                         help="the user the --system jobs run as (default: the invoking user)")
        if name == "install":
            sub.add_argument("--dry-run", action="store_true", help="write the files to --output; call nothing")
            sub.add_argument("--output", type=Path, help="with --dry-run: where to write the plists")
            # The jobs' settings are the flags given here, never this shell's MLXD_* variables.
            add_arguments(sub, WorkerSettings, exclude=frozenset({"worker_endpoint", "parent_pid"}), variables=False)
            add_arguments(sub, GatewaySettings, exclude=frozenset({"worker_endpoint"}), variables=False)
            for unused in UNUSED_FLAGS:  # out of --help; refuse_unused_flags says why
                sub.add_argument(unused, help=argparse.SUPPRESS)
            sub.add_argument("--model", action="append", default=None, help=(
                "a model, as SOURCE or NAME=SOURCE; repeatable: each one in a worker job of its own "
                "(com.mlxd.worker.NAME), named NAME=SOURCE"))
        if name == "restart-worker":
            sub.add_argument("--model", default=None, help="the NAME of the model whose worker to restart "
                             "(default: every worker)")
        if name == "status":
            sub.add_argument("--port", type=int, default=None,
                             help="the gateway's port, for /health (default: the installed gateway's)")
    args = parser.parse_args(argv)
    try:
        layout = Layout(args.system, args.user)
        if args.command == "install":
            if args.dry_run != (args.output is not None):
                parser.error("--dry-run and --output go together")
            refuse_unused_flags(args, layout)
            gateway, keys = checked_gateway(layout, absolute_paths(resolve(GatewaySettings, args, environ={})))
            models = [absolute_model(m) for m in args.model or []]
            check_model_names(gateway, len(models))
            args.model = None
            workers = worker_jobs(absolute_paths(resolve(WorkerSettings, args, environ={})), models)
            install(layout, render(layout, gateway, workers), keys, args.output)
        elif args.command == "uninstall":
            uninstall(layout)
        elif args.command == "status":
            status(layout, args.port)
        else:
            restart_worker(layout, args.model)
    except (LaunchdError, ValueError, KeyError, OSError) as e:  # OSError: an --output that is a file, say
        hint = " (--dry-run --output DIR writes the plists without it)" if args.command == "install" else ""
        print(f"mlxd launchd: error: {e}{hint if 'launchctl not found' in str(e) else ''}", file=sys.stderr)
        return 1
    return 0
