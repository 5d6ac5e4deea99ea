"""`mlxd launchd install --dry-run`: plists launchd would accept, calling nothing."""

from __future__ import annotations

import os
import plistlib
import pwd
import shutil
import stat
import subprocess

import pytest

from gateway import launchd
from tests.conftest import MLXD, ROOT


def install(tmp_path, *args: str) -> dict[str, dict]:
    out = tmp_path / "out"
    result = subprocess.run(
        [*MLXD, "launchd", "install", "--dry-run", "--output", str(out), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir() if p.name != "api-keys") == [
        "com.mlxd.gateway.plist", "com.mlxd.worker.plist", "mlxd.newsyslog.conf"
    ]
    jobs = {}
    for job in ("gateway", "worker"):
        with open(out / f"com.mlxd.{job}.plist", "rb") as f:
            jobs[job] = plistlib.load(f)
    jobs["newsyslog"] = (out / "mlxd.newsyslog.conf").read_text()
    return jobs


@pytest.mark.parametrize("system", [False, True])
def test_plists_carry_the_keys_launchd_needs(tmp_path, system):
    jobs = install(tmp_path, "--model", "some/model", "--port", "8123", "--drain-s", "15",
                   *(["--system"] if system else []))
    gateway, worker = jobs["gateway"], jobs["worker"]
    for job, plist in (("gateway", gateway), ("worker", worker)):
        assert plist["Label"] == f"com.mlxd.{job}"
        program = plist["ProgramArguments"]
        assert os.path.isabs(program[0]) and os.access(program[0], os.X_OK)
        assert program[1] == job
        assert plist["RunAtLoad"] is True
        assert plist["KeepAlive"] is True
        assert isinstance(plist["ThrottleInterval"], int) and plist["ThrottleInterval"] > 0
        assert plist["ExitTimeOut"] > 15  # longer than the drain
        assert plist["StandardOutPath"].endswith(f"mlxd/{job}.log")
        assert plist["StandardErrorPath"] == plist["StandardOutPath"]
        assert plist["StandardOutPath"] in jobs["newsyslog"]
        assert ("UserName" in plist) == system
        if system:
            assert plist["StandardOutPath"].startswith("/Library/Logs/")
    assert worker["ProcessType"] == "Interactive"
    # A connection is a descriptor: launchd's default 256 would cap the LAN's streams.
    assert gateway["SoftResourceLimits"]["NumberOfFiles"] >= 4096
    assert gateway["EnvironmentVariables"]["MLXD_PORT"] == "8123"
    assert worker["EnvironmentVariables"]["MLXD_MODEL"] == "some/model"
    assert "MLXD_MODEL" not in gateway["EnvironmentVariables"]
    endpoint = gateway["EnvironmentVariables"]["MLXD_WORKER_ENDPOINT"]
    assert endpoint.startswith("ipc://") and worker["EnvironmentVariables"]["MLXD_WORKER_ENDPOINT"] == endpoint


@pytest.mark.skipif(shutil.which("launchctl") is not None, reason="would restart a real install")
def test_without_launchctl_it_says_so():
    result = subprocess.run([*MLXD, "launchd", "restart-worker"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 1
    assert "launchctl not found" in result.stderr and "Traceback" not in result.stderr


def run_install(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*MLXD, "launchd", "install", "--dry-run", "--output", str(tmp_path / "out"), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_a_lan_gateway_without_a_key_is_refused_at_install(tmp_path):
    result = run_install(tmp_path, "--host", "0.0.0.0")
    assert result.returncode == 1 and "without an API key" in result.stderr
    assert not (tmp_path / "out").exists()
    empty = tmp_path / "keys.txt"
    empty.write_text("# no key yet\n")
    result = run_install(tmp_path, "--host", "0.0.0.0", "--api-key-file", str(empty))
    assert result.returncode == 1 and "holds no key" in result.stderr
    assert run_install(tmp_path, "--host", "0.0.0.0", "--insecure-no-auth").returncode == 0


def test_api_keys_go_to_a_private_file_never_a_plist(tmp_path):
    jobs = install(tmp_path, "--host", "0.0.0.0", "--api-key", "the-secret-key", "--metrics-key", "scrape")
    out = tmp_path / "out"
    env = jobs["gateway"]["EnvironmentVariables"]
    assert env["MLXD_API_KEY_FILE"].endswith("/.mlxd/api-keys") and "MLXD_API_KEYS" not in env
    for name in ("com.mlxd.gateway.plist", "com.mlxd.worker.plist"):
        assert b"the-secret-key" not in (out / name).read_bytes()
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o600
    key_file = out / "api-keys"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert "the-secret-key" in key_file.read_text().splitlines()
    # A key file already given is referenced as it is.
    given = tmp_path / "mine.txt"
    given.write_text("k1\n")
    jobs = install(tmp_path, "--host", "0.0.0.0", "--api-key-file", str(given))
    assert jobs["gateway"]["EnvironmentVariables"]["MLXD_API_KEY_FILE"] == str(given)


def test_paths_given_relative_to_the_install_are_made_absolute(tmp_path):
    """The jobs run in the user's home directory: a relative path would name another file there."""
    (tmp_path / "keys.txt").write_text("k1\n")
    (tmp_path / "tiny").mkdir()
    result = subprocess.run([*MLXD, "launchd", "install", "--dry-run", "--output", "out", "--host", "0.0.0.0",
                             "--api-key-file", "keys.txt", "--model", "t=./tiny", "--model", "some/repo",
                             "--prefix-cache-dir", "kv"], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    plists = {p.name: plistlib.loads(p.read_bytes())["EnvironmentVariables"] for p in (tmp_path / "out").glob("*.plist")}
    assert plists["com.mlxd.gateway.plist"]["MLXD_API_KEY_FILE"] == str(tmp_path / "keys.txt")
    assert plists["com.mlxd.worker.t.plist"]["MLXD_MODEL"] == f"t={tmp_path / 'tiny'}"
    assert plists["com.mlxd.worker.t.plist"]["MLXD_PREFIX_CACHE_DIR"] == str(tmp_path / "kv")
    assert plists["com.mlxd.worker.some_repo.plist"]["MLXD_MODEL"] == "some/repo"  # a hub repo id stays as it is


@pytest.mark.skipif(shutil.which("launchctl") is not None, reason="would install for real")
def test_install_without_launchctl_writes_nothing():
    layout = launchd.Layout(False, pwd.getpwuid(os.getuid()).pw_name)
    paths = (layout.key_file, layout.plist_dir / "com.mlxd.gateway.plist", layout.plist_dir, layout.log_dir)
    before = [p.exists() for p in paths]
    result = subprocess.run([*MLXD, "launchd", "install", "--api-key", "k1"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1 and "launchctl not found" in result.stderr
    assert [p.exists() for p in paths] == before


@pytest.mark.skipif(shutil.which("launchctl") is not None, reason="would query a real install")
def test_status_without_launchctl_suggests_nothing_that_does_not_apply():
    result = subprocess.run([*MLXD, "launchd", "status"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "macOS" in result.stderr and "--dry-run" not in result.stderr


def test_several_models_get_a_worker_job_each(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(
        [*MLXD, "launchd", "install", "--dry-run", "--output", str(out), "--model", "chat=some/chat",
         "--model", "coder=/models/coder", "--max-batch", "8"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "com.mlxd.gateway.plist", "com.mlxd.worker.chat.plist", "com.mlxd.worker.coder.plist", "mlxd.newsyslog.conf"]
    workers = {}
    for name in ("chat", "coder"):
        with open(out / f"com.mlxd.worker.{name}.plist", "rb") as f:
            workers[name] = plistlib.load(f)
        plist = workers[name]
        assert plist["Label"] == f"com.mlxd.worker.{name}" and plist["ProgramArguments"][1] == "worker"
        assert plist["StandardOutPath"].endswith(f"mlxd/worker.{name}.log")
        assert plist["EnvironmentVariables"]["MLXD_MAX_BATCH"] == "8"
    assert workers["chat"]["EnvironmentVariables"]["MLXD_MODEL"] == "chat=some/chat"
    assert workers["coder"]["EnvironmentVariables"]["MLXD_MODEL"] == "coder=/models/coder"
    rotation = (out / "mlxd.newsyslog.conf").read_text()
    assert [line.split()[0].rsplit("/", 1)[1] for line in rotation.splitlines() if not line.startswith("#")] == [
        "gateway.log", "worker.chat.log", "worker.coder.log"]
    twice = subprocess.run([*MLXD, "launchd", "install", "--dry-run", "--output", str(tmp_path / "again"),
                            "--model", "a=x/y", "--model", "a=z/w"], cwd=ROOT, capture_output=True, text=True,
                           timeout=60)
    assert twice.returncode == 1 and "two models would have one worker job" in twice.stderr
    one_name = subprocess.run([*MLXD, "launchd", "install", "--dry-run", "--output", str(tmp_path / "named"),
                               "--model", "chat=x/y", "--model", "coder=z/w", "--served-model-name", "gpt-4"],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert one_name.returncode == 1 and "--served-model-name names the one model" in one_name.stderr


def test_the_jobs_find_models_where_the_installing_shell_keeps_them(tmp_path):
    """A repo pulled onto another disk (HF_HOME), a model pulled into another cache (XDG_CACHE_HOME): the
    jobs looked in the default places, downloading the repo again or restarting for a model not found."""
    environ = {"HF_HOME": "~/hf", "XDG_CACHE_HOME": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "out"
    result = subprocess.run([*MLXD, "launchd", "install", "--dry-run", "--output", str(out)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60, env={**os.environ, **environ})
    assert result.returncode == 0, result.stderr
    for job in ("gateway", "worker"):
        with open(out / f"com.mlxd.{job}.plist", "rb") as f:
            variables = plistlib.load(f)["EnvironmentVariables"]
        assert variables["HF_HOME"] == os.path.expanduser("~/hf")
        assert variables["XDG_CACHE_HOME"] == str(tmp_path / "cache") and variables["HF_HUB_OFFLINE"] == "1"
        assert variables["MLXD_LOG_FILE"].endswith(f"/mlxd/{job}.log")  # followed across log rotation


def test_root_writing_the_key_file_for_a_user_gives_it_and_its_directory_to_them(tmp_path):
    """`launchd install --system` runs as root in the user's home: the key file and
    ~/.mlxd are the user's (the gateway runs as them), and a link put in the
    file's place cannot turn root's write onto another file."""
    if os.geteuid() != 0:
        pytest.skip("needs root, as `launchd install --system` runs")
    layout = launchd.Layout(system=True, user="nobody")
    layout.key_file = tmp_path / ".mlxd" / "api-keys"
    launchd.write_key_file(layout, ["k1"])
    for path in (layout.key_file, layout.key_file.parent):
        assert path.stat().st_uid == layout.user.pw_uid
    assert stat.S_IMODE(layout.key_file.stat().st_mode) == 0o600 and b"k1" in layout.key_file.read_bytes()
    target = tmp_path / "precious"
    target.write_text("root's")
    layout.key_file.unlink()
    layout.key_file.symlink_to(target)  # as the user could, meanwhile
    launchd.write_key_file(layout, ["k2"])
    assert target.read_text() == "root's" and target.stat().st_uid == 0
    assert not layout.key_file.is_symlink() and b"k2" in layout.key_file.read_bytes()
    shutil.rmtree(layout.key_file.parent)
    (tmp_path / "elsewhere").mkdir()
    layout.key_file.parent.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(launchd.LaunchdError, match="symbolic link"):
        launchd.write_key_file(layout, ["k3"])


def test_status_asks_the_installed_gateway_where_it_listens(tmp_path):
    layout = launchd.Layout(False, pwd.getpwuid(os.getuid()).pw_name)
    layout.plist_dir = tmp_path
    assert launchd.gateway_url(layout, None) == "http://127.0.0.1:8000"  # nothing installed: the defaults
    for host, url in (("0.0.0.0", "http://127.0.0.1:9001"), ("192.168.1.20", "http://192.168.1.20:9001"),
                      ("::1", "http://[::1]:9001")):
        plist = {"EnvironmentVariables": {"MLXD_PORT": "9001", "MLXD_HOST": host}}
        (tmp_path / "com.mlxd.gateway.plist").write_bytes(plistlib.dumps(plist))
        assert launchd.gateway_url(layout, None) == url
    assert launchd.gateway_url(layout, 7000) == "http://[::1]:7000"


def test_install_help_names_no_variables():
    """install writes the flags given into the plists; it reads no MLXD_* variable of this shell."""
    result = subprocess.run([*MLXD, "launchd", "install", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0 and "--port" in result.stdout and "[env MLXD_" not in result.stdout


@pytest.mark.parametrize("flag", ["--log-file", "--curve-secret-key", "--curve-server-key", "--curve-authorized-keys"])
def test_flags_the_jobs_would_not_use_are_refused_not_dropped(tmp_path, flag):
    result = run_install(tmp_path, flag, str(tmp_path / "some.file"))
    assert result.returncode == 1 and f"{flag}" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()
