"""tmrun.worker.vote: a rank whose commit vote lost a peer learns from the survivors' records
(in a real torch HashStore) whether any of them committed the step."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from tmrun.protocol import keys, messages as proto
from tmrun.worker import vote

STEP = 7


def _store_with_plan(lost: dict[int, int], gen: int = 0) -> dist.Store:
    store = dist.HashStore()
    plan = proto.ReplacementPlan(gen=gen + 1, world_size=4, replaced=lost)
    store.set(keys.plan(gen + 1), plan.encode())
    return store


def _decide(store: dist.Store, rank: int = 1, timeout: float = 5.0, newest: int = 1) -> bool | None:
    vote.publish(store, 0, rank, STEP - 1)  # the undecided rank's own record comes first
    return vote.others_committed(store, 0, rank, 4, STEP, lambda: newest, time.monotonic() + timeout)


def test_a_survivor_that_committed_decides_commit() -> None:
    """The HSDP case: rank 3 lost during the vote, ranks 0 and 2 received "commit", rank 1 did not."""
    store = _store_with_plan({3: 0})
    vote.publish(store, 0, 0, STEP)
    vote.publish(store, 0, 2, STEP)
    assert _decide(store) is True


def test_no_survivor_committed_decides_skip() -> None:
    store = _store_with_plan({3: 0})
    vote.publish(store, 0, 0, STEP - 1)
    vote.publish(store, 0, 2, STEP - 1)
    assert _decide(store) is False


def _later(*actions: tuple[float, object]) -> threading.Thread:
    def run() -> None:
        for delay, action in actions:
            time.sleep(delay)
            action()  # type: ignore[operator]
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_one_committed_record_decides_at_once() -> None:
    """Rank 0 never writes (blocked in a collective with this rank) and no plan is out yet: rank
    2's record saying it committed is enough."""
    store = dist.HashStore()
    thread = _later((0.2, lambda: vote.publish(store, 0, 2, STEP)))
    started = time.monotonic()
    try:
        assert _decide(store) is True
    finally:
        thread.join()
    assert 0.15 <= time.monotonic() - started < 3


def test_skipping_waits_for_the_plan_and_every_survivor() -> None:
    """Records arriving one by one and the plan last: no decision to skip before all are in."""
    store = dist.HashStore()
    plan = proto.ReplacementPlan(gen=1, world_size=4, replaced={3: 0}).encode()
    thread = _later((0.1, lambda: vote.publish(store, 0, 0, STEP - 1)),
                    (0.1, lambda: vote.publish(store, 0, 2, STEP - 1)),
                    (0.1, lambda: store.set(keys.plan(1), plan)))
    started = time.monotonic()
    try:
        assert _decide(store) is False
    finally:
        thread.join()
    assert time.monotonic() - started >= 0.25


def test_a_survivor_whose_record_never_comes_ends_undecided() -> None:
    store = _store_with_plan({3: 0})
    vote.publish(store, 0, 0, STEP - 1)  # rank 2 never writes
    assert _decide(store, timeout=0.3) is None


def test_a_rank_lost_later_is_not_waited_for() -> None:
    """Rank 2 lost too while rank 1 waits (the plan of generation 2): its record is not needed."""
    store = _store_with_plan({3: 0})
    store.set(keys.plan(2), proto.ReplacementPlan(gen=2, world_size=4, replaced={2: 1}).encode())
    vote.publish(store, 0, 0, STEP - 1)
    assert _decide(store, newest=2) is False


@pytest.mark.parametrize("rank_0_committed", [False, True])
def test_two_undecided_ranks_reach_the_same_decision(rank_0_committed: bool) -> None:
    """Ranks 1 and 2 both lost the vote; rank 0 committed or not: both decide alike."""
    store = _store_with_plan({3: 0})
    vote.publish(store, 0, 0, STEP if rank_0_committed else STEP - 1)
    vote.publish(store, 0, 1, STEP - 1)
    vote.publish(store, 0, 2, STEP - 1)
    decisions = [vote.others_committed(store, 0, r, 4, STEP, lambda: 1, time.monotonic() + 5) for r in (1, 2)]
    assert decisions == [rank_0_committed, rank_0_committed]
