"""The leader: the only writer of the job's membership.

It runs as a thread of the agent that hosts the rendezvous store (that process outlives its
workers). It admits nodes, forms the first group, and on a failure publishes a new epoch in
which a standby takes the failed node's group rank.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from torch.distributed import PrefixStore, Store

from tmrun.console import say
from tmrun.control import planner
from tmrun.control.events import record_event
from tmrun.control.ops import OpsServer
from tmrun.control.replacement.nodes import Decision, NodeReplacement
from tmrun.control.restarts import RestartAccounts, Restarted
from tmrun.protocol import keys
from tmrun.protocol.membership import GroupLimits, Membership, Phase
from tmrun.protocol.messages import ClosedNotice, FailureReport, ProtocolMessageError, registered_node
from tmrun.rendezvous.liveness import LivenessMonitor


HINT_GRACE = 10.0  # seconds forming waits for SLURM's first nodes before taking later ones as actives


@dataclass(frozen=True)
class LeaderConfig:
    run_id: str
    limits: GroupLimits
    last_call_timeout: float  # elastic: how long to wait for more than min_nodes
    join_timeout: float  # how long to wait for min_nodes, or for a lost rank's replacement
    failure_settle: float  # how long to wait for a root cause after a plain worker exception
    heartbeat_timeout: float
    standby_wait: float = 60.0  # in-place: how long a failed node waits for a warm standby node
    poll_interval: float = 0.02
    event_log: str | None = None  # the job's JSON-lines event log (docs/events.md); None: none
    ops_port: int = 0  # the operations endpoint's preferred port (0: any; taken: any)
    store_endpoint: str = ""  # host:port of the store (shown by tmrun-ctl status)
    token: str = field(default="", repr=False, compare=False)  # the job token ("": no authentication)


START_WINDOW = 120.0  # s: a worker failure this soon after its epoch's start, before tmrun.init(), is "at start"
_OWN_ERROR = re.compile(r"exit code -?\d+: ")  # a report that carries the worker's own error (launcher.worker_errors)
FAILED_STARTS = 2  # starts in a row that failed at start: the job ends (a crash loop, not bad luck)


def failed_at_start(reports: list[FailureReport], since_start: float, api_in_epoch: Callable[[], bool]) -> bool:
    """Whether the failure ``reports`` say is one at start: no node lost, seen within
    :data:`START_WINDOW` of the epoch's start (``since_start`` s), and no rank reached
    tmrun.init(), neither by the epoch's keys (``api_in_epoch``) nor by a node's own (one node
    with ``--standby N`` keeps them under its group's prefix: its report says so, and a node whose
    in-place controller ran had every rank there)."""
    return (not any(r.node_dead or r.reached_api or r.node_fallback for r in reports)
            and since_start < START_WINDOW and not api_in_epoch())


@dataclass
class _Pending:
    first_seen: float
    reports: list[FailureReport] = field(default_factory=list)


def _earliest(pending: _Pending) -> float:
    """The earliest evidence of a failure (Unix time): the reports' own instants (a worker's exit
    as its agent saw it, a lost node's last heartbeat), else when the leader first saw one."""
    seen = time.time() - (time.monotonic() - pending.first_seen)
    return min([r.at for r in pending.reports if r.at > 0] + [seen])


class Liveness(Protocol):
    """How the leader learns that agents went away: :class:`LivenessMonitor` (TCP connections
    to the store host) or :class:`~tmrun.rendezvous.election.EtcdLiveness` (etcd leases)."""

    port: int

    def poll(self, timeout: float, on_lost: Callable[[int, str, float], None]) -> None: ...

    def take_departed(self) -> list[int]: ...

    def close(self) -> None: ...


