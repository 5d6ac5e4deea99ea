"""`mlxd worker --distributed-hosts ...`: start the ranks of a worker that is an
mx.distributed group, and keep them one worker.

This process is what `mlxd serve`'s supervisor (or launchd) sees as the
worker. It starts one rank per host with MLX's own launcher scripts (the ones
`mlx.launch` runs: MLX_RANK, the hostfile, ssh for another host), rank 0 on
this machine; each rank is `python -m worker` with the same settings. A rank
that exits takes the others down at once, and this process exits with its
status, so the group is restarted as a whole: no half-alive group. SIGTERM
goes to rank 0 alone, which drains and then tells the others to exit.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import msgspec
from mlx._distributed_utils.common import Host, Hostfile
from mlx._distributed_utils.launch import RemoteProcess

from protocol import EXIT_LOAD_FAILED
from protocol.settings import to_arguments
from protocol.worker_settings import WorkerSettings, worker_command
from worker.start import GROUP_PID_ENV, LOAD_FAILURE_LOGGED, load_failed

log = logging.getLogger("mlxd.worker.group")

POLL_S = 0.1
# After rank 0 exits cleanly, the others have this long to follow its stop.
FOLLOW_S = 5.0
# A rank's last output, relayed after it exits (a remote rank's comes over ssh).
RELAY_END_S = 2.0


class GroupError(ValueError):
    """The hosts, backend or hostfile cannot make a group."""


def hostfile_of(settings: WorkerSettings) -> Hostfile:
    """--distributed-hosts as MLX's Hostfile: IP addresses, or the path of a
    JSON hostfile (as `mlx.distributed_config` writes; JACCL needs its RDMA devices)."""
    spec = settings.distributed_hosts
    try:
        hosts = Hostfile.from_file(spec) if spec.endswith(".json") else Hostfile.from_list(spec)
    except ValueError as e:
        raise GroupError(str(e)) from None
    if len(hosts.hosts) < 2:
        raise GroupError("--distributed-hosts needs at least two hosts")
    if any(not h.ips for h in hosts.hosts):
        raise GroupError("--distributed-hosts takes IP addresses (every rank must reach the others by them)")
    return hosts


def rank_environment(settings: WorkerSettings, hosts: Hostfile) -> tuple[dict[str, str], list[str]]:
    """The files (name -> content; MLX's scripts write them on each host) and
    variables every rank is started with, as mlx.launch gives them."""
    env = [*hosts.envs, f"{GROUP_PID_ENV}={os.getpid()}"]
    port = settings.distributed_port
    if settings.distributed_backend == "ring":
        ring = [[f"{h.ips[0]}:{port + rank}"] for rank, h in enumerate(hosts.hosts)]
        return {"MLX_HOSTFILE": json.dumps(ring)}, env
    if any(len(h.rdma) != len(hosts.hosts) for h in hosts.hosts):
        raise GroupError("the jaccl backend needs a hostfile listing each host's RDMA device to every other "
                         "(mlx.distributed_config writes one)")
    env.append(f"MLX_JACCL_COORDINATOR={hosts.hosts[0].ips[0]}:{port}")
    return {"MLX_IBV_DEVICES": json.dumps([h.rdma for h in hosts.hosts])}, env


@dataclass
class RankProcess:
    rank: int
    host: str
    process: subprocess.Popen
    relay: threading.Thread | None = None  # its output to ours
    load_failure: str | None = None  # the reason it logged for not loading the model
    reached: bool = False  # its launcher script ran (over ssh, on its host)
    last_line: str = ""  # of its output: ssh's reason, where ssh could not reach the host

    def kill(self) -> None:
        """Gone at once; a rank on another host dies with its ssh session."""
        if self.process.poll() is None:
            self.process.kill()


def is_local(rank: int, host: Host) -> bool:
    return rank == 0 or host.ssh_hostname in ("127.0.0.1", "localhost")


def shared_cpu_environment(local_ranks: int) -> list[str]:
    """Ranks that share this machine split its cores among their BLAS
    threads: on the CPU backend, each rank's full set of OpenBLAS threads
    fought the others' (and their collectives, which spin while they wait),
    a third of the throughput (docs/benchmarks.md). An operator's own setting wins."""
    if local_ranks < 2 or sys.platform != "linux" or "OPENBLAS_NUM_THREADS" in os.environ:
        return []
    return [f"OPENBLAS_NUM_THREADS={max(1, (os.cpu_count() or 1) // local_ranks)}"]


# Two lines of MLX's launch script, as mlxd changes them: the path of the pid file it writes (mktemp) for its own
# launcher, which this is not, printed first; and its end, the rank's command.
_PID_PRINTED = 'printf "%s\\n" $pidfile; '
_EXEC = 'exec "${cmd[@]}"'
# What mlxd's script prints instead of the pid file's path: the host ran it (over ssh, it was reached).
STARTED = "mlxd: rank started"


def _launch_script(rank: int, files: dict[str, str], env: list[str], command: list[str], local: bool) -> str:
    """MLX's launch script (what mlx.launch runs on each host), printing STARTED in place of its pid file's
    path, and removing that file: every start left it in each host's $TMPDIR (the rank removes the files it
    reads once it has read them: worker.start)."""
    script = RemoteProcess.make_launch_script(rank, None, None, files, env, command, local)
    if _PID_PRINTED not in script or _EXEC not in script:
        raise GroupError("MLX's launch script is not the one mlxd knows (worker/group.py): install the mlx "
                         "version mlxd pins")
    return script.replace(_PID_PRINTED, f"echo {shlex.quote(STARTED)}; ").replace(_EXEC, 'rm -f "$pidfile"; ' + _EXEC)


def rank_script(rank: int, host: Host, settings: WorkerSettings, files: dict[str, str], env: list[str]) -> str:
    """The shell command that starts the rank on its host (over ssh, for another host)."""
    local = is_local(rank, host)
    # A rank on this machine stops if this process goes (--parent-pid).
    rank_settings = msgspec.structs.replace(settings, parent_pid=os.getpid() if local else None)
    script = _launch_script(rank, files, env, worker_command(to_arguments(rank_settings)), local)
    if local:
        return script
    # A terminal's Ctrl-C reaches this process group: ssh ignores it (an ignored
    # SIGINT survives exec, and ssh keeps it so), for the group to drain rather than
    # lose its remote ranks to a hang-up; a vanished host is noticed within 15 s.
    # ssh's errors (no route, a refused key) are the operator's only clue; its warnings are noise.
    return (f"trap '' INT; exec ssh -tt -o LogLevel=ERROR -o BatchMode=yes -o ServerAliveInterval=5 "
            f"-o ServerAliveCountMax=3 {shlex.quote(host.ssh_hostname)} {shlex.quote(script)}")


def start_rank(rank: int, host: Host, script: str) -> RankProcess:
    process = subprocess.Popen(script, shell=True, executable="/bin/bash", stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    started = RankProcess(rank, host.ssh_hostname, process)
    started.relay = threading.Thread(target=_relay, args=(started,), name=f"mlxd-rank-{rank}-output", daemon=True)
    started.relay.start()
    return started


def _relay(rank: RankProcess) -> None:
    """A rank's output (its log) to our standard error, less the launch
    script's word that it started; the reason it gives for not loading the
    model is kept, and ssh's where it never ran."""
    assert rank.process.stdout is not None
    for line in rank.process.stdout:
        if not rank.reached and line.strip() == STARTED.encode():
            rank.reached = True
            continue
        with contextlib.suppress(OSError):  # drained whatever: a full pipe would hold the rank at its next log line
            sys.stderr.buffer.write(f"[rank {rank.rank}] ".encode() + line)
            sys.stderr.buffer.flush()
        if (found := line.find(LOAD_FAILURE_LOGGED.encode())) >= 0:
            rank.load_failure = line[found + len(LOAD_FAILURE_LOGGED):].decode(errors="replace").strip()
        if line.strip():
            rank.last_line = line.decode(errors="replace").strip()


def run_group(settings: WorkerSettings) -> int:
    try:
        hosts = hostfile_of(settings)
        files, env = rank_environment(settings, hosts)
        local = [is_local(rank, host) for rank, host in enumerate(hosts.hosts)]
        cpu_env = shared_cpu_environment(sum(local))
        # Every rank's, before any starts: MLX's launch script may not be the one mlxd knows.
        scripts = [rank_script(rank, host, settings, files, env + (cpu_env if local[rank] else []))
                   for rank, host in enumerate(hosts.hosts)]
    except GroupError as e:  # told to the gateway as a load failure: retrying cannot mend it
        return load_failed(settings, str(e))
    log.info("starting a %s group of %d ranks (%s sharding) on %s", settings.distributed_backend, len(hosts.hosts),
             settings.sharding, ", ".join(h.ssh_hostname for h in hosts.hosts))
    ranks = [start_rank(rank, host, script) for (rank, host), script in zip(enumerate(hosts.hosts), scripts)]

    def drain(signum, _frame):
        log.info("received %s; rank 0 drains, then the group exits", signal.Signals(signum).name)
        ranks[0].process.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, drain)
    signal.signal(signal.SIGINT, drain)
    status, first = _watch(ranks, settings.parent_pid)
    if first.rank > 0 and status == EXIT_LOAD_FAILED and first.load_failure:
        # Rank 0 alone speaks to the gateway, and it was stopped waiting for this rank: the reason goes from here.
        return load_failed(settings, f"rank {first.rank} ({first.host}): {first.load_failure}")
    if first.rank > 0 and not first.reached:  # ssh could not reach its host, or log in: no retry mends that
        return load_failed(settings, f"rank {first.rank} ({first.host}) could not be started over ssh "
                                     f"(status {status}): {first.last_line or 'no reason given'}; ssh to it from "
                                     "this Mac must work without a password")
    return status


def _watch(ranks: list[RankProcess], parent_pid: int | None) -> tuple[int, RankProcess]:
    """Until a rank exits; then the group's status, once every rank is gone,
    and the rank that exited first."""
    while True:
        if parent_pid is not None and os.getppid() != parent_pid:
            log.warning("the process that started this worker is gone; stopping the group")
            ranks[0].process.send_signal(signal.SIGTERM)
            parent_pid = None
        exited = [r for r in ranks if r.process.poll() is not None]
        if exited:
            break
        time.sleep(POLL_S)
    first = exited[0]
    stopping = first.process.returncode == 0  # rank 0 is done (a drain, a refusal) and told the others to exit
    if stopping:
        deadline = time.monotonic() + FOLLOW_S
        while any(r.process.poll() is None for r in ranks) and time.monotonic() < deadline:
            time.sleep(POLL_S)
    else:
        log.error("rank %d (%s) exited with status %s; stopping the group", first.rank, first.host,
                  first.process.returncode)
    for r in ranks:
        r.kill()
    for r in ranks:
        r.process.wait()
        if r.relay is not None:
            r.relay.join(RELAY_END_S)
    # A stop's status is rank 0's: another rank may have exited first, at its word.
    status = ranks[0].process.returncode if stopping else first.process.returncode
    # A status of a signal (negative here) reads as a crash to the supervisor, as a shell reports it.
    return (status if status >= 0 else 128 - status), first
