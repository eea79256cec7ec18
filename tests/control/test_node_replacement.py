"""The leader's decisions about a failed node of an in-place job over several nodes, with a real
store: in place (same epoch, plan and assignments published), wait for a warm standby node,
fall back after --standby-wait, or a plain script's group restart."""

from __future__ import annotations

import json
import time

import pytest
import torch.distributed as dist

from tmrun.protocol import keys, messages as proto
from tmrun.control import planner
from tmrun.control.replacement.nodes import Decision, NodeReplacement
from tmrun.protocol.membership import Membership

RUN = "nodes"


@pytest.fixture
def store() -> dist.Store:
    return dist.HashStore()


def _epoch(store: dist.Store, epoch: int = 1) -> dist.Store:
    return dist.PrefixStore(keys.node_prefix(RUN, epoch), store)


def _job(store: dist.Store) -> dist.Store:
    return dist.PrefixStore(f"tmrun/{RUN}/", store)


def _membership() -> Membership:
    return planner.form_group(Membership(), [0, 1, 2], planner.GroupLimits(2, 2, 1))  # 0, 1 active; 2 stands by


def _api_job(store: dist.Store, standby_ready: bool = True) -> None:
    ip = _epoch(store)
    ip.set(keys.API, "1")
    ip.add(keys.MEMBERS, 4)
    ip.set(keys.node_ranks(0), json.dumps({"node_id": 0, "ranks": [0, 1]}))
    ip.set(keys.node_ranks(1), json.dumps({"node_id": 1, "ranks": [2, 3]}))
    ip.set(keys.standby_node(2), json.dumps({"ids": [2000, 2001]}))
    ip.set(keys.standby_ready(2000), "{}")
    if standby_ready:
        ip.set(keys.standby_ready(2001), "{}")


def test_a_dead_node_is_replaced_in_place(store: dist.Store) -> None:
    _api_job(store)
    coordinator = NodeReplacement(store, _job(store), RUN, standby_wait=30)
    decision, swapped, why = coordinator.decide(_membership(), [1], {1}, time.monotonic())
    assert decision is Decision.IN_PLACE and swapped is not None
    assert (swapped.active, swapped.dead, swapped.epoch) == ([0, 2], [1], 1)
    ip = _epoch(store)
    plan = proto.ReplacementPlan.decode("p", ip.get(keys.plan(1)))
    assert (plan.gen, plan.world_size, plan.replaced, plan.planned) == (1, 4, {2: 2000, 3: 2001}, False)
    assert proto.Assignment.decode("a", ip.get(keys.standby_assign(2001))) == proto.Assignment(3, 1)
    assert ip.get(keys.GEN) == b"1"
    assert json.loads(ip.get(keys.node_ranks(1)))["node_id"] == 2
    assert "ranks 2->standby 2000, 3->standby 2001" in why
    assert coordinator.recovered() == []
    now = time.time()
    for rank in range(4):
        ip.set(keys.timing(1, rank), proto.RecoveryTiming(rank, 1, connected=now, healed=now + 0.1).encode())
    ip.add(keys.recovered(1), 4)
    assert coordinator.recovered() == []  # the event waits for every rank's first step after it
    for rank in range(4):  # ranks 2 and 3 are the joiners; survivor 0 redoes its step, survivor 1 had committed it
        ip.set(keys.timing(1, rank), proto.RecoveryTiming(rank, 1, connected=now, healed=now + 0.1,
                                                          first_step=now + 0.5 + rank,
                                                          redone={0: True, 1: False}.get(rank)).encode())
    ip.add(keys.first_steps(1), 4)
    (recovered,) = coordinator.recovered()
    assert recovered.describe().startswith("generation 1: all 4 ranks back in")
    fields = recovered.fields()
    assert fields["marks"]["first_step"] == round(now + 3.5, 6)
    # differences of two epoch seconds each rounded to 6 decimals: within 1e-6, plus the doubles' own error
    assert fields["phases"]["first_step"] == pytest.approx(3.4, abs=2e-6)
    assert fields["phases"]["transfer"] == pytest.approx(0.1, abs=2e-6) and fields["phases"]["total"] == fields["seconds"]
    assert fields["steps_recomputed"] == 1  # one survivor redoes the step it was in


def test_waits_for_a_warm_standby_node_then_falls_back(store: dist.Store) -> None:
    _api_job(store, standby_ready=False)
    coordinator = NodeReplacement(store, _job(store), RUN, standby_wait=30)
    now = time.monotonic()
    assert coordinator.decide(_membership(), [1], {1}, now)[0] is Decision.WAIT
    decision, swapped, why = coordinator.decide(_membership(), [1], {1}, now - 31)
    assert (decision, swapped) == (Decision.FALLBACK, None)
    assert "no warm standby node within 30s" in why
    notice = proto.AbortNotice.decode("abort", _epoch(store).get(keys.ABORT))
    assert "no warm standby node" in notice.reason
    # once abandoned, later failures of this epoch fall back at once
    assert coordinator.decide(_membership(), [0], set(), now)[0] is Decision.FALLBACK


