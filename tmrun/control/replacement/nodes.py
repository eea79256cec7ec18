"""Policy for several nodes: a member is a node, a standby is a standby node's warm workers.

Two halves, on different processes:

* :class:`NodeReplacement` runs in the leader. Before it changes the membership for a failed
  node it asks :meth:`~NodeReplacement.decide`: when every rank of the current epoch runs the
  tmrun worker API, a ready standby node's warm standby workers take the failed node's ranks *in
  place* (a new generation of the epoch's in-place prefix and a membership change with no new
  epoch, so no survivor's agent restarts its workers). Without a ready standby node within
  ``standby_wait`` seconds the workers are told to give up in-place recovery and the leader
  falls back to a new epoch (torchrun's restart of the group). A plain torchrun script always
  gets that fallback. It also moves whole nodes for planned migrations.
* :class:`NodeWatch` runs in every active node's agent: it copies the epoch's generation into
  the node's generation file, and when one of its workers fails or a survivor reports one of its
  live ranks lost, it stops every worker of the node (a member is a node) and reports the node
  failed to the leader, once.

Keys written by the agents: every active agent publishes its node's ranks (``node_ranks``),
every standby agent its standby workers in local rank order (``standby_node``); the standby
workers say when they are warm (``standby_ready``).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from torch.distributed import PrefixStore, Store

from tmrun.console import say
from tmrun.control import planner
from tmrun.control.detection import Detection
from tmrun.control.events import record_event
from tmrun.control.replacement import core
from tmrun.protocol import keys
from tmrun.protocol import messages as proto
from tmrun.protocol.membership import Membership


class Decision(Enum):
    IN_PLACE = "in-place"  # a standby node took over; publish the returned membership
    WAIT = "wait"  # in-place is possible but no standby node is warm yet: ask again
    FALLBACK = "fallback"  # in-place was possible but cannot happen: restart the group (logged)
    PLAIN = "plain"  # not an in-place job (yet): restart the group, as torchrun would
    FINAL = "final"  # every other rank already finished its steps: the job ends failed (a restart
    # would redo the whole training, and there is no one left to heal a joiner from)


class NodeReplacement:
    def __init__(self, store: Store, job_store: Store, run_id: str, standby_wait: float,
                 skip_older: bool = False) -> None:
        self._raw = store  # unprefixed: the workers' prefix is a full key path
        self._run_id = run_id
        self._standby_wait = standby_wait
        self._recoveries = core.Recoveries()
        # planned migrations are requested at the job level (tmrun-ctl migrate, tm.migrate())
        # (skip_older: a leader that took over leaves the requests its predecessor saw)
        self._migrations = core.MigrationInbox(job_store, skip_older=skip_older)

    def _epoch_store(self, epoch: int) -> Store:
        return PrefixStore(keys.node_prefix(self._run_id, epoch), self._raw)

    @staticmethod
    def _api_ranks(store: Store, membership: Membership) -> list[list[int]] | None:
        """Every active node's ranks once all of them run the tmrun worker API, else None."""
        wanted = [keys.node_ranks(g) for g in range(len(membership.active))]
        if not wanted or not store.check(wanted):
            return None
        ranks = [proto.NodeRanks.decode(key, store.get(key)).ranks for key in wanted]
        return ranks if core.api_ready(store, sum(map(len, ranks))) else None

    @staticmethod
    def _ready_standby_nodes(store: Store, membership: Membership, size: int) -> list[tuple[int, list[int]]]:
        """(node id, standby ids by local rank) of the standby nodes whose ``size`` standby
        workers are all warm, in promotion order."""
        ready = []
        for node_id in membership.standby:
            key = keys.standby_node(node_id)
            if not store.check([key]):
                continue
            ids = proto.StandbyNode.decode(key, store.get(key)).ids
            if len(ids) == size and core.standbys_ready(store, ids):
                ready.append((node_id, ids))
        return ready

    def reached_api(self, membership: Membership) -> bool:
        """Whether a rank of ``membership``'s epoch reached ``tmrun.init()``."""
        return self._epoch_store(membership.epoch).check([keys.API])

    def decide(self, membership: Membership, culprits: list[int], dead: set[int],
               first_seen: float, node_fallback: str = "", evidence: float | None = None,
               ) -> tuple[Decision, Membership | None, str]:
        """What to do about ``culprits`` (active nodes that failed; ``dead`` ones are gone).
        Returns the decision, the new membership (in place) and a line for the event log.
        ``node_fallback``: a culprit's own in-place controller (one node, ``--standby N``: its
        workers keep their keys under the group's prefix, not this epoch's) already gave up on
        the failure, and why: the group restarts."""
        if node_fallback:
            return Decision.PLAIN, None, f"the node's in-place replacement gave up ({node_fallback})"
        store = self._epoch_store(membership.epoch)
        generations = core.Generations(store)
        if not store.check([keys.API]):
            # the same key is missing when the script failed before tmrun.init(): say both
            return Decision.PLAIN, None, ("no rank reached tmrun.init() in this epoch (the script does not use "
                                          "the tmrun worker API, or failed before it)")
        if generations.abandoned():
            return Decision.FALLBACK, None, "in-place recovery was already abandoned in this epoch"
        diverged = core.diverged(store)
        if diverged:  # replicas disagree once healed: the job ends failed (no restart)
            return Decision.FINAL, None, diverged
        unhealable = core.unhealable(store)
        if unhealable:  # the members found a shard with no live replica: no standby node can help
            generations.abandon(unhealable)
            return Decision.FALLBACK, None, unhealable
        ranks = self._api_ranks(store, membership)
        if ranks is None:
            return Decision.PLAIN, None, "not every rank had started the tmrun worker API"
        failed = [c for c in culprits if c in membership.active]
        failed_ranks = {r for c in failed for r in ranks[membership.active.index(c)]}
        others = [r for node_ranks in ranks for r in node_ranks if r not in failed_ranks]
        if failed and core.others_done(store, others):
            return Decision.FINAL, None, "a node failed after every other rank had finished its steps"
        if failed and not others:  # every node failed: a plan of new members only has nobody to heal from
            why = "no rank holds the training state any more (every node failed)"
            generations.abandon(why)
            return Decision.FALLBACK, None, why
        size = len(ranks[membership.active.index(failed[0])]) if failed else 0
        if not failed or any(len(ranks[membership.active.index(c)]) != size for c in failed):
            return Decision.FALLBACK, None, "failed nodes of different sizes"
        standby = self._ready_standby_nodes(store, membership, size)
        if len(standby) < len(failed):
            if time.monotonic() - first_seen < self._standby_wait:
                return Decision.WAIT, None, ""
            why = f"no warm standby node within {self._standby_wait:g}s"
            generations.abandon(why)
            return Decision.FALLBACK, None, why
        swapped, why = self._publish(store, membership, ranks, dict(zip(failed, (n for n, _ in standby))),
                                     dict(standby), dead, planned=False, started=first_seen, evidence=evidence)
        return Decision.IN_PLACE, swapped, why

    def _publish(self, store: Store, membership: Membership, ranks: list[list[int]], moves: dict[int, int],
                 standby_ids: dict[int, list[int]], dead: set[int], planned: bool,
                 started: float, asked: float = 0.0, evidence: float | None = None) -> tuple[Membership, str]:
        """Generation gen+1 of the epoch: each node in ``moves`` is replaced by its standby node."""
        world_size = sum(len(r) for r in ranks)
        replaced: dict[int, int] = {}
        for culprit, node_id in moves.items():
            group_rank = membership.active.index(culprit)
            replaced.update(zip(ranks[group_rank], standby_ids[node_id]))
            store.set(keys.node_ranks(group_rank), proto.NodeRanks(node_id, ranks[group_rank]).encode())
        swapped = planner.replace_in_place(membership, moves, dead)
        gen = core.Generations(store).publish(world_size, replaced, swapped.reason, planned)
        self._recoveries.begin(store, gen, world_size, started, asked=asked, evidence=evidence)
        ranks_moved = ", ".join(f"{rank}->standby {sid}" for rank, sid in sorted(replaced.items()))
        return swapped, f"generation {gen}: {swapped.reason} (ranks {ranks_moved})"

    def migrate(self, membership: Membership) -> tuple[Membership | None, list[tuple[str, str]]]:
        """Planned migrations requested since the last call: the whole node that holds the rank
        moves to a warm standby node at a step boundary (its workers hand their state over and
        leave; nothing is recomputed). Returns the new membership (or None) and events (kind, detail).
        One change at a time: nothing happens while a recovery is under way."""
        events: list[tuple[str, str]] = []
        for request in self._migrations.requests(lambda: bool(self._recoveries)):
            if isinstance(request, proto.ProtocolMessageError):
                events.append(("migrate-refused", f"malformed request ({request})"))
                continue
            store = self._epoch_store(membership.epoch)
            ranks = self._api_ranks(store, membership)
            if ranks is None:
                events.append(("migrate-refused", f"{request.describe()}: the job does not run the tmrun worker API"))
                continue
            group_rank = request.node if request.node >= 0 else next(
                (g for g, node_ranks in enumerate(ranks) if request.rank in node_ranks), -1)
            if not 0 <= group_rank < len(ranks):
                events.append(("migrate-refused", f"{request.describe()}: no such rank or node in this job"))
                continue
            if core.any_done(store, [r for node_ranks in ranks for r in node_ranks]):
                events.append(("migrate-refused", f"{request.describe()}: the training is finishing"))
                continue
            unhealable = core.unhealable(store)  # (a gloo group: no joiner can enter it)
            if unhealable:
                events.append(("migrate-refused", f"{request.describe()}: {unhealable}"))
                continue
            standby = self._ready_standby_nodes(store, membership, len(ranks[group_rank]))
            if not standby:
                events.append(("migrate-refused", f"{request.describe()}: no warm standby node"))
                continue
            node_id, ids = standby[0]
            swapped, why = self._publish(store, membership, ranks, {membership.active[group_rank]: node_id},
                                         {node_id: ids}, set(), planned=True, started=time.monotonic(),
                                         asked=request.time)
            events.append(("migrate", f"{why}: {request.reason}"))
            return swapped, events
        return None, events

    def recovered(self, final: bool = False) -> list[core.Recovered]:
        """Generations whose every rank finished recovering, for the event log, with their phases:
        each once its ranks completed their first step after it (or ``final``: the job ends)."""
        self._recoveries.poll()
        return self._recoveries.completed(final=final)


