"""Liveness of agents: a TCP connection from every agent to the leader.

A process that dies (SIGKILL included) has its socket closed by the kernel, so the leader sees
EOF at once; heartbeats catch what a closed socket cannot (a host that vanished, a hung agent).
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tmrun.console import say

HELLO = b"TMRUN-LIVE1 "
MAX_HELLO = 256
GOODBYE = b"!"


@dataclass
class _Peer:
    sock: socket.socket
    buffer: bytes = b""
    node_id: int | None = None
    last_seen: float = 0.0
    leaving: bool = False  # said goodbye: its EOF is a departure, not a loss


class LivenessMonitor:
    """Leader side: accepts agents' connections and reports the nodes that went away.

    Not thread-safe on its own: ``poll`` is called from the leader's loop only.
    """

    def __init__(self, run_id: str, heartbeat_timeout: float, bind_host: str = "") -> None:
        self._run_id = run_id.encode()
        self._timeout = heartbeat_timeout
        self._selector = selectors.DefaultSelector()
        self._listener = socket.create_server((bind_host, 0), reuse_port=False)
        self._listener.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._peers: dict[int, _Peer] = {}  # fd -> peer
        self.port: int = self._listener.getsockname()[1]
        self._departed: list[int] = []  # nodes whose agent said goodbye and closed

    def take_departed(self) -> list[int]:
        """Nodes whose agent left on purpose (goodbye, then EOF) since the last call."""
        departed, self._departed = self._departed, []
        return departed

    def poll(self, timeout: float, on_lost: Callable[[int, str], None]) -> None:
        """Wait up to ``timeout`` for activity; call ``on_lost(node_id, why)`` for each lost node."""
        for key, _ in self._selector.select(timeout):
            if key.data is None:
                self._accept()
            else:
                self._read(key.data, on_lost)
        now = time.monotonic()
        for peer in list(self._peers.values()):
            if peer.node_id is not None and now - peer.last_seen > self._timeout:
                self._drop(peer)
                on_lost(peer.node_id, f"no heartbeat for {self._timeout:g} s")

    def close(self) -> None:
        for peer in list(self._peers.values()):
            self._drop(peer)
        self._selector.unregister(self._listener)
        self._listener.close()
        self._selector.close()

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except BlockingIOError:
            return
        sock.setblocking(False)
        peer = _Peer(sock=sock, last_seen=time.monotonic())
        self._peers[sock.fileno()] = peer
        self._selector.register(sock, selectors.EVENT_READ, peer)

    def _read(self, peer: _Peer, on_lost: Callable[[int, str], None]) -> None:
        try:
            data = peer.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError as exc:
            data, reason = b"", f"connection error: {exc.strerror}"
        else:
            reason = "agent process exited (connection closed)"
        if GOODBYE in data:
            peer.leaving = True
        if not data:
            self._drop(peer)
            if peer.node_id is not None and not peer.leaving:
                on_lost(peer.node_id, reason)
            elif peer.node_id is not None:
                self._departed.append(peer.node_id)
            return
        peer.last_seen = time.monotonic()
        if peer.node_id is None:
            peer.buffer += data
            if b"\n" not in peer.buffer:
                if len(peer.buffer) > MAX_HELLO:
                    self._drop(peer)  # not one of ours: ignore it
                return
            line = peer.buffer.split(b"\n", 1)[0]
            node_id = self._parse_hello(line)
            if node_id is None:
                say("liveness: refused a connection that is not from this job")
                self._drop(peer)
                return
            peer.node_id = node_id

    def _parse_hello(self, line: bytes) -> int | None:
        if not line.startswith(HELLO):
            return None
        parts = line[len(HELLO) :].split(b" ")
        if len(parts) != 2 or parts[0] != self._run_id or not parts[1].isdigit():
            return None
        return int(parts[1])

    def _drop(self, peer: _Peer) -> None:
        fd = peer.sock.fileno()
        if fd in self._peers:
            del self._peers[fd]
            self._selector.unregister(peer.sock)
        peer.sock.close()


class LivenessBeacon:
    """Agent side: holds the connection to the leader and sends a byte every interval."""

    def __init__(self, host: str, port: int, run_id: str, node_id: int, interval: float) -> None:
        self._sock = socket.create_connection((host, port), timeout=10.0)
        self._sock.sendall(HELLO + f"{run_id} {node_id}\n".encode())
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tmrun-liveness", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._sock.sendall(b".")
            except OSError:
                return  # the leader is gone; store calls will report it

    def close(self) -> None:
        """Leave on purpose: the leader will not count this node as lost."""
        self._stop.set()
        self._thread.join(timeout=2 * self._interval + 1)
        try:
            self._sock.sendall(GOODBYE)
        except OSError:
            pass
        self._sock.close()