class Leader:
    def __init__(self, store: Store, config: LeaderConfig, raw_store: Store | None = None,
                 liveness: Liveness | None = None, takeover: bool = False) -> None:
        """``store`` is the job's prefixed store; ``raw_store`` the unprefixed one (the in-place
        protocol's keys are full paths shared with the workers); the same store by default.
        ``takeover``: an earlier leader of this job is gone (etcd); its decisions are in the
        store, and this leader goes on from them instead of forming a new group."""
        self._store = store
        self._config = config
        self._membership = Membership()
        self._known_nodes = 0
        self._hints: dict[int, int] = {}  # node id -> preferred group rank (SLURM node rank)
        self._joined: list[int] = []  # forming: nodes in join order
        self._enough_since: float | None = None
        self._started = time.monotonic()
        self._hole_since: float | None = None
        self._failures_seen = 0
        self._epoch_since = time.monotonic()  # when the current epoch was published
        self._failed_starts = 0  # epochs in a row whose workers failed at start (see _failed_at_start)
        self._pending: _Pending | None = None
        self._lost: dict[int, str] = {}
        self._lost_at: dict[int, float] = {}  # node id -> when its loss began (Unix time)
        self._stop = threading.Event()
        self._monitor: Liveness = liveness or LivenessMonitor(config.run_id, config.heartbeat_timeout,
                                                              token=config.token or None)
        self._takeover = takeover
        self._inplace = NodeReplacement(raw_store if raw_store is not None else store, store, config.run_id,
                                        config.standby_wait, skip_older=takeover)
        self._restarts = RestartAccounts(store)  # the group restarts' cost (the "restarted" events)
        self._thread = threading.Thread(target=self._run, name="tmrun-leader", daemon=True)
        self.error: BaseException | None = None
        # tmrun-ctl's endpoint: a thread and a store connection of its own, off the decision loop
        raw = raw_store if raw_store is not None else store
        ops_store = PrefixStore(keys.job_prefix(config.run_id), raw.clone()) if raw_store is not None else store
        self.ops = OpsServer(ops_store, config.run_id, config.event_log, port=config.ops_port,
                             store_endpoint=config.store_endpoint, token=config.token or None)
        self.ops_address = ""

    @property
    def liveness_port(self) -> int:
        return self._monitor.port

    def start(self, advertise_host: str) -> None:
        if self._monitor.port:
            self._store.set(keys.LIVENESS_ADDR, f"{advertise_host}:{self._monitor.port}")
        if self._takeover and self._store.check([keys.STATE]):
            self._resume()
        else:
            self._publish(self._membership)
        self.ops_address = self.ops.start(advertise_host)
        say(f"operations endpoint at {self.ops_address} (tmrun-ctl --endpoint {self.ops_address})")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._monitor.close()
        self.ops.stop()

    # -- the loop -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._monitor.poll(self._config.poll_interval, self._on_lost)
                if self._membership.is_closed():
                    continue
                for node_id in self._monitor.take_departed():
                    self._event("left", f"node {node_id} ({self._membership.role_of(node_id)}): its agent left",
                                nodes=[node_id])
                if self._store.check([keys.CLOSED]):
                    self._close_from_store()
                    continue
                self._admit_new_nodes()
                self._collect_failures()
                self._handle_lost()
                if self._membership.phase is Phase.FORMING:
                    self._maybe_form()
                else:
                    self._maybe_replace()
                    self._check_hole()
                    for recovered in self._inplace.recovered():
                        self._event("recovered", recovered.describe(), **recovered.fields())
                    self._restarted(self._restarts.poll())
                    if self._pending is None and self._config.limits.max_nodes > 1:
                        self._maybe_migrate()  # (on one node the agent's controller migrates ranks)
        except Exception as exc:  # the store went away or a bug: the job cannot continue
            if not self._stop.is_set():
                say(f"the tmrun leader stopped: {exc}")
                self.error = exc

    def _resume(self) -> None:
        """Go on from the previous leader's decisions: its membership, the failure reports it
        had handled; every node of the membership is expected alive (a lost one is found by
        the liveness check); nodes it had not admitted yet are admitted again."""
        self._membership = Membership.from_json(self._store.get(keys.STATE))
        if self._store.check([keys.FAIL_HANDLED]):
            self._failures_seen = int(self._store.get(keys.FAIL_HANDLED).decode() or 0)
        expect = getattr(self._monitor, "expect", None)
        if expect is not None:
            expect([n for n in self._membership.active + self._membership.standby if n >= 0])
        self._event("leader", f"took over the lead in epoch {self._membership.epoch} "
                              f"({self._membership.phase.value}); the job goes on in place")

    def _publish(self, membership: Membership) -> None:
        if membership.epoch != self._membership.epoch:
            self._epoch_since = time.monotonic()
        self._membership = membership
        self._store.set(keys.STATE, membership.to_json())
        self._store.add(keys.STATE_VERSION, 1)

    def _event(self, kind: str, detail: str, **fields: object) -> None:
        say(f"{kind}: {detail}")
        record_event(self._store, kind, self._membership.epoch, detail, **fields)

    def _on_lost(self, node_id: int, why: str, silent_for: float) -> None:
        self._lost[node_id] = why
        self._lost_at[node_id] = time.time() - silent_for  # the earliest evidence: when it was last heard from

    def _restarted(self, accounts: list[Restarted]) -> None:
        for account in accounts:
            self._event("restarted", account.describe(), **account.fields())

    # -- joins ----------------------------------------------------------------------------

    def _admit_new_nodes(self) -> None:
        count = self._store.add(keys.NODE_SEQ, 0)
        while self._known_nodes < count:
            registered = registered_node(self._store, self._known_nodes)
            if registered is None:
                return  # counted but has not written its id and info yet; next round
            node_id, info = registered
            self._known_nodes += 1
            if info.node_rank_hint >= 0:
                self._hints[node_id] = info.node_rank_hint
            if node_id in self._lost or self._membership.role_of(node_id) != "waiting" or node_id in self._joined:
                continue  # lost, or already placed (by an earlier leader of this job)
            if self._membership.phase is Phase.FORMING:
                self._joined.append(node_id)
                self._event("join", f"node {node_id} ({info.host}) joined", nodes=[node_id])
            else:
                admitted = planner.admit_node(self._membership, node_id, self._config.limits)
                self._publish(admitted)
                self._event("join", admitted.reason)

    def _preferred_missing(self, joined: list[int]) -> bool:
        """Every joined node has a node rank hint (SLURM) and one of the first max_nodes hints
        has not joined yet: the active nodes should be SLURM's first nodes, the standbys its last."""
        hints = {self._hints.get(n, -1) for n in joined}
        if -1 in hints:
            return False
        return any(rank not in hints for rank in range(self._config.limits.max_nodes))

    def _maybe_form(self) -> None:
        limits = self._config.limits
        now = time.monotonic()
        joined = sorted(self._joined, key=lambda n: (self._hints.get(n, 1 << 30), self._joined.index(n)))
        if len(joined) >= limits.min_nodes:
            if self._enough_since is None:
                self._enough_since = now
            waited = now - self._enough_since
            ready = (
                (len(joined) >= limits.max_nodes
                 and (not self._preferred_missing(joined) or waited >= min(self._config.last_call_timeout, HINT_GRACE)))
                or waited >= self._config.last_call_timeout
            )
            if ready:
                formed = planner.form_group(self._membership, joined, limits)
                self._publish(formed)
                self._event("formed", formed.reason)
        elif now - self._started > self._config.join_timeout:
            self._fail(f"only {len(joined)} of {limits.min_nodes} nodes joined within {self._config.join_timeout:g} s")

    # -- failures -------------------------------------------------------------------------

    def _collect_failures(self) -> None:
        count = self._store.add(keys.FAIL_SEQ, 0)
        while self._failures_seen < count:
            key = keys.failure(self._failures_seen)
            if not self._store.check([key]):
                return
            self._failures_seen += 1
            self._store.set(keys.FAIL_HANDLED, str(self._failures_seen))  # for a leader that takes over
            try:
                report = FailureReport.decode(key, self._store.get(key))
            except ProtocolMessageError as exc:
                self._event("stale", f"ignored a malformed failure report: {exc}")
                continue
            if report.epoch != self._membership.epoch:
                self._event("stale", f"refused a failure report of node {report.node_id} from epoch {report.epoch}")
                continue
            self._add_pending(report)

    def _add_pending(self, report: FailureReport) -> None:
        if self._pending is None:
            self._pending = _Pending(first_seen=time.monotonic())
        self._pending.reports.append(report)

    def _handle_lost(self) -> None:
        if not self._lost:
            return
        lost, self._lost = self._lost, {}
        for node_id, why in lost.items():
            if node_id in self._membership.dead:
                continue
            role = self._membership.role_of(node_id)
            self._event("lost", f"node {node_id} ({role}): {why}", nodes=[node_id])
            if self._membership.phase is Phase.FORMING:
                if node_id in self._joined:
                    self._joined.remove(node_id)
            elif role == "active":
                self._add_pending(
                    FailureReport(node_id, self._membership.epoch, by_signal=False, node_dead=True, detail=why,
                                  at=self._lost_at.pop(node_id, time.time()))
                )
            elif role == "standby":
                self._publish(planner.drop_standby(self._membership, node_id))

    def _maybe_replace(self) -> None:
        pending = self._pending
        if pending is None:
            return
        certain = any(r.by_signal or r.node_dead for r in pending.reports)
        if not certain and time.monotonic() - pending.first_seen < self._config.failure_settle:
            return
        culprits = [n for n in planner.blame(pending.reports) if n in self._membership.active]
        dead = {r.node_id for r in pending.reports if r.node_dead}
        if not culprits:  # late reports about nodes already replaced: nothing to do
            self._pending = None
            return
        node_fallback = "; ".join(dict.fromkeys(r.node_fallback for r in pending.reports
                                                if r.node_fallback and r.node_id in culprits))
        evidence = _earliest(pending)
        decision, swapped, why = self._inplace.decide(self._membership, culprits, dead, pending.first_seen,
                                                      node_fallback=node_fallback, evidence=evidence)
        if decision is Decision.WAIT:
            return
        self._pending = None
        every_report = "; ".join(f"node {r.node_id}: {r.detail}" for r in pending.reports)
        if decision is Decision.FINAL:
            self._event("failure", every_report)
            self._fail(f"{why}; the job ends failed (a restart would redo the whole training)")
            return
        if swapped is not None:
            self._publish(swapped)
            self._event("failure", every_report)
            self._event("replace", why)
            return
        causes = "; ".join(f"node {r.node_id}: {r.detail}" for r in pending.reports if r.node_id in culprits)
        if self._failed_at_start(pending):
            self._event("failure", causes)
            where = "" if _OWN_ERROR.search(causes) else "; its own error is in the workers' output"
            self._fail(f"the script fails at start: {self._failed_starts} starts in a row ended within "
                       f"{START_WINDOW:g} s, before any rank reached tmrun.init() ({causes}{where}); "
                       "not restarted again")
            return
        if decision is Decision.FALLBACK:
            self._event("fallback", f"{why}: the group restarts (as torchrun)")
        else:
            say(f"no in-place replacement: {why}")
        plan = planner.replace_failed(self._membership, culprits, dead, self._config.limits)
        old = self._membership
        self._publish(plan)
        self._event("failure", causes)
        self._event("replace", f"epoch {plan.epoch}: {plan.reason}")
        self._restarted(self._restarts.begin(old.epoch, plan.epoch, len(old.active), len(plan.active), evidence))
        if planner.HOLE in plan.active and self._hole_since is None:
            self._hole_since = time.monotonic()

    def _failed_at_start(self, pending: _Pending) -> bool:
        """Whether the script fails at start, again: this epoch's workers failed (no node was
        lost) within :data:`START_WINDOW` of the epoch's start with no rank in tmrun.init(), as in
        the epoch before. A crash loop (a bad argument) then ends after two starts, not after
        every restart the job allows."""
        at_start = failed_at_start(pending.reports, pending.first_seen - self._epoch_since,
                                   lambda: self._inplace.reached_api(self._membership))
        self._failed_starts = self._failed_starts + 1 if at_start else 0
        return self._failed_starts >= FAILED_STARTS

    def _maybe_migrate(self) -> None:
        swapped, events = self._inplace.migrate(self._membership)
        for kind, detail in events:
            self._event(kind, detail)
        if swapped is not None:
            self._publish(swapped)

    def _check_hole(self) -> None:
        if planner.HOLE not in self._membership.active:
            self._hole_since = None
            return
        if self._hole_since is not None and time.monotonic() - self._hole_since > self._config.join_timeout:
            self._fail(f"no node replaced the lost group rank within {self._config.join_timeout:g} s")

    # -- closing --------------------------------------------------------------------------

    def _fail(self, reason: str) -> None:
        self._store.compare_set(keys.CLOSED, "", ClosedNotice(Phase.FAILED.value, reason).encode())
        self._close_from_store()

    def _close_from_store(self) -> None:
        notice = ClosedNotice.decode(keys.CLOSED, self._store.get(keys.CLOSED))
        closed = planner.close(self._membership, Phase(notice.phase), notice.reason)
        for recovered in self._inplace.recovered(final=True):  # nobody steps any more
            self._event("recovered", recovered.describe(), **recovered.fields())
        self._restarted(self._restarts.finish(time.time()))
        self._publish(closed)
        self._event("closed", f"{closed.phase.value}: {closed.reason}")
