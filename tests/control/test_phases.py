"""A recovery's phases: the workers' instants merged with the controller's (control.phases), and
the controller holding the ``recovered`` event until every rank's first step (core.Recoveries)."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from tmrun.control import phases
from tmrun.control.replacement.core import Recoveries
from tmrun.protocol import keys
from tmrun.protocol.messages import RecoveryTiming


def _t(rank: int, connected: float, healed: float, noticed: float | None = None,
       first_step: float | None = None) -> RecoveryTiming:
    return RecoveryTiming(rank, 1, connected=connected, healed=healed, noticed=noticed, first_step=first_step)


def test_a_failure_s_timeline_and_phases() -> None:
    timings = [_t(0, 100.30, 100.50, noticed=99.95, first_step=101.50), _t(1, 100.35, 100.52, first_step=101.60)]
    at = phases.marks(timings, 2, seen=100.0, published=100.10)
    assert at == {"failed": 99.95, "seen": 100.0, "published": 100.1, "switch": None, "connected": 100.35,
                  "healed": 100.52, "first_step": 101.6}
    got = phases.phases(at, recovered=100.6, seconds=0.6)
    assert got == pytest.approx({"detect": 0.05, "plan": 0.1, "connect": 0.25, "transfer": 0.17,
                                 "first_step": 1.08, "recover": 0.5, "total": 0.6})
    names = [name for name, _, _ in phases.PHASES]
    assert names == ["detect", "plan", "connect", "transfer", "first_step"]


def test_a_migration_starts_at_its_request_and_a_missing_first_step_is_null() -> None:
    timings = [_t(0, 50.0, 50.2, first_step=51.0), _t(1, 50.0, 50.3)]  # rank 1 never stepped again
    at = phases.marks(timings, 2, seen=49.0, published=49.1, asked=48.5)
    assert at["failed"] == 48.5 and at["first_step"] is None
    got = phases.phases(at, recovered=50.4, seconds=1.4)
    assert got["detect"] == 0.5 and got["first_step"] is None and got["transfer"] == pytest.approx(0.3)


def test_a_migration_s_downtime_counts_from_its_switch() -> None:
    """Training goes on from the plan to the switch step: the downtime (the event's seconds) and
    the connect phase count from the switch, the time trained meanwhile is the overlap."""
    timings = [_t(0, 52.05, 52.10, noticed=52.0), _t(1, 52.06, 52.12)]  # rank 1: the joiner
    at = phases.marks(timings, 2, seen=49.0, published=49.1, asked=48.5)
    assert (at["failed"], at["switch"]) == (48.5, 52.0)
    got = phases.phases(at, recovered=52.2, seconds=3.2)
    assert got["overlap"] == pytest.approx(2.9) and got["connect"] == pytest.approx(0.06)
    assert phases.downtime(at, recovered=52.2, seconds=3.2) == pytest.approx(0.2)
    failure = phases.marks([_t(0, 10.2, 10.3, noticed=9.9)], 1, seen=10.0, published=10.1)
    # a failure: from its earliest evidence, a survivor's collective that lost the peer at 9.9,
    # before the controller saw it at 10.0 (it counted from 10.0: 0.4)
    assert failure["switch"] is None and phases.downtime(failure, 10.4, 0.4) == pytest.approx(0.5)
    assert "overlap" not in phases.phases(failure, 10.4, 0.4)


def test_a_failure_counts_from_its_earliest_evidence() -> None:
    """A lost node's last heartbeat (the report's evidence) comes before anything the survivors or
    the controller saw: the downtime starts there; a migration's request ignores it."""
    at = phases.marks([_t(0, 20.2, 20.3, noticed=19.5)], 1, seen=20.0, published=20.1, evidence=17.0)
    assert at["failed"] == 17.0 and at["seen"] == 20.0
    assert phases.downtime(at, recovered=20.5, seconds=0.5) == pytest.approx(3.5)
    assert phases.phases(at, 20.5, 3.5)["detect"] == pytest.approx(3.0)
    later = phases.marks([_t(0, 20.2, 20.3, noticed=19.5)], 1, seen=20.0, published=20.1, evidence=30.0)
    assert later["failed"] == 19.5  # evidence later than a survivor's notice changes nothing
    planned = phases.marks([_t(0, 20.2, 20.3)], 1, seen=20.0, published=20.1, asked=19.0, evidence=17.0)
    assert planned["failed"] == 19.0