def test_every_node_failed_falls_back_at_once(store: dist.Store) -> None:
    """Both active nodes failed (a standby node waits, warm): no rank holds the training state,
    so no plan of new members only is published; the group restarts at once, said."""
    _api_job(store)
    coordinator = NodeReplacement(store, _job(store), RUN, standby_wait=30)
    decision, swapped, why = coordinator.decide(_membership(), [0, 1], {0, 1}, time.monotonic())
    assert (decision, swapped) == (Decision.FALLBACK, None) and "no rank holds the training state" in why
    assert not _epoch(store).check([keys.plan(1)])


def test_a_plain_script_restarts_the_group(store: dist.Store) -> None:
    coordinator = NodeReplacement(store, _job(store), RUN, standby_wait=30)
    decision, swapped, why = coordinator.decide(_membership(), [1], {1}, time.monotonic())
    assert (decision, swapped) == (Decision.PLAIN, None) and "no rank reached tmrun.init()" in why and "or failed before it" in why
    _epoch(store).set(keys.API, "1")  # the API, but a rank has not started it yet
    assert coordinator.decide(_membership(), [1], {1}, time.monotonic())[0] is Decision.PLAIN


def test_a_node_whose_own_standbys_gave_up_is_not_called_a_plain_script(store: dist.Store) -> None:
    """One node with --standby N: its workers keep their keys under the group's prefix, so the
    epoch's store has no API key; when the node's controller falls back (every replica of a shard
    lost: tests/e2e/test_mesh.py), the leader restarts the group and says why, not that the
    script does not use the worker API."""
    coordinator = NodeReplacement(store, _job(store), RUN, standby_wait=30)
    why_node = "no live replica holds the shard of ranks 1, 3"
    decision, swapped, why = coordinator.decide(_membership(), [0], set(), time.monotonic(), node_fallback=why_node)
    assert (decision, swapped) == (Decision.PLAIN, None)
    assert "worker API" not in why and why_node in why and "gave up" in why


def test_standby_node_of_another_size_is_not_used(store: dist.Store) -> None:
    _api_job(store)
    _epoch(store).set(keys.standby_node(2), json.dumps({"ids": [2000]}))
    coordinator = NodeReplacement(store, _job(store), RUN, standby_wait=30)
    assert coordinator.decide(_membership(), [1], {1}, time.monotonic())[0] is Decision.WAIT


def test_a_node_failing_after_every_other_rank_finished_ends_the_job(store: dist.Store) -> None:
    _api_job(store)
    for rank in (0, 1):  # node 0's ranks are done; node 1 fails afterwards (e.g. while exiting)
        _epoch(store).set(keys.done(rank), "13")
    coordinator = NodeReplacement(store, _job(store), RUN, standby_wait=30)
    decision, swapped, why = coordinator.decide(_membership(), [1], {1}, time.monotonic())
    assert (decision, swapped) == (Decision.FINAL, None) and "after every other rank" in why
    assert not _epoch(store).check([keys.plan(1)])  # nothing published


def test_a_node_migration_asked_while_the_training_finishes_is_refused(store: dist.Store) -> None:
    _api_job(store)
    _epoch(store).set(keys.done(0), "9")
    coordinator = NodeReplacement(store, _job(store), RUN, standby_wait=30)
    proto.request_migration(_job(store), node=1)
    swapped, events = coordinator.migrate(_membership())
    assert swapped is None and events == [("migrate-refused", "node at group rank 1: the training is finishing")]
    assert not _epoch(store).check([keys.plan(1)])


def test_a_change_its_members_found_unhealable_falls_back_without_waiting(store: dist.Store) -> None:
    """The members of generation 1 found a shard with no live replica (docs/mesh.md): the next
    failure report falls back at once, without waiting standby_wait for a standby node."""
    _api_job(store, standby_ready=False)
    ip = _epoch(store)
    ip.set(keys.UNHEALABLE, "no live replica holds the shard of ranks 1, 3")
    coordinator = NodeReplacement(store, _job(store), RUN, standby_wait=30)
    decision, swapped, why = coordinator.decide(_membership(), [1], {1}, time.monotonic())
    assert (decision, swapped) == (Decision.FALLBACK, None)
    assert why == "no live replica holds the shard of ranks 1, 3"
    assert "no live replica" in proto.AbortNotice.decode("abort", ip.get(keys.ABORT)).reason


def test_a_node_migration_in_a_job_with_subgroups_moves_the_node_to_its_standby_node(store: dist.Store) -> None:
    """A job with subgroups (a device mesh): its standby node's workers wait in ``tmrun.init()``
    and build as their ranks once assigned (end to end:
    ``tests/e2e/test_mesh.py::test_hsdp_over_nodes_a_drained_node_moves_to_the_standby_node``);
    refused until 2026-12-06."""
    _api_job(store)
    _epoch(store).set(keys.SUBGROUPS, "1")
    coordinator = NodeReplacement(store, _job(store), RUN, standby_wait=30)
    proto.request_migration(_job(store), node=1)
    swapped, events = coordinator.migrate(_membership())
    assert swapped is not None and [kind for kind, _ in events] == ["migrate"], events
    assert "node 2 replaces node 1 at group rank 1 in place (ranks 2->standby 2000, 3->standby 2001)" in events[0][1]
    assert _epoch(store).check([keys.plan(1)])
