import logging
import os

import pytest

from gateway.security import KeyRing, RefusalLog, is_loopback, keys_required, presented_key
from gateway.settings import GatewaySettings


def test_keys_from_flags_and_file(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# comment\n  file-key  \n\nteam-key # team a\n")
    ring = KeyRing(["flag-key"], str(key_file))
    assert ring.enabled
    assert ring.identify("flag-key") and ring.identify("file-key") and ring.identify("team-key")
    assert ring.identify("# comment") is None and ring.identify("") is None and ring.identify(None) is None
    assert ring.identify("team-key # team a") is None  # a comment after a key was taken as part of it
    assert ring.identify("flag-key") != ring.identify("file-key")


def test_a_reload_that_would_leave_no_key_is_refused(tmp_path):
    """On loopback too: a proxy may bring the LAN there, and a file saved half-written must not turn keys off."""
    key_file = tmp_path / "keys"
    key_file.write_text("k1\n")
    ring = KeyRing([], str(key_file))
    for emptied in ("# nothing\n", ""):
        key_file.write_text(emptied)
        with pytest.raises(ValueError, match="holds no key"):
            ring.reload()
        assert ring.identify("k1")  # the keys loaded before stay
    key_file.write_text("k2\n")
    ring.reload()
    assert ring.identify("k2") and not ring.identify("k1")


def test_a_key_file_others_may_read_is_warned_of(tmp_path, caplog):
    key_file = tmp_path / "keys"
    key_file.write_text("k1-long-enough-to-pass\n")
    for mode, warned in ((0o600, False), (0o644, True)):
        key_file.chmod(mode)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="mlxd.gateway.security"):
            KeyRing([], str(key_file))
        assert ("may be read by other users" in caplog.text) is warned


def test_a_file_with_no_key_at_start_is_refused(tmp_path):
    """It served without keys, on loopback, where a proxy may bring the LAN (a server told to use keys)."""
    key_file = tmp_path / "keys"
    key_file.write_text("# none yet\n")
    with pytest.raises(ValueError, match="holds no key"):
        KeyRing([], str(key_file))


def test_an_unreadable_file_keeps_the_keys(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("k1\n")
    ring = KeyRing([], str(key_file))
    key_file.unlink()
    with pytest.raises(OSError):
        ring.reload()
    assert ring.identify("k1")


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("localhost", True), ("::1", True), ("[::1]", True), ("127.0.0.2", True),
    ("0.0.0.0", False), ("192.168.1.5", False), ("example.com", False),
])
def test_loopback(host, loopback):
    assert is_loopback(host) == loopback


def test_keys_are_required_beyond_loopback_unless_waived():
    assert keys_required(GatewaySettings(host="0.0.0.0"))
    assert not keys_required(GatewaySettings(host="0.0.0.0", insecure_no_auth=True))
    assert not keys_required(GatewaySettings())


def test_presented_key_forms():
    assert presented_key({b"authorization": b"Bearer  abc "}) == "abc"
    assert presented_key({b"authorization": b"bearer abc"}) == "abc"
    assert presented_key({b"authorization": b"Basic abc"}) is None
    assert presented_key({b"x-api-key": b"xyz", b"authorization": b"Bearer abc"}) == "xyz"
    assert presented_key({}) is None


def test_a_curve_secret_key_is_private_from_its_creation(tmp_path, monkeypatch):
    """pyzmq writes it under the process's umask; made 0600 only after, a reader in a shared directory
    could open it in between."""
    import zmq.auth

    from gateway.curve import generate

    modes = []
    write = getattr(zmq.auth.certs, "_write_key_file", None)  # pyzmq's own writer, watched as it writes
    if write is None:
        pytest.skip("this pyzmq writes its key files otherwise")

    def watched(path, *args, **kwargs):
        write(path, *args, **kwargs)
        modes.append((path.endswith("_secret"), os.stat(path).st_mode & 0o777))

    monkeypatch.setattr(zmq.auth.certs, "_write_key_file", watched)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    public, secret = generate(shared, "w1")
    assert (True, 0o600) in modes  # as it was written
    assert os.stat(secret).st_mode & 0o777 == 0o600 and os.stat(public).st_mode & 0o777 == 0o644


def test_refusals_are_logged_a_line_a_minute_per_address(caplog, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("gateway.security.time.monotonic", lambda: clock[0])
    refusals = RefusalLog()
    with caplog.at_level(logging.WARNING, logger="mlxd.gateway.security"):
        for _ in range(5):
            refusals.refused("10.0.0.7", "/v1/models")
        refusals.refused("10.0.0.8", "/v1/models")
        clock[0] += RefusalLog.EVERY_S
        refusals.refused("10.0.0.7", "/v1/chat/completions")
    assert [r.getMessage() for r in caplog.records] == [
        "refused a request from 10.0.0.7 to /v1/models for a missing or wrong key",
        "refused a request from 10.0.0.8 to /v1/models for a missing or wrong key",
        "refused a request from 10.0.0.7 to /v1/chat/completions for a missing or wrong key "
        "(4 more since the last such line)",
    ]


def test_curve_keys_others_could_read_or_add_to_are_refused(tmp_path):
    from gateway.curve import CurveError, WorkerAllowlist, generate
    from protocol.curve_keys import load_secret_key

    keys = tmp_path / "keys"
    public, secret = generate(keys, "gateway")
    assert load_secret_key(str(secret))[1]
    secret.chmod(0o640)
    with pytest.raises(ValueError, match="read by other users"):
        load_secret_key(str(secret))
    with pytest.raises(ValueError, match="holds no secret key"):
        load_secret_key(str(public))
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "w1.key").write_bytes(public.read_bytes())
    assert WorkerAllowlist(allowed).keys
    allowed.chmod(0o777)
    with pytest.raises(CurveError, match="writable by other users"):
        WorkerAllowlist(allowed)
    with pytest.raises(CurveError, match="writable by other users"):
        generate(allowed, "w2")