def test_skewed_clocks_are_clamped_into_order() -> None:
    # another host's clock is 0.2 s behind: its instants would come before the plan
    at = phases.marks([_t(0, 9.9, 10.4, first_step=10.3)], 1, seen=10.0, published=10.05)
    values = [at[name] for name in phases.ORDER if at[name] is not None]
    assert values == sorted(values) and at["connected"] == 10.05 and at["first_step"] == 10.4
    assert all(v is not None and v >= 0 for v in phases.phases(at, 10.5, 0.5).values())


def test_no_worker_timings_leaves_the_workers_phases_null() -> None:
    at = phases.marks([], 2, seen=5.0, published=5.2)
    got = phases.phases(at, recovered=6.0, seconds=1.0)
    assert got["detect"] == 0.0 and got["plan"] == pytest.approx(0.2) and got["recover"] == pytest.approx(0.8)
    assert got["connect"] is None and got["transfer"] is None and got["first_step"] is None


def _recovered_ranks(store: dist.Store, gen: int, first_step: bool) -> None:
    now = time.time()
    for rank in range(2):
        store.set(keys.timing(gen, rank), _t(rank, now, now + 0.01, first_step=now + 0.02 if first_step else None)
                  .encode().replace('"gen": 1', f'"gen": {gen}'))
    store.add(keys.recovered(gen), 2)


def test_the_event_waits_for_every_first_step() -> None:
    store = dist.HashStore()
    recoveries = Recoveries()
    recoveries.begin(store, 1, 2, time.monotonic() - 0.5, asked=time.time() - 1.0)
    assert recoveries and recoveries.poll() == [] and recoveries.completed() == []
    _recovered_ranks(store, 1, first_step=False)
    (now,) = recoveries.poll()
    assert now.gen == 1 and now.seconds >= 0.5 and not recoveries  # not busy any more: migrations may follow
    assert recoveries.completed() == []  # first steps still to come
    store.add(keys.first_steps(1), 1)
    assert recoveries.completed() == []
    _recovered_ranks(store, 1, first_step=True)
    store.add(keys.first_steps(1), 1)
    (done,) = recoveries.completed()
    fields = done.fields()
    assert fields["gen"] == 1 and fields["phases"]["detect"] >= 0.45  # from the request, not the plan
    assert all(fields["phases"][name] is not None and fields["phases"][name] >= 0 for name, _, _ in phases.PHASES)
    assert recoveries.completed() == []  # once


@pytest.mark.parametrize("why", ["final", "later generation", "abort", "wait ran out"])
def test_an_event_without_every_first_step(why: str) -> None:
    store = dist.HashStore()
    recoveries = Recoveries(first_step_wait=0.0 if why == "wait ran out" else 60.0)
    recoveries.begin(store, 1, 2, time.monotonic())
    _recovered_ranks(store, 1, first_step=False)
    assert len(recoveries.poll()) == 1
    if why == "later generation":
        store.set(keys.GEN, "2")
    elif why == "abort":
        store.set(keys.ABORT, '{"reason": "x"}')
    elif why == "wait ran out":
        time.sleep(0.01)
    (done,) = recoveries.completed(final=why == "final")
    assert done.phases["first_step"] is None and done.phases["transfer"] is not None


@pytest.mark.parametrize("healed_after, seconds", [
    (0.2, 0.2),  # the last rank healed 0.2 s after the start: that, not when the loop looked (0.5 s)
    (9.0, 0.5),  # a clock ahead of the controller's: never after the controller saw it
    (-9.0, 0.0),  # a clock behind: never before the start
])
def test_every_rank_recovered_when_the_last_one_healed_not_when_the_loop_looked(healed_after: float,
                                                                              seconds: float) -> None:
    store = dist.HashStore()
    recoveries = Recoveries()
    started = time.monotonic() - 0.5
    recoveries.begin(store, 1, 2, started)
    seen = time.time() - 0.5
    for rank in range(2):
        healed = seen + healed_after - (0.05 if rank == 0 else 0.0)  # rank 1 last
        store.set(keys.timing(1, rank), _t(rank, seen, healed).encode())
    store.add(keys.recovered(1), 2)
    (done,) = recoveries.poll()
    assert done.seconds == pytest.approx(seconds, abs=0.02)


def test_a_recovery_without_every_rank_s_timing_counts_until_the_loop_saw_it() -> None:
    store = dist.HashStore()
    recoveries = Recoveries()
    recoveries.begin(store, 1, 2, time.monotonic() - 0.5)
    store.set(keys.timing(1, 0), _t(0, time.time() - 0.45, time.time() - 0.4).encode())  # rank 1 wrote none
    store.add(keys.recovered(1), 2)
    (done,) = recoveries.poll()
    assert done.seconds == pytest.approx(0.5, abs=0.02)
