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
from tmrun.protocol import auth

HELLO = b"TMRUN-LIVE1 "
MAX_HELLO = 4096  # bytes of a hello line, newline included (a run id may be long)
MAX_NODE_DIGITS = 18  # a node id fits in an int64
HELLO_TIMEOUT = 10.0  # seconds a connection may take to authenticate and say its hello
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
    leaving: bool = False  # said goodbye: its EOF is a departure, not a loss
    nonce: bytes = b""  # our challenge, until the peer proved the job token ("" : proved, or none asked)
    accepted: float = 0.0


class LivenessMonitor:
    """Leader side: accepts agents' connections and reports the nodes that went away.

    Not thread-safe on its own: ``poll`` is called from the leader's loop only.
    """

    def __init__(self, run_id: str, heartbeat_timeout: float, bind_host: str = "", token: str | None = None,
                 hello_timeout: float | None = None) -> None:
        self._run_id = run_id.encode()
        self._token = token or None  # None: no authentication (unit tests); the launcher always sets one
        # a connection must authenticate and say hello within this
        self._hello_timeout = HELLO_TIMEOUT if hello_timeout is None else hello_timeout
        self.auth_failures = 0
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

    def poll(self, timeout: float, on_lost: Callable[[int, str, float], None]) -> None:
        """Wait up to ``timeout`` for activity; call ``on_lost(node_id, why, silent_for)`` for each
        lost node (``silent_for``: seconds since it was last heard from, 0 for a closed connection)."""
        for key, _ in self._selector.select(timeout):
            if key.data is None:
                self._accept()
            else:
                self._read(key.data, on_lost)
        now = time.monotonic()
        for peer in list(self._peers.values()):
            if peer.node_id is None and now - peer.accepted > self._hello_timeout:
                self._refuse(peer, "no authentication within the time allowed" if peer.nonce else None)
                continue
            if peer.node_id is not None and now - peer.last_seen > self._timeout:
                self._drop(peer)
                on_lost(peer.node_id, f"no heartbeat for {self._timeout:g} s", now - peer.last_seen)

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
        peer = _Peer(sock=sock, last_seen=now, accepted=now)
        if self._token is not None:
            nonce = auth.offer_challenge(sock)
            if nonce is None:
                return
            peer.nonce = nonce
        self._peers[sock.fileno()] = peer
        self._selector.register(sock, selectors.EVENT_READ, peer)

    def _read(self, peer: _Peer, on_lost: Callable[[int, str, float], None]) -> None:
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
                on_lost(peer.node_id, reason, 0.0)
            elif peer.node_id is not None:
                self._departed.append(peer.node_id)
            return
        peer.last_seen = time.monotonic()
        if peer.node_id is None:
            peer.buffer += data
            if peer.nonce:
                if b"\n" not in peer.buffer:
                    if len(peer.buffer) > auth.MAX_LINE:
                        self._refuse(peer, "an oversized answer")
                    return
                line, peer.buffer = peer.buffer.split(b"\n", 1)
                assert self._token is not None
                reply = auth.check_answer(self._token, peer.nonce, line)
                if reply is None:
                    self._refuse(peer, "a wrong proof of the job token")
                    return
                try:
                    peer.sock.send(reply)
                except OSError:
                    self._drop(peer)
                    return
                peer.nonce = b""
            hello = read_hello(peer.buffer, self._run_id)
            if hello is False:
                self._refuse(peer, None)
            elif hello is not None:
                peer.node_id = hello
                peer.buffer = b""

    def _refuse(self, peer: _Peer, failure: str | None) -> None:
        """Drop a connection that is not one of this job's agents; ``failure``: it failed
        authentication (counted). Said at most once per :data:`REFUSED_LOG_INTERVAL`, with a
        count (a port scanner must not flood the log)."""
        self._drop(peer)
        if failure is not None:
            self.auth_failures += 1
        self._refused += 1
        now = time.monotonic()
        if now - self._refused_logged >= REFUSED_LOG_INTERVAL:
            why = f"it failed authentication: {failure}" if failure is not None else "not from this job"
            more = f"; {self._refused} refused since the last report" if self._refused > 1 else ""
            total = f"; {self.auth_failures} authentication failures so far" if self.auth_failures else ""
            say(f"liveness: refused a connection ({why}{more}{total})")
            self._refused, self._refused_logged = 0, now

    def _drop(self, peer: _Peer) -> None:
        fd = peer.sock.fileno()
        if fd in self._peers:
            del self._peers[fd]
            self._selector.unregister(peer.sock)
        peer.sock.close()


class LivenessBeacon:
    """Agent side: holds the connection to the leader and sends a byte every interval."""

    def __init__(self, host: str, port: int, run_id: str, node_id: int, interval: float,
                 token: str | None = None, timeout: float = 10.0) -> None:
        self._sock = socket.create_connection((host, port), timeout=timeout)
        hello = HELLO + f"{run_id} {node_id}\n".encode()
        if token:
            try:
                self._authenticate(token, hello, f"{host}:{port}")
            except BaseException:
                self._sock.close()
                raise
        else:
            self._sock.sendall(hello)
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tmrun-liveness", daemon=True)
        self._thread.start()

    def _authenticate(self, token: str, hello: bytes, where: str) -> None:
        """The challenge-response (protocol.auth), then the hello; raises auth.AuthError."""
        try:
            nonce_s, nonce_c, line = auth.answer(token, self._read_line(where))
            self._sock.sendall(line + hello)
            proof = self._read_line(where)
        except OSError as exc:
            raise auth.AuthError(f"liveness: no authentication exchange with the leader at {where} "
                                 f"({exc.strerror or type(exc).__name__})") from None
        if not proof:
            raise auth.AuthError(f"liveness: the leader at {where} refused this agent's job token "
                                 "(every agent of a job needs the same TMRUN_JOB_TOKEN_FILE / TMRUN_JOB_TOKEN)")
        if not auth.check_server(token, nonce_s, nonce_c, proof):
            raise auth.AuthError(f"liveness: the endpoint at {where} did not prove the job token "
                                 "(not this job's leader?)")

    def _read_line(self, where: str) -> bytes:
        data = b""
        while not data.endswith(b"\n"):
            chunk = self._sock.recv(1)  # a short line: byte by byte, nothing read past it
            if not chunk:
                return data
            data += chunk
            if len(data) > auth.MAX_LINE:
                raise auth.AuthError(f"liveness: {where} sent an oversized handshake line")
        return data

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
