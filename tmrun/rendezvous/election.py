"""Leadership and liveness of agents on etcd: one lease per agent.

Every agent of a ``tmrun-etcd`` job holds one etcd lease, renewed by a thread every third of its
TTL. Two keys hang on it:

* ``leader/lease`` (job namespace): whoever created it leads. An agent that finds it absent
  creates it (an etcd transaction: only one creator wins) and starts the leader. When the
  leading agent dies, its lease expires after at most one TTL, the key disappears, and another
  agent takes the lead: the job goes on in place.
* ``alive/<node id>``: the agent is alive. The leader's :class:`EtcdLiveness` declares a node lost
  when its key disappears without a ``departed/<node id>`` key (a goodbye) before it.

An agent whose lease expired anyway (it was stopped longer than a TTL, or cut off from etcd)
steps down at once: it stops its leader, if it led, and says so; the leader that took over
has declared its node lost.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Protocol

from tmrun.console import say
from tmrun.protocol import keys
from tmrun.protocol.etcd import EtcdError, EtcdStore

LEADER_KEY = "leader/lease"


def job_key_prefix(run_id: str) -> str:
    """What the job's keys start with in the raw store: torch's PrefixStore puts a "/" between
    its prefix and each key (the handler's store is ``PrefixStore(keys.job_prefix(run_id), raw)``)."""
    return keys.job_prefix(run_id) + "/"


def alive_key(node_id: int) -> str:
    return f"alive/{node_id}"


def departed_key(node_id: int) -> str:
    return f"departed/{node_id}"


class Leading(Protocol):
    error: BaseException | None

    def stop(self) -> None: ...


class _FailedLeader:
    """A leader that could not start: the agent's next rendezvous check reports ``error``."""

    def __init__(self, error: BaseException) -> None:
        self.error: BaseException | None = error

    def stop(self) -> None:
        pass


class AgentLease:
    """This agent's lease, its keys, and its candidacy for the lead.

    ``start_leader(takeover)`` is called on the lease's thread when this agent wins the lead
    (``takeover``: a leader existed before, whose state is in the store); it returns the
    running leader, which is stopped when the lease is lost or on :meth:`close`."""

    def __init__(self, store: EtcdStore, run_id: str, ttl: float,
                 start_leader: Callable[[bool], Leading], campaign_interval: float = 0.1) -> None:
        self._store = store
        self._job = job_key_prefix(run_id)
        self._ttl = max(1.0, ttl)
        self._start_leader = start_leader
        self._interval = campaign_interval
        self._identity = f"{socket.gethostname()}:{os.getpid()}"
        self._lease = store.grant_lease(self._ttl)
        self._renewed = time.monotonic()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._node_id: int | None = None
        self.leader: Leading | None = None
        self.lost = False  # the lease expired: this agent is no longer part of the job
        self._thread = threading.Thread(target=self._run, name="tmrun-lease", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def register(self, node_id: int, info: bytes) -> None:
        """Say that node ``node_id`` (this agent) is alive, for as long as the lease lives."""
        self._node_id = node_id
        self._store.put(self._job + alive_key(node_id), info, lease=self._lease)

    def close(self, departed: bool = True) -> None:
        """Leave: a goodbye (the leader sees a departure, not a loss), the lead handed on."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._stop_leader()
        try:
            if departed and self._node_id is not None:
                self._store.set(self._job + departed_key(self._node_id), "1")
            self._store.revoke_lease(self._lease)  # the lead is free at once, not after a TTL
        except EtcdError:
            pass  # etcd is gone: the lease expires by itself

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        renew_every = self._ttl / 3.0
        next_renewal = time.monotonic() + renew_every
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_renewal:
                if not self._renew():
                    return
                next_renewal = time.monotonic() + renew_every
            if self.leader is None:
                self._campaign()
            self._stop.wait(self._interval)

    def _renew(self) -> bool:
        try:
            remaining = self._store.keep_alive(self._lease)
        except EtcdError as exc:
            if time.monotonic() - self._renewed < self._ttl:
                return True  # try again at the next tick, the lease still runs
            remaining, why = 0.0, str(exc)
        else:
            why = "etcd says it expired"
        if remaining > 0:
            self._renewed = time.monotonic()
            return True
        self.lost = True
        say(f"this agent's etcd lease is lost ({why}); it is no longer part of the job")
        self._stop_leader()
        return False

    def _campaign(self) -> None:
        key = self._job + LEADER_KEY
        try:
            if not self._store.create(key, self._identity, lease=self._lease):
                return  # one etcd call per tick while another agent leads
        except EtcdError:
            return  # etcd unreachable for now: the lease thread decides when that is fatal
        try:  # a leader before this one wrote the membership (only a leader writes it)
            existed = self._store.check([self._job + keys.STATE])
        except EtcdError:
            existed = True  # this agent holds the lead now; a leader taking over reads what is there

        say("this agent leads the job" + (" (took over: the previous leader's lease expired)" if existed else ""))
        try:
            leader: Leading = self._start_leader(existed)
        except Exception as exc:  # noqa: BLE001 - the agent's rendezvous says it in one line
            leader = _FailedLeader(exc)
        with self._lock:
            self.leader = leader

    def _stop_leader(self) -> None:
        with self._lock:
            leader, self.leader = self.leader, None
        if leader is not None:
            leader.stop()


class EtcdLiveness:
    """Leader side of liveness on etcd (the interface of :class:`~tmrun.rendezvous.liveness.LivenessMonitor`).

    A node is known once its ``alive/<id>`` key was seen (or :meth:`expect` names it: a leader
    that takes over expects every node of the membership). A known node whose key is gone is
    departed if it said goodbye (``departed/<id>``), else lost: its agent's lease expired."""

    port = 0  # nothing to listen on: agents keep their leases in etcd

    def __init__(self, store: EtcdStore, run_id: str, ttl: float, check_interval: float = 0.1) -> None:
        self._store = store
        self._job = job_key_prefix(run_id)
        self._ttl = ttl
        self._interval = check_interval
        self._known: set[int] = set()
        self._departed: list[int] = []
        self._next_check = 0.0

    def expect(self, node_ids: list[int]) -> None:
        self._known.update(node_ids)

    def take_departed(self) -> list[int]:
        departed, self._departed = self._departed, []
        return departed

    def poll(self, timeout: float, on_lost: Callable[[int, str, float], None]) -> None:
        time.sleep(timeout)
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + self._interval
        alive = set()
        for key in self._store.list_prefix(self._job + "alive/"):
            tail = key.rsplit("/", 1)[-1]
            if tail.isdigit():
                alive.add(int(tail))
        self._known |= alive
        for node_id in sorted(self._known - alive):
            self._known.discard(node_id)
            if self._store.check([self._job + departed_key(node_id)]):
                self._departed.append(node_id)
            else:
                # (its last keep-alive came about a lease's time before the lease expired)
                on_lost(node_id, f"its agent's etcd lease expired (no keep-alive within {self._ttl:g} s)", self._ttl)

    def close(self) -> None:
        pass
