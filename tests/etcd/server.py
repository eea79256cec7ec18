"""A real etcd (Debian's etcd-server) on loopback for tests: free ports, its own data directory,
started and killed by PID; skipped with the reason where this machine has no etcd."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import free_port, wait_until


@dataclass
class EtcdServer:
    proc: subprocess.Popen[bytes]
    client_port: int
    peer_port: int
    data_dir: Path
    log: Path

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def alive(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/version", timeout=1) as reply:
                return b"etcdserver" in reply.read()
        except OSError:
            return False

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def etcdctl(self, *args: str, env: dict[str, str] | None = None) -> str:
        out = subprocess.run(["etcdctl", f"--endpoints={self.endpoint}", *args], capture_output=True, timeout=30,
                             env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin", **(env or {})})
        if out.returncode != 0:
            raise RuntimeError(f"etcdctl {' '.join(args)}: {out.stderr.decode().strip()}")
        return out.stdout.decode()

    def put_json(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(f"http://{self.endpoint}{path}", data=json.dumps(body).encode(), method="POST")
        with urllib.request.urlopen(request, timeout=5) as reply:
            return json.loads(reply.read())


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def why_no_etcd() -> str:
    """Empty when an etcd server can run here, else why not."""
    if shutil.which("etcd") is None:
        return "the etcd binary is not installed (Debian package etcd-server)"
    return ""


def start_etcd(directory: Path, extra: list[str] | None = None, scheme: str = "http") -> EtcdServer:
    client, peer = free_port(), free_port()
    data = directory / "etcd-data"
    log = directory / "etcd.log"
    cmd = [
        "etcd", "--name", "test", "--data-dir", str(data),
        "--listen-client-urls", f"{scheme}://127.0.0.1:{client}", "--advertise-client-urls", f"{scheme}://127.0.0.1:{client}",
        "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-cluster", f"test=http://127.0.0.1:{peer}", "--log-level", "warn", *(extra or []),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    server = EtcdServer(proc, client, peer, data, log)
    if scheme == "http":
        ready = wait_until(lambda: server.alive() or proc.poll() is not None, 30)
    else:  # https: no plain request answers; the listening port (etcd listens once it can serve) tells
        ready = wait_until(lambda: _accepts(client) or proc.poll() is not None, 30)
        time.sleep(0.5)
    if not ready or proc.poll() is not None:
        server.stop()
        raise RuntimeError(f"etcd did not start: {log.read_text()[-2000:]}")
    return server
