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
MAX_HELLO = 4096  # bytes of a hello line, newline included (a run id may be long)
MAX_NODE_DIGITS = 18  # a node id fits in an int64
HELLO_TIMEOUT = 10.0  # seconds a connection may take to say its hello (an agent sends it at once)
REFUSED_LOG_INTERVAL = 10.0  # at most one "refused" line per interval (a port scanner floods it)
GOODBYE = b"!"


def parse_hello(line: bytes, run_id: bytes) -> int | None:
    """The node id of an agent's hello line (``HELLO + b"<run id> <node id>"``, newline
    excluded), or None for anything else: never raises."""
    if len(line) >= MAX_HELLO or not line.startswith(HELLO):
        return None
    parts = line[len(HELLO) :].split(b" ")
    if len(parts) != 2 or parts[0] != run_id or not parts[1].isdigit() or len(parts[1]) > MAX_NODE_DIGITS:
        return None
    return int(parts[1])


def read_hello(buffer: bytes, run_id: bytes) -> int | None | bool:
    """What a connection's first bytes say: its node id (an int), False (refuse it: not one of
    ours), or None (wait for more)."""
    if b"\n" not in buffer:
        return False if len(buffer) >= MAX_HELLO else None
    node_id = parse_hello(buffer.split(b"\n", 1)[0], run_id)
    return False if node_id is None else node_id


@dataclass
class _Peer:
    sock: socket.socket
    buffer: bytes = b""
    node_id: int | None = None
    last_seen: float = 0.0
    opened: float = 0.0
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
        self._refused = 0  # connections refused since the last "refused" line
        self._refused_logged = -REFUSED_LOG_INTERVAL

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
            elif peer.node_id is None and now - peer.opened > HELLO_TIMEOUT:
                self._refuse(peer)  # connected and said no hello: not an agent (it would hold an fd forever)

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
        now = time.monotonic()
        peer = _Peer(sock=sock, last_seen=now, opened=now)
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
            hello = read_hello(peer.buffer, self._run_id)
            if hello is False:
                self._refuse(peer)
            elif hello is not None:
                peer.node_id = hello
                peer.buffer = b""

    def _refuse(self, peer: _Peer) -> None:
        """Drop a connection that is not one of this job's agents; say so at most once per
        :data:`REFUSED_LOG_INTERVAL` (a port scanner must not flood the log)."""
        self._drop(peer)
        self._refused += 1
        now = time.monotonic()
        if now - self._refused_logged >= REFUSED_LOG_INTERVAL:
            more = f" ({self._refused} since the last report)" if self._refused > 1 else ""
            say(f"liveness: refused a connection that is not from this job{more}")
            self._refused, self._refused_logged = 0, now

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
