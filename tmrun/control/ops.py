"""The leader's operations endpoint: ``tmrun-ctl`` talks to it instead of the store.

A thread of the store-hosting agent, beside the leader's decision loop (never on it): a TCP
listener (bound like the liveness listener), one line-delimited JSON request per connection,
one reply (:mod:`tmrun.protocol.ops`). Reads are bounded (:data:`~tmrun.protocol.ops.MAX_REQUEST`
bytes, ``request_timeout`` seconds); a malformed, oversized or slow request gets a one-line
error reply and its connection is closed; nothing a client sends can stop the thread. It reads
only what the store already holds (through a store of its own) and writes only what any
operator may write (a migration request, through the same channel as ``tm.migrate()``).

The same thread keeps the job's event log: every event in the store, appended as one JSON line
to ``event_log`` (docs/events.md), and ``totals()`` (downtime, steps recomputed, ETTR).
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tmrun.control import metrics
from tmrun.protocol import auth, keys
from tmrun.protocol import ops as wire
from tmrun.protocol.messages import Event, ProtocolMessageError, request_migration

if TYPE_CHECKING:
    from torch.distributed import Store


class EventLog:
    """Appends the store's events to a JSON-lines file, each once, in order (``seq``): events of
    the leader and of the one-node controller alike (both write them to the store)."""

    def __init__(self, path: str | None) -> None:
        self.path = Path(path) if path else None
        self._next = 0
        self._published: dict[int, float] = {}  # generation -> time of its replace/migrate event
        self.events: list[dict[str, Any]] = []  # every event so far, enriched (metrics.enrich)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")  # one job, one file (a rerun with the same run id starts it anew)

    def sync(self, store: Store) -> list[dict[str, Any]]:
        """Read the events written since the last call; append them to the file. Stops at the
        first number whose writer has not written yet; skips an entry that is not an event."""
        fresh = []
        for seq in range(self._next, store.add(keys.EVENT_SEQ, 0)):
            key = keys.event(seq)
            if not store.check([key]):
                break  # its writer took the number but has not written yet: next time
            self._next = seq + 1
            try:
                event = Event.decode(key, store.get(key), seq)
            except ProtocolMessageError:
                continue  # damaged or foreign: not ours to show
            data = {"seq": event.seq, "time": event.time, "kind": event.kind, "epoch": event.epoch,
                    "detail": event.detail, **event.fields}
            fresh.append(metrics.link_phases(metrics.enrich(data), self._published))
        if fresh and self.path is not None:
            with self.path.open("a") as out:
                out.writelines(json.dumps(e, sort_keys=True) + "\n" for e in fresh)
        self.events.extend(fresh)
        return fresh


class _Client:
    def __init__(self, sock: socket.socket, now: float) -> None:
        self.sock = sock
        self.buffer = b""
        self.since = now
        self.nonce = b""  # our challenge until the client proved the job token


class OpsServer:
    """Serve ``tmrun-ctl`` on ``bind_host:port`` (0: any free port) from its own thread."""

    def __init__(self, store: Store, run_id: str, event_log: str | None = None, bind_host: str = "",
                 port: int = 0, request_timeout: float = 2.0, sync_interval: float = 0.2,
                 store_endpoint: str = "", token: str | None = None) -> None:
        self._store = store  # the job's prefixed store; not the leader's (its own connection)
        self._run_id = run_id
        self._store_endpoint = store_endpoint
        self._timeout = request_timeout
        self._token = token or None  # None: no authentication (unit tests); the launcher always sets one
        self.auth_failures = 0
        self._sync_interval = sync_interval
        self.log = EventLog(event_log)
        try:
            self._listener = socket.create_server((bind_host, port), reuse_port=False)
        except OSError:
            if port == 0:
                raise
            self._listener = socket.create_server((bind_host, 0), reuse_port=False)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._clients: dict[int, _Client] = {}
        self._lock = threading.Lock()  # the store is used by this thread and by final_totals()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tmrun-ops", daemon=True)

    def start(self, advertise_host: str) -> str:
        address = f"{advertise_host}:{self.port}"
        self._store.set(keys.OPS_ADDR, address)
        self._thread.start()
        return address

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for client in list(self._clients.values()):
            self._close(client)
        self._selector.close()
        self._listener.close()

    def totals(self) -> dict[str, Any]:
        """Recovery totals from every event so far (reads the store's newest first)."""
        with self._lock:
            self.log.sync(self._store)
            return metrics.totals(self.log.events)

    # -- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        next_sync = 0.0
        while not self._stop.is_set():
            try:
                ready = self._selector.select(0.1)
            except (OSError, ValueError):
                return  # closed under us: stopping
            for key, _ in ready:
                if key.data is None:
                    self._accept()
                else:
                    self._read(key.data)
            now = time.monotonic()
            for client in list(self._clients.values()):
                if now - client.since > self._timeout:
                    if client.nonce:
                        self.auth_failures += 1
                    self._reply(client, {"ok": False, "error": f"no complete request within {self._timeout:g} s"})
            if now >= next_sync:
                next_sync = now + self._sync_interval
                try:
                    with self._lock:
                        self.log.sync(self._store)
                except Exception:  # noqa: BLE001 - the store is going away; requests will say so
                    next_sync = now + 1.0

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        sock.setblocking(False)
        client = _Client(sock, time.monotonic())
        if self._token is not None:
            nonce = auth.offer_challenge(sock)
            if nonce is None:
                return
            client.nonce = nonce
        self._clients[sock.fileno()] = client
        self._selector.register(sock, selectors.EVENT_READ, client)

    def _read(self, client: _Client) -> None:
        try:
            data = client.sock.recv(wire.MAX_REQUEST + 1)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close(client)
            return
        client.buffer += data
        if client.nonce:
            if b"\n" not in client.buffer:
                if len(client.buffer) > auth.MAX_LINE:
                    self.auth_failures += 1
                    self._reply(client, {"ok": False, "error": "authentication failed"})
                return
            line, client.buffer = client.buffer.split(b"\n", 1)
            assert self._token is not None
            proof = auth.check_answer(self._token, client.nonce, line)
            if proof is None:
                self.auth_failures += 1
                self._reply(client, {"ok": False, "error": "authentication failed"})
                return
            client.nonce = b""
            try:
                client.sock.send(proof)
            except OSError:
                self._close(client)
                return
        if b"\n" not in client.buffer:
            if len(client.buffer) > wire.MAX_REQUEST:
                self._reply(client, {"ok": False, "error": f"request longer than {wire.MAX_REQUEST} bytes"})
            return
        line = client.buffer.split(b"\n", 1)[0]
        try:
            request = wire.decode_request(line)
            reply = self._answer(request)
        except wire.OpsRequestError as exc:
            reply = {"ok": False, "error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - the store failed (the job is ending): say so, live on
            reply = {"ok": False, "error": f"the job's store did not answer: {type(exc).__name__}: {exc}"}
        self._reply(client, reply)

    def _reply(self, client: _Client, reply: dict[str, Any]) -> None:
        reply.setdefault("run_id", self._run_id)
        payload = (json.dumps(reply, default=str) + "\n").encode()
        try:
            client.sock.setblocking(True)
            client.sock.settimeout(self._timeout)
            client.sock.sendall(payload)
        except OSError:
            pass  # the client went away or does not read: its problem
        self._close(client)

    def _close(self, client: _Client) -> None:
        fd = client.sock.fileno()
        if fd >= 0 and fd in self._clients:
            del self._clients[fd]
            try:
                self._selector.unregister(client.sock)
            except (KeyError, ValueError):
                pass
        client.sock.close()

    # -- requests ----------------------------------------------------------------------------

    def _answer(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request["op"]
        if op == "ping":
            return {"ok": True, "pid": os.getpid()}
        if op == "events":
            with self._lock:
                self.log.sync(self._store)
                events = [e for e in self.log.events if e["seq"] >= request.get("since", 0)]
            return {"ok": True, "events": events, "next": events[-1]["seq"] + 1 if events else request.get("since", 0)}
        if op == "migrate":
            rank, node = request.get("rank", -1), request.get("node", -1)
            reason = str(request.get("reason") or "operator request")[:300]
            with self._lock:
                seq = request_migration(self._store, rank, reason, node=node)
            return {"ok": True, "request": seq}
        # status
        from tmrun.control.status import read_status

        with self._lock:
            job = read_status(self._store, self._run_id, self._store_endpoint, with_events=False)  # the log has them
            self.log.sync(self._store)
            t = metrics.totals(self.log.events)
        data = asdict(job)
        data.pop("events", None)
        data["membership"]["phase"] = job.membership.phase.value
        data["totals"] = t
        data["next_event"] = len(self.log.events)
        data["event_log"] = str(self.log.path) if self.log.path else None
        data["ok"] = True
        return data
