"""tmrun-ctl's start-up: its parameters are coerced without pydantic (typer would import it and
build a TypeAdapter per parameter), and ``status`` loads neither pydantic, rich nor torch."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading

import pytest
import typer.main

from tmrun.cli.ctl import app
from tmrun.cli.fast_params import coerce_plain, plain_coercion


def test_plain_values() -> None:
    assert coerce_plain(int, " 12 ") == 12 and coerce_plain(int, 3) == 3 and coerce_plain(float, "2.5") == 2.5
    assert coerce_plain(float, 4) == 4.0 and coerce_plain(str, "x") == "x" and coerce_plain(bool, "yes") is True
    assert coerce_plain(float, "inf") == float("inf") and coerce_plain(bool, False) is False
    for annotation, value in ((int, "1.5"), (int, "abc"), (int, True), (float, "x"), (float, "nan"), (bool, "maybe")):
        with pytest.raises(ValueError, match="is not a valid"):
            coerce_plain(annotation, value)
    with pytest.raises(TypeError):
        coerce_plain(list, "x")


def test_every_parameter_of_tmrun_ctl_gets_the_plain_coercion() -> None:
    command = typer.main.get_command(app)
    params = [p for sub in command.commands.values() for p in sub.params]
    assert plain_coercion(command) == len(params) + len(command.commands) + 1  # and each --help
    assert all(type(p._runtime_param).__name__ == "PlainParam" for p in params)


def _one_status_reply(listener: socket.socket) -> None:
    conn, _ = listener.accept()
    with conn:
        conn.settimeout(10)
        data = b""
        while b"\n" not in data:
            chunk = conn.recv(4096)
            if not chunk:
                return
            data += chunk
        assert json.loads(data)["op"] == "status"
        conn.sendall(json.dumps({"ok": True, "run_id": "r", "membership": {"phase": "running"}}).encode() + b"\n")


@pytest.mark.e2e  # starts a Python process: not in the unit subset
def test_status_loads_no_pydantic_rich_or_torch() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    server = threading.Thread(target=_one_status_reply, args=(listener,), daemon=True)
    server.start()
    try:
        result = subprocess.run([sys.executable, "-X", "importtime", "-m", "tmrun.cli.ctl", "status", "--json",
                                 "--endpoint", f"127.0.0.1:{port}", "--timeout", "10"],
                                capture_output=True, text=True, timeout=60, check=False)
    finally:
        server.join(timeout=10)
        listener.close()
    assert result.returncode == 0 and json.loads(result.stdout)["membership"]["phase"] == "running", result.stderr[-2000:]
    imported = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line]
    heavy = [m for m in imported if m.split(".")[0] in ("pydantic", "pydantic_core", "rich", "torch")]
    assert heavy == [], heavy
