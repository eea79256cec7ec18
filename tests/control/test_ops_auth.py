"""The job token on the leader's Python endpoints: the operations endpoint (and tmrun-ctl, which
finds the token of a job on its host), the agents' liveness connection, and the token's sources."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import PrefixStore, TCPStore

from tmrun.control.ops import OpsServer
from tmrun.launcher.runfile import token_path, write_runfile
from tmrun.protocol import auth, keys
from tmrun.protocol import ops as wire
from tmrun.protocol.membership import Membership
from tmrun.rendezvous.liveness import LivenessBeacon, LivenessMonitor

RUN = "ops-auth"
TOKEN = "the-right-token-" + "x" * 20


@pytest.fixture()
def secured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("TMRUN_STATE_DIR", str(tmp_path / "state"))
    for name in ("TMRUN_JOB_TOKEN", "TMRUN_JOB_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    store = PrefixStore(keys.job_prefix(RUN), master)
    store.set(keys.STATE, Membership().to_json())
    ops = OpsServer(store, RUN, request_timeout=0.5, token=TOKEN)
    address = ops.start("127.0.0.1")
    runfile = write_runfile(RUN, f"127.0.0.1:{master.port}", ops=address, token=TOKEN)
    yield ops, wire.parse_address(address), runfile
    ops.stop()


def test_right_token_is_served(secured) -> None:  # type: ignore[no-untyped-def]
    ops, address, _ = secured
    assert wire.ask(address, {"op": "ping"}, token=TOKEN)["ok"]
    assert wire.ask(address, {"op": "status"}, token=TOKEN)["run_id"] == RUN
    assert ops.auth_failures == 0


def test_wrong_or_missing_token_is_refused(secured) -> None:  # type: ignore[no-untyped-def]
    ops, address, _ = secured
    with pytest.raises(wire.OpsError, match="authentication failed") as wrong:
        wire.ask(address, {"op": "ping"}, token="not-the-token")
    assert "not-the-token" not in str(wrong.value) and TOKEN not in str(wrong.value)
    with pytest.raises(wire.OpsError, match="requires its job token"):
        wire.ask(address, {"op": "ping"})
    # the tokenless client gives up on seeing the challenge; the endpoint counts it once it reads
    # the client's line (or its close) on its own thread
    deadline = time.monotonic() + 5
    while ops.auth_failures < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ops.auth_failures == 2


def test_stray_clients_are_refused_and_counted(secured) -> None:  # type: ignore[no-untyped-def]
    ops, address, _ = secured
    garbage = socket.create_connection(address, timeout=5)
    assert garbage.recv(256).startswith(auth.CHALLENGE)
    garbage.sendall(b'{"op": "status"}\n')  # a request without the handshake is not served
    reply = garbage.recv(65536)
    assert b"authentication failed" in reply and b"membership" not in reply
    garbage.close()
    silent = socket.create_connection(address, timeout=5)
    deadline = time.monotonic() + 5
    while ops.auth_failures < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    silent.close()
    assert wire.ask(address, {"op": "ping"}, token=TOKEN)["ok"]  # the endpoint lives on


def test_a_fake_endpoint_must_prove_the_token(tmp_path: Path) -> None:
    """The client checks the server's proof: an impostor that does not know the token is caught."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def impostor() -> None:
        conn, _ = listener.accept()
        conn.sendall(auth.challenge()[1])
        conn.recv(4096)
        conn.sendall(b"00" * 32 + b"\n" + b'{"ok": true, "run_id": "x"}\n')
        conn.close()

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    with pytest.raises(wire.OpsError, match="did not prove the job token"):
        wire.ask(("127.0.0.1", port), {"op": "ping"}, token=TOKEN, timeout=3)
    thread.join(5)
    listener.close()


def _ctl(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, **env}
    for name in ("TMRUN_JOB_TOKEN", "TMRUN_JOB_TOKEN_FILE"):
        if name not in env:
            full.pop(name, None)
    return subprocess.run([sys.executable, "-m", "tmrun.cli.ctl", *args], capture_output=True, text=True,
                          timeout=60, env=full)


