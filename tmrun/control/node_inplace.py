"""In-place replacement of whole nodes: a job over several nodes with standby nodes.

The leader consults this before it changes the membership for a failed node. When every rank
of the current epoch runs the tmrun worker API, a ready standby node's warm standby workers
take the failed node's ranks *in place*: a new generation of the epoch's in-place protocol
(``tmrun/<run>/ip/e<epoch>/``) and a membership change with no new epoch, so no survivor's
agent restarts its workers. Without a ready standby node within ``standby_wait`` seconds the
workers are told to give up in-place recovery and the leader falls back to a new epoch
(torchrun's restart of the group). A plain torchrun script always gets that fallback.

Keys written by the agents (see :mod:`tmrun.control.inplace_protocol`): every active agent
publishes its node's ranks (``node_ranks``), every standby agent its standby workers in local
rank order (``standby_node``); the standby workers say when they are warm (``standby_ready``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from enum import Enum

from torch.distributed import PrefixStore, Store

from tmrun.protocol import keys, messages as proto
from tmrun.control import planner
from tmrun.protocol.membership import Membership


class Decision(Enum):
    IN_PLACE = "in-place"  # a standby node took over; publish the returned membership
    WAIT = "wait"  # in-place is possible but no standby node is warm yet: ask again
    FALLBACK = "fallback"  # in-place was possible but cannot happen: restart the group (logged)
    PLAIN = "plain"  # not an in-place job (yet): restart the group, as torchrun would
    FINAL = "final"  # every other rank already finished its steps: the job ends failed (a restart
    # would redo the whole training, and there is no one left to heal a joiner from)


@dataclass
class _Recovery:
    epoch: int
    gen: int
    world_size: int
    started: float


class NodeInplaceCoordinator:
    def __init__(self, store: Store, job_store: Store, run_id: str, standby_wait: float) -> None:
        self._raw = store  # unprefixed: the workers' prefix is a full key path
        self._run_id = run_id
        self._standby_wait = standby_wait
        self._awaiting: list[_Recovery] = []
        # planned migrations are requested at the job level (tmrun-ctl migrate, tm.migrate())
        self._job = job_store  # prefixed tmrun/<run>/
        self._migrations_seen = 0

    def _node_ranks(self, store: Store, membership: Membership) -> list[list[int]] | None:
        """Ranks of every active group rank, or None while an agent has not published them."""
        wanted = [keys.node_ranks(g) for g in range(len(membership.active))]
        if not wanted or not store.check(wanted):
            return None
        ranks = []
        for key in wanted:
            data = json.loads(store.get(key))
            ranks.append([int(r) for r in data["ranks"]])
        return ranks

    def _api_ranks(self, store: Store, membership: Membership) -> list[list[int]] | None:
        """Every active node's ranks once all of them run the tmrun worker API, else None."""
        ranks = self._node_ranks(store, membership)
        if ranks is None or not store.check([keys.API]) or store.add(keys.MEMBERS, 0) < sum(map(len, ranks)):
            return None
        return ranks

    def _ready_standby_nodes(self, store: Store, membership: Membership, size: int) -> list[tuple[int, list[int]]]:
        """(node id, standby ids by local rank) of the standby nodes whose ``size`` standby
        workers are all warm, in promotion order."""
        ready = []
        for node_id in membership.standby:
            key = keys.standby_node(node_id)
            if not store.check([key]):
                continue
            ids = [int(i) for i in json.loads(store.get(key))["ids"]]
            if len(ids) == size and store.check([keys.standby_ready(i) for i in ids]):
                ready.append((node_id, ids))
        return ready

    def decide(self, membership: Membership, culprits: list[int], dead: set[int],
               first_seen: float) -> tuple[Decision, Membership | None, str]:
        """What to do about ``culprits`` (active nodes that failed; ``dead`` ones are gone).
        Returns the decision, the new membership (in place) and a line for the event log."""
        store = self._epoch_store(membership.epoch)
        if not store.check([keys.API]):
            return Decision.PLAIN, None, "the script does not use the tmrun worker API"
        if store.check([keys.ABORT]):
            return Decision.FALLBACK, None, "in-place recovery was already abandoned in this epoch"
        ranks = self._api_ranks(store, membership)
        if ranks is None:
            return Decision.PLAIN, None, "not every rank had started the tmrun worker API"
        failed = [c for c in culprits if c in membership.active]
        failed_ranks = {r for c in failed for r in ranks[membership.active.index(c)]}
        others = [r for node_ranks in ranks for r in node_ranks if r not in failed_ranks]
        if failed and others and store.check([keys.done(r) for r in others]):
            return Decision.FINAL, None, "a node failed after every other rank had finished its steps"
        size = len(ranks[membership.active.index(failed[0])]) if failed else 0
        if not failed or any(len(ranks[membership.active.index(c)]) != size for c in failed):
            return Decision.FALLBACK, None, "failed nodes of different sizes"
        standby = self._ready_standby_nodes(store, membership, size)
        if len(standby) < len(failed):
            waited = time.monotonic() - first_seen
            if waited < self._standby_wait:
                return Decision.WAIT, None, ""
            why = f"no warm standby node within {self._standby_wait:g}s"
            store.set(keys.ABORT, proto.AbortNotice(why, proto.read_gen(store)).encode())
            return Decision.FALLBACK, None, why
        swapped, why = self._publish(store, membership, ranks, dict(zip(failed, (n for n, _ in standby))),
                                     dict(standby), dead, planned=False, started=first_seen)
        return Decision.IN_PLACE, swapped, why

    def _publish(self, store: Store, membership: Membership, ranks: list[list[int]], moves: dict[int, int],
                 standby_ids: dict[int, list[int]], dead: set[int], planned: bool,
                 started: float) -> tuple[Membership, str]:
        """Generation gen+1 of the epoch: each node in ``moves`` is replaced by its standby node
        (assignments first, so the joiners connect while the survivors read the plan)."""
        gen = proto.read_gen(store) + 1
        world_size = sum(len(r) for r in ranks)
        replaced: dict[int, int] = {}
        for culprit, node_id in moves.items():
            group_rank = membership.active.index(culprit)
            replaced.update(zip(ranks[group_rank], standby_ids[node_id]))
            store.set(keys.node_ranks(group_rank), json.dumps({"node_id": node_id, "ranks": ranks[group_rank]}))
        swapped = planner.replace_in_place(membership, moves, dead)
        plan = proto.ReplacementPlan(gen, world_size, replaced, reason=swapped.reason, planned=planned,
                                     created=time.time())
        for rank, standby_id in replaced.items():
            store.set(keys.standby_assign(standby_id), proto.Assignment(rank, gen, planned=planned).encode())
        store.set(keys.plan(gen), plan.encode())
        store.set(keys.GEN, str(gen))
        self._awaiting.append(_Recovery(membership.epoch, gen, world_size, started))
        ranks_moved = ", ".join(f"{rank}->standby {sid}" for rank, sid in sorted(replaced.items()))
        return swapped, f"generation {gen}: {swapped.reason} (ranks {ranks_moved})"

    def migrate(self, membership: Membership) -> tuple[Membership | None, list[tuple[str, str]]]:
        """Planned migrations requested since the last call: the whole node that holds the rank
        moves to a warm standby node at a step boundary (its workers hand their state over and
        leave; nothing is recomputed). Returns the new membership (or None) and events (kind, detail).
        One change at a time: nothing happens while a recovery is under way."""
        events: list[tuple[str, str]] = []
        for number, key in proto.numbered(self._job, keys.MIGRATE_SEQ, keys.migrate_request, self._migrations_seen):
            if self._awaiting:
                break  # retried once the current change is over
            self._migrations_seen = number + 1
            try:
                request = proto.MigrateRequest.decode(key, self._job.get(key))
            except proto.ProtocolMessageError as exc:
                events.append(("migrate-refused", f"malformed request ({exc})"))
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
            standby = self._ready_standby_nodes(store, membership, len(ranks[group_rank]))
            if not standby:
                events.append(("migrate-refused", f"{request.describe()}: no warm standby node"))
                continue
            node_id, ids = standby[0]
            swapped, why = self._publish(store, membership, ranks, {membership.active[group_rank]: node_id},
                                         {node_id: ids}, set(), planned=True, started=time.monotonic())
            events.append(("migrate", f"{why}: {request.reason}"))
            return swapped, events
        return None, events

    def _epoch_store(self, epoch: int) -> Store:
        return PrefixStore(keys.node_prefix(self._run_id, epoch), self._raw)

    def recovered(self) -> list[str]:
        """Lines for the event log: generations whose every rank finished recovering."""
        lines = []
        for recovery in list(self._awaiting):
            store = self._epoch_store(recovery.epoch)
            if store.add(keys.recovered(recovery.gen), 0) >= recovery.world_size:
                self._awaiting.remove(recovery)
                elapsed = time.monotonic() - recovery.started
                lines.append(f"generation {recovery.gen}: all {recovery.world_size} ranks back in {elapsed:.3f}s")
            elif proto.read_gen(store) > recovery.gen or store.check([keys.ABORT]):
                self._awaiting.remove(recovery)  # superseded by a later failure, or abandoned
        return lines
