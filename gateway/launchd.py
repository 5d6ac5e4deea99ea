"""`mlxd launchd ...`: run mlxd on a Mac as two launchd jobs, gateway and worker.

Two jobs, so that ops can restart the worker alone (`restart-worker`, which is
`launchctl kickstart -k`) while the gateway keeps every client connected: the
worker drains and hands its requests back, the gateway resumes them on the
next worker.

  install [--system] [--dry-run --output DIR] [settings...]
  uninstall [--system]
  status [--system]
  restart-worker [--system]
"""

from __future__ import annotations

import argparse
import grp
import os
import plistlib
import pwd
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

from gateway.settings import GatewaySettings
from protocol.settings import add_arguments, resolve, to_environment
from protocol.worker_settings import WorkerSettings

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
LABELS = {"gateway": "com.mlxd.gateway", "worker": "com.mlxd.worker"}
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

    def target(self, job: str) -> str:
        return f"{self.domain}/{LABELS[job]}"


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


def render(layout: Layout, gateway: GatewaySettings, worker: WorkerSettings) -> dict[str, dict]:
    """The two job definitions, as dicts ready for plistlib."""
    names = {"MLXD": str(mlxd_executable()), "LOG_DIR": str(layout.log_dir), "HOME": str(layout.home)}
    common = {"HOME": str(layout.home), "PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "MLXD_WORKER_ENDPOINT": layout.endpoint}
    jobs = {}
    for job, settings in (("gateway", gateway), ("worker", worker)):
        with open(DEPLOY / f"{LABELS[job]}.plist", "rb") as f:
            plist = _fill(plistlib.load(f), names)
        env = to_environment(settings)
        env.update(common)
        plist["EnvironmentVariables"] = dict(sorted(env.items()))
        # launchd's SIGKILL must not cut the drain short.
        plist["ExitTimeOut"] = int(max(gateway.drain_s, worker.drain_s)) + 10
        if layout.system:
            plist["UserName"] = layout.user.pw_name
        jobs[job] = plist
    return jobs


def newsyslog(layout: Layout) -> str:
    group = grp.getgrgid(layout.user.pw_gid).gr_name
    text = (DEPLOY / "newsyslog.conf").read_text()
    return _fill(text, {"LOG_DIR": str(layout.log_dir), "OWNER": f"{layout.user.pw_name}:{group}"})


def _launchctl(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    if shutil.which("launchctl") is None:
        raise LaunchdError("launchctl not found: launchd deployment is for macOS (try --dry-run --output DIR)")
    result = subprocess.run(["launchctl", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise LaunchdError(f"launchctl {' '.join(args)} failed: {result.stderr.strip() or result.returncode}")
    return result


def install(layout: Layout, jobs: dict[str, dict], output: Path | None) -> None:
    if output is not None:
        output.mkdir(parents=True, exist_ok=True)
        for job, plist in jobs.items():
            with open(output / f"{LABELS[job]}.plist", "wb") as f:
                plistlib.dump(plist, f)
        (output / "mlxd.newsyslog.conf").write_text(newsyslog(layout))
        print(f"wrote {', '.join(f'{label}.plist' for label in LABELS.values())} and mlxd.newsyslog.conf to {output}")
        return
    layout.plist_dir.mkdir(parents=True, exist_ok=True)
    layout.log_dir.mkdir(parents=True, exist_ok=True)
    if layout.system:
        os.chown(layout.log_dir, layout.user.pw_uid, layout.user.pw_gid)
    for job in ("gateway", "worker"):
        path = layout.plist_dir / f"{LABELS[job]}.plist"
        _launchctl("bootout", layout.target(job), check=False)  # an earlier install, if any
        with open(path, "wb") as f:
            plistlib.dump(jobs[job], f)
        _launchctl("bootstrap", layout.domain, str(path))
        print(f"installed and started {layout.target(job)} ({path})")
    try:
        NEWSYSLOG.write_text(newsyslog(layout))
        print(f"log rotation: {NEWSYSLOG}")
    except PermissionError:
        print(f"log rotation needs root: sudo tee {NEWSYSLOG} <<'EOF'\n{newsyslog(layout)}EOF")
    print(f"logs: {layout.log_dir}/gateway.log and worker.log")


def uninstall(layout: Layout) -> None:
    for job in ("worker", "gateway"):
        _launchctl("bootout", layout.target(job), check=False)
        path = layout.plist_dir / f"{LABELS[job]}.plist"
        path.unlink(missing_ok=True)
        print(f"removed {layout.target(job)}")


def status(layout: Layout, port: int) -> None:
    for job in ("gateway", "worker"):
        result = _launchctl("print", layout.target(job), check=False)
        keep = ("state =", "pid =", "last exit code =", "runs =")
        lines = [line.strip() for line in result.stdout.splitlines() if line.strip().startswith(keep)]
        print(f"{layout.target(job)}: " + ("; ".join(lines) if result.returncode == 0 else "not loaded"))
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            print(f"/health: {r.read().decode()}")
    except OSError as e:
        print(f"/health: no answer ({e})")


def restart_worker(layout: Layout) -> None:
    _launchctl("kickstart", "-k", layout.target("worker"))
    print(f"restarted {layout.target('worker')}: it drains, hands its requests back, and a new one takes over")


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
            add_arguments(sub, WorkerSettings, exclude=frozenset({"worker_endpoint", "parent_pid"}))
            add_arguments(sub, GatewaySettings, exclude=frozenset({"worker_endpoint"}))
        if name == "status":
            sub.add_argument("--port", type=int, default=8000, help="the gateway's port, for /health")
    args = parser.parse_args(argv)
    try:
        layout = Layout(args.system, args.user)
        if args.command == "install":
            if args.dry_run != (args.output is not None):
                parser.error("--dry-run and --output go together")
            gateway = resolve(GatewaySettings, args, environ={})
            worker = resolve(WorkerSettings, args, environ={})
            install(layout, render(layout, gateway, worker), args.output)
        elif args.command == "uninstall":
            uninstall(layout)
        elif args.command == "status":
            status(layout, args.port)
        else:
            restart_worker(layout)
    except (LaunchdError, ValueError, KeyError, PermissionError) as e:
        print(f"mlxd launchd: error: {e}", file=sys.stderr)
        return 1
    return 0