def test_ctl_uses_the_run_files_token_and_refuses_a_wrong_one(secured, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ops, address, runfile = secured
    state = {"TMRUN_STATE_DIR": os.environ["TMRUN_STATE_DIR"]}
    assert os.stat(token_path(RUN)).st_mode & 0o777 == 0o600
    assert TOKEN not in runfile.read_text()
    ok = _ctl(["status", "--json"], state)
    assert ok.returncode == 0, ok.stderr
    assert TOKEN not in ok.stdout + ok.stderr
    endpoint = f"{address[0]}:{address[1]}"
    wrong = _ctl(["status", "--endpoint", endpoint], {**state, "TMRUN_JOB_TOKEN": "wrong-token"})
    assert wrong.returncode != 0
    lines = [line for line in wrong.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "authentication failed" in lines[0], wrong.stderr
    assert "wrong-token" not in wrong.stderr + wrong.stdout
    printed = _ctl(["status", "--endpoint", endpoint], state)  # as tmrun prints it, on the job's host
    assert printed.returncode == 0, printed.stderr
    missing = _ctl(["status", "--endpoint", endpoint], {"TMRUN_STATE_DIR": str(tmp_path / "another-host")})
    assert missing.returncode != 0 and "requires its job token" in missing.stderr
    assert len([line for line in missing.stderr.splitlines() if line.strip()]) == 1
    good = tmp_path / "token"
    good.write_text(TOKEN + "\n")
    good.chmod(0o600)
    by_file = _ctl(["status", "--endpoint", endpoint], {**state, "TMRUN_JOB_TOKEN_FILE": str(good)})
    assert by_file.returncode == 0, by_file.stderr


def test_token_file_rules(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("  secret-value \n")
    path.chmod(0o640)
    with pytest.raises(auth.TokenError, match="group or others") as err:
        auth.token_from_environ({"TMRUN_JOB_TOKEN_FILE": str(path)})
    assert "secret" not in str(err.value)
    path.chmod(0o600)
    assert auth.token_from_environ({"TMRUN_JOB_TOKEN_FILE": str(path), "TMRUN_JOB_TOKEN": "other"}) == "secret-value"
    path.write_text("\n")
    with pytest.raises(auth.TokenError, match="empty"):
        auth.read_token_file(str(path))
    with pytest.raises(auth.TokenError, match="cannot open"):
        auth.read_token_file(str(tmp_path / "absent"))
    assert auth.token_from_environ({"TMRUN_JOB_TOKEN": "from-env"}) == "from-env"
    assert auth.token_from_environ({}) is None
    assert len(auth.new_token()) == 64


def test_ctl_refuses_a_readable_token_file_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("value\n")
    path.chmod(0o644)
    result = _ctl(["status", "--endpoint", "127.0.0.1:9"], {"TMRUN_JOB_TOKEN_FILE": str(path)})
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "chmod 600" in lines[0], result.stderr


# -- liveness ------------------------------------------------------------------------------------


class _Polling:
    def __init__(self, monitor: LivenessMonitor) -> None:
        self.monitor = monitor
        self.lost: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.monitor.poll(0.02, lambda node, why, _silent: self.lost.append((node, why)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _identified(monitor: LivenessMonitor) -> list[int]:
    return sorted(p.node_id for p in list(monitor._peers.values()) if p.node_id is not None)  # noqa: SLF001


def test_liveness_with_the_right_token() -> None:
    monitor = LivenessMonitor("run", heartbeat_timeout=30, token=TOKEN)
    polling = _Polling(monitor)
    try:
        beacon = LivenessBeacon("127.0.0.1", monitor.port, "run", 3, interval=0.05, token=TOKEN)
        deadline = time.monotonic() + 5
        while _identified(monitor) != [3]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        beacon.close()
        assert monitor.auth_failures == 0
    finally:
        polling.stop()
        monitor.close()


@pytest.mark.e2e  # over half a second: waits out a timeout (the unit subset stays within a minute)
def test_liveness_with_a_wrong_token_is_refused() -> None:
    monitor = LivenessMonitor("run", heartbeat_timeout=30, token=TOKEN, hello_timeout=1.0)
    polling = _Polling(monitor)
    try:
        with pytest.raises(auth.AuthError, match="refused this agent's job token") as err:
            LivenessBeacon("127.0.0.1", monitor.port, "run", 3, interval=0.05, token="wrong", timeout=5)
        assert TOKEN not in str(err.value)
        # a stray client that says hello without authenticating, and a silent one
        stray = socket.create_connection(("127.0.0.1", monitor.port))
        stray.sendall(b"TMRUN-LIVE1 run 4\n")
        silent = socket.create_connection(("127.0.0.1", monitor.port))
        deadline = time.monotonic() + 5
        while monitor.auth_failures < 3:
            assert time.monotonic() < deadline, monitor.auth_failures
            time.sleep(0.05)
        assert _identified(monitor) == [] and polling.lost == []
        stray.close()
        silent.close()
    finally:
        polling.stop()
        monitor.close()