# seconds a survivor's report waits for the rank's own exit: the node's local exit, its root cause,
# wins the blame within it (a survivor may see the hang-up first); a rank that said goodbye (a
# worker that raised closes its communicators at exit first: its goodbye, then its completer, up
# to about 2.5 s) has this long again, as its own exit code is the cause to report
REPORT_SETTLE = core.LEAVING_GRACE


@dataclass
class NodeOutcome:
    finished: bool = False  # every rank of this node exited 0
    failed: bool = False  # this node's workers failed and were stopped; the leader decides


class NodeWatch:
    """One active node of an in-place job over several nodes, seen from its agent."""

    def __init__(self, store: Store, world_size: int, gen_file: str,
                 report_failure: Callable[[bool, str], None], detection: Detection | None = None,
                 job_store: Store | None = None, settle: float = REPORT_SETTLE) -> None:
        self._store = store
        self._world_size = world_size
        self.detection = detection  # hangs fence the node; stragglers and bad GPUs ask a migration
        self._job = job_store
        self._gen_file = gen_file
        self._report_failure = report_failure
        self._reports = core.ReportInbox(store)
        self.enabled = core.ApiGate(store, world_size)  # enabled(): every rank runs the worker API
        self._gen = -1
        self.slots = core.Slots()
        self.failed = False
        self._waiting_for_standby = core.MigrationsWaiting("this node moves")  # ranks to move once a standby node is warm
        self._settle = settle  # seconds a survivor's report waits for the rank's own exit (blame)
        self._accusations = self._new_accusations()
        self._mirror_gen()

    def _new_accusations(self) -> core.Accusations:
        return core.Accusations(self._settle, self._settle, goodbye_grace=self._settle + core.LEAVING_GRACE)

    def adopt(self, processes: dict[int, subprocess.Popen[bytes]], promoted: bool) -> None:
        self.slots.adopt(processes, promoted=promoted)
        self.failed = False
        self._accusations = self._new_accusations()

    def step(self) -> NodeOutcome:
        self._mirror_gen()
        if self.failed:
            return NodeOutcome(failed=True)
        for stale in self._accusations.superseded(self._gen):
            # the loss that the report saw was elsewhere: the leader replaced it meanwhile (a rank
            # of ours read a link that a live peer closed on seeing another rank go)
            say(f"{_blame(stale.report, stale.pid)}: generation {self._gen} superseded that report; nothing stopped")
        for report in self._reports:
            # A survivor lost one of our ranks while its process still runs. It may be exiting
            # with an error right now (the survivor saw the hang-up first): within the settle
            # time the local exit, the root cause, wins the blame; after it, the report does (a
            # hung or cut-off rank that never exits is fenced, with its whole node).
            accusation = self._accusations.note(report, self.slots, self._gen)
            if accusation is not None:
                say(f"{_blame(report, accusation.pid)}; waiting up to {self._accusations.wait(accusation):g}s "
                    "for its own exit before blaming the report")
        bad = self.slots.failed()
        due = self._accusations.due(self.slots, self._gen)
        if due and not bad:
            slot, report = due[0]
            self._fail(_blame(report, slot.pid))
            return NodeOutcome(failed=True)
        if bad:
            self._fail(", ".join(f"rank {rank} {core.how_it_ended(code)}" for rank, code in bad.items()),
                       by_signal=any(code < 0 for code in bad.values()))
            return NodeOutcome(failed=True)
        if self._accusations:
            return NodeOutcome()  # a report waits for its rank's own exit
        if self._detect():
            return NodeOutcome(failed=True)
        return NodeOutcome(finished=self.slots.all_succeeded())

    def publish_last_progress(self) -> None:
        """Every rank finished: the progress records published once more (each rank's last
        process, exited now), for the leader's count of a group restart as the job closes."""
        if self.detection is not None:
            self.detection.publish_last(self.slots.rank_pids())

    def _detect(self) -> bool:
        """A hung rank of this node fails the node (fenced, reported: the leader replaces it); a
        straggler or a rank on an unhealthy GPU asks the leader for a planned migration of the
        node (once). Returns True when the node failed."""
        detection = self.detection
        if detection is None or not self.enabled():
            return False
        pids = {slot.rank: slot.pid for slot in self.slots.by_rank.values() if slot.poll() is None}
        busy = self._gen > 0 and self._store.add(keys.recovered(self._gen), 0) < self._world_size
        findings = detection.poll(pids, busy=busy)
        if (findings.hung or findings.notes) and core.any_done(self._store, self.slots.ranks()):
            return False  # the training is finishing: nobody steps any more
        for note in findings.notes:
            say(note)
        if findings.hung:
            self._fail("; ".join(f"rank {rank} (pid {pids[rank]}) hangs ({why})" for rank, why in findings.hung))
            return True
        for rank, kind, why in findings.migrate:
            if self._job is None:
                continue
            if busy or not self._standby_node_warm():  # the leader would refuse: ask once one is
                self._waiting_for_standby.wait(detection, rank, kind, why, "standby node")
                continue
            self._waiting_for_standby.done(rank)
            say(f"rank {rank}: {why}; asking for a migration of this node")
            record_event(self._job, kind, self._gen, f"rank {rank}: {why}")
            proto.request_migration(self._job, rank, why)
        return False

    def _standby_node_warm(self) -> bool:
        """True when a standby node of this node's size has every standby worker warm (what
        the leader's migration needs), read from the membership and the epoch's store."""
        assert self._job is not None
        if not self._job.check([keys.STATE]):
            return False
        membership = Membership.from_json(self._job.get(keys.STATE))
        for node_id in membership.standby:
            key = keys.standby_node(node_id)
            if not self._store.check([key]):
                continue
            ids = proto.StandbyNode.decode(key, self._store.get(key)).ids
            if len(ids) == len(self.slots.ranks()) and core.standbys_ready(self._store, ids):
                return True
        return False

    def _mirror_gen(self) -> None:
        gen = proto.read_gen(self._store)
        if gen != self._gen:
            core.write_gen_file(self._gen_file, gen)
            self._gen = gen

    def _fail(self, detail: str, by_signal: bool = True) -> None:
        """Stop every worker of this node and tell the leader (a member is a node)."""
        say(f"this node failed ({detail}); stopping its workers for the standby node to take over")
        self.slots.fence_all()
        self.failed = True
        self._report_failure(by_signal, detail)

    def stop_promoted(self, timeout: float = 5.0) -> None:
        self.slots.stop_promoted(timeout)


def _blame(report: proto.WorkerReport, pid: int) -> str:
    return f"rank {report.lost} (pid {pid}) lost by rank {report.reporter}, its process still running"
