"""`mlxd launchd install --dry-run`: plists launchd would accept, calling nothing."""

from __future__ import annotations

import os
import plistlib
import shutil
import subprocess

import pytest

from tests.conftest import MLXD, ROOT


def install(tmp_path, *args: str) -> dict[str, dict]:
    out = tmp_path / "out"
    result = subprocess.run(
        [*MLXD, "launchd", "install", "--dry-run", "--output", str(out), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == [
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
