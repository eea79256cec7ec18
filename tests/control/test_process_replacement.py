"""The in-place controller's decisions, with a real store (HashStore) and real processes (tiny
Python children, killed by PID), and a pool that only holds what the test gives it."""

from __future__ import annotations

import pytest

import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from tmrun.protocol import keys, messages as proto
from tmrun.control.replacement.processes import ProcessReplacement


def child(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code])


@dataclass
class FakeMember:
    index: int
    process: subprocess.Popen[bytes]
    local_rank: int = 2


@dataclass
class FakePool:
    members: list[FakeMember] = field(default_factory=list)
    failing: str = ""
    fills: int = 0

    def fill(self) -> None:
        self.fills += 1

    def take(self, member: FakeMember) -> None:
        self.members.remove(member)


def make(tmp_path: Path, pool: FakePool, world: int = 2, replacements: int = 3, wait: float = 0.0,
         refill_delay: float = 0.0, report_settle: tuple[float, float] = (0.0, 0.0)):
    store = dist.HashStore()
    controller = ProcessReplacement(store, pool, world, wait, replacements, dist.HashStore(), str(tmp_path / "gen"),  # type: ignore[arg-type]
                                   refill_delay, report_settle=report_settle)
    return store, controller


def api_job(tmp_path: Path, pool: FakePool, processes: dict[int, subprocess.Popen[bytes]]):
    """A controller over ``processes`` whose ranks run the worker API (migrations allowed), with
    the job's events store (where migration requests arrive)."""
    store = dist.HashStore()
    job = dist.HashStore()
    controller = ProcessReplacement(store, pool, len(processes), 0.0, 3, job, str(tmp_path / "gen"))  # type: ignore[arg-type]
    controller.adopt(processes)
    store.set(keys.API, "1")
    store.add(keys.MEMBERS, len(processes))
    return store, job, controller


def wait_exit(process: subprocess.Popen[bytes]) -> None:
    process.wait(timeout=30)


def test_a_dead_rank_is_replaced_by_a_ready_standby(tmp_path: Path, procs) -> None:  # type: ignore[no-untyped-def]
    survivor, victim, standby = child("import time; time.sleep(60)"), child("raise SystemExit(7)"), child("import time; time.sleep(60)")
    procs += [survivor, victim, standby]
    pool = FakePool([FakeMember(4, standby)])
    store, controller = make(tmp_path, pool)
    controller.adopt({0: survivor, 1: victim})
    store.set(keys.standby_ready(4), "{}")
    wait_exit(victim)
    outcome = controller.step()
    assert not outcome.failed and not outcome.finished
    plan = proto.ReplacementPlan.decode("p", store.get(keys.plan(1)))
    assert plan.replaced == {1: 4} and not plan.planned
    assert proto.Assignment.decode("a", store.get(keys.standby_assign(4))) == proto.Assignment(1, 1)
    assert (tmp_path / "gen").read_text() == "1"  # the workers' per-step view of the generation
    assert controller.slots[1].process is standby and pool.members == []


@pytest.mark.e2e  # over half a second: waits out a timeout (the unit subset stays within a minute)
def test_the_pool_is_refilled_only_after_recovery_plus_the_refill_delay(tmp_path: Path, procs) -> None:  # type: ignore[no-untyped-def]
    import time

    survivor, victim, standby = child("import time; time.sleep(60)"), child("raise SystemExit(7)"), child("import time; time.sleep(60)")
    procs += [survivor, victim, standby]
    pool = FakePool([FakeMember(4, standby)])
    store, controller = make(tmp_path, pool, refill_delay=0.5)
    controller.adopt({0: survivor, 1: victim})
    store.set(keys.standby_ready(4), "{}")
    wait_exit(victim)
    controller.step()  # promotes the standby
    fills = pool.fills
    controller.step()
    assert pool.fills == fills  # recovery under way: no new standby competes with it
    store.add(keys.recovered(1), 2)
    controller.step()  # recovered: the refill delay starts now
    controller.step()
    assert pool.fills == fills
    time.sleep(0.6)
    controller.step()
    assert pool.fills == fills + 1


def test_without_a_standby_it_falls_back_and_tells_the_workers(tmp_path: Path, procs) -> None:  # type: ignore[no-untyped-def]
    survivor, victim = child("import time; time.sleep(60)"), child("raise SystemExit(3)")
    procs += [survivor, victim]
    store, controller = make(tmp_path, FakePool(), wait=0.2)
    controller.adopt({0: survivor, 1: victim})
    wait_exit(victim)
    outcome = controller.step()
    assert outcome.failed == {1: 3} and not outcome.final
    assert "no standby ready" in proto.AbortNotice.decode("a", store.get(keys.ABORT)).reason


def test_a_rank_failing_after_the_others_finished_ends_the_job(tmp_path: Path, procs) -> None:  # type: ignore[no-untyped-def]
    done, victim = child("pass"), child("raise SystemExit(5)")
    procs += [done, victim]
    store, controller = make(tmp_path, FakePool())
    controller.adopt({0: done, 1: victim})
    store.set(keys.done(0), "11")
    wait_exit(victim)
    wait_exit(done)
    outcome = controller.step()
    assert outcome.failed == {1: 5} and outcome.final  # no group restart: it would redo everything


def test_a_reported_rank_that_still_runs_is_fenced(tmp_path: Path, procs) -> None:  # type: ignore[no-untyped-def]
    survivor, hung = child("import time; time.sleep(60)"), child("import time; time.sleep(60)")
    procs += [survivor, hung]
    store, controller = make(tmp_path, FakePool(), wait=0.0)
    controller.adopt({0: survivor, 1: hung})
    seq = store.add(keys.REPORT_SEQ, 1) - 1
    store.set(keys.report(seq), proto.WorkerReport(reporter=0, lost=1, gen=0).encode())
    stale = store.add(keys.REPORT_SEQ, 1) - 1
    store.set(keys.report(stale), proto.WorkerReport(reporter=1, lost=0, gen=7).encode())  # another generation
    store.set(keys.report(store.add(keys.REPORT_SEQ, 1) - 1), "not json")  # ignored, no crash
    unknown = store.add(keys.REPORT_SEQ, 1) - 1  # a timed-out collective: nobody to blame, nobody fenced
    store.set(keys.report(unknown), proto.WorkerReport(reporter=1, lost=-1, gen=0).encode())
    controller.step()
    assert hung.wait(timeout=10) == -9  # SIGKILLed
    assert survivor.poll() is None  # the stale report about rank 0 was not acted on


def report(store, reporter: int, lost: int, gen: int) -> None:  # type: ignore[no-untyped-def]
    store.set(keys.report(store.add(keys.REPORT_SEQ, 1) - 1),
              proto.WorkerReport(reporter=reporter, lost=lost, gen=gen).encode())


def test_a_report_against_a_live_rank_waits_its_settle_time(tmp_path: Path, procs) -> None:  # type: ignore[no-untyped-def]
    """A rank that says nothing is fenced only once the report's settle time passed (the real
    loss, a process exit, would have surfaced meanwhile)."""
    survivor, hung = child("import time; time.sleep(60)"), child("import time; time.sleep(60)")
    procs += [survivor, hung]
    store, controller = make(tmp_path, FakePool(), report_settle=(0.3, 30.0))
    controller.adopt({0: survivor, 1: hung})
    report(store, 0, 1, 0)
    controller.step()
    assert hung.poll() is None  # not yet
    deadline = time.monotonic() + 10
    while hung.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
        controller.step()
    assert hung.wait(timeout=10) == -9 and survivor.poll() is None


def test_ranks_blaming_each_other_for_a_third_ranks_death_are_not_fenced(tmp_path: Path, procs) -> None:  # type: ignore[no-untyped-def]
    """Rank 2 dies; ranks 0 and 1 each read a link the other had closed on seeing it go, and
    report each other lost. Both are alive and answering: neither is fenced; rank 2's exit
    starts generation 1, which makes both reports stale. (Seen in CI: rank 0 fenced on such a
    report, its shard's other replica lost with it, and the job fell back to the group restart.)"""
    a, b, standby = (child("import time; time.sleep(60)") for _ in range(3))
    dying = child("import time; time.sleep(0.5); raise SystemExit(3)")
    procs += [a, b, standby, dying]
    pool = FakePool([FakeMember(4, standby)])
    store, controller = make(tmp_path, pool, world=3, report_settle=(0.0, 30.0))
    controller.adopt({0: a, 1: b, 2: dying})
    store.set(keys.standby_ready(4), "{}")
    report(store, 1, 0, 0)
    report(store, 0, 1, 0)
    controller.step()
    assert a.poll() is None and b.poll() is None
    deadline = time.monotonic() + 10
    while controller.gen == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
        controller.step()
    plan = proto.ReplacementPlan.decode("p", store.get(keys.plan(1)))
    assert plan.replaced == {2: 4}
    controller.step()
    time.sleep(0.2)
    assert a.poll() is None and b.poll() is None  # the reports of generation 0 are stale now


def test_a_rank_that_reports_a_loss_itself_is_fenced_after_the_cascade_settle(tmp_path: Path, procs) -> None:  # type: ignore[no-untyped-def]
    """Two ranks cut off from each other (each reports the other lost) and nobody dies: both are
    fenced, once the longer settle time passed."""
    a, b = (child("import time; time.sleep(60)") for _ in range(2))
    procs += [a, b]
    store, controller = make(tmp_path, FakePool(), report_settle=(0.0, 0.5))
    controller.adopt({0: a, 1: b})
    report(store, 1, 0, 0)
    report(store, 0, 1, 0)
    controller.step()
    assert a.poll() is None and b.poll() is None
    time.sleep(0.6)
    controller.step()
    assert a.wait(timeout=10) == -9 and b.wait(timeout=10) == -9


def test_migration_requests(tmp_path: Path, procs) -> None:  # type: ignore[no-untyped-def]
    a, b, standby = (child("import time; time.sleep(60)") for _ in range(3))
    procs += [a, b, standby]
    pool = FakePool([FakeMember(2, standby)])
    store, job, controller = api_job(tmp_path, pool, {0: a, 1: b})
    proto.request_migration(job, 5)  # no such rank: refused, nothing published
    controller.step()
    assert not store.check([keys.plan(1)])
    store.set(keys.standby_ready(2), "{}")
    proto.request_migration(job, 1, "drain")
    controller.step()
    plan = proto.ReplacementPlan.decode("p", store.get(keys.plan(1)))
    assert plan.planned and plan.replaced == {1: 2} and plan.reason == "drain"
    assert controller.slots[1].process is standby


def _two_ranks_and_a_warm_standby(tmp_path: Path, procs) -> tuple:  # type: ignore[no-untyped-def]
    """Ranks 0 and 1 on the worker API and standby 2 warm: (store, job store, controller, pool,
    their three processes)."""
    a, b, standby = (child("import time; time.sleep(60)") for _ in range(3))
    procs += [a, b, standby]
    pool = FakePool([FakeMember(2, standby)])
    store, job = dist.HashStore(), dist.HashStore()
    controller = ProcessReplacement(store, pool, 2, 0.0, 3, job, str(tmp_path / "gen"))  # type: ignore[arg-type]
    controller.adopt({0: a, 1: b})
    store.set(keys.API, "1")
    store.add(keys.MEMBERS, 2)
    store.set(keys.standby_ready(2), "{}")
    return store, job, controller, pool, (a, b, standby)


def test_a_migration_asked_while_the_training_finishes_is_refused(tmp_path: Path, procs) -> None:  # type: ignore[no-untyped-def]
    """A rank that finished its steps never reaches a switch step: publishing the migration
    would leave its joiner waiting for addresses nobody publishes."""
    store, job, controller, pool, (_, b, standby) = _two_ranks_and_a_warm_standby(tmp_path, procs)
    store.set(keys.done(0), "9")
    proto.request_migration(job, 1, "drain")
    controller.step()
    assert not store.check([keys.plan(1)]) and pool.members  # nothing published, the standby stays
    assert "training is finishing" in job.get(keys.event(0)).decode()


def test_a_migration_of_a_job_that_cannot_heal_in_place_is_refused(tmp_path: Path, procs) -> None:  # type: ignore[no-untyped-def]
    """The script made a gloo group (tmrun.worker.gloo_groups): its ranks recorded that no
    joiner can enter it; a planned migration would leave its joiner waiting in gloo's rendezvous."""
    store, job, controller, pool, (_, b, standby) = _two_ranks_and_a_warm_standby(tmp_path, procs)
    store.set(keys.UNHEALABLE, "the script made a gloo group")
    proto.request_migration(job, 1, "drain")
    controller.step()
    assert not store.check([keys.plan(1)]) and pool.members  # nothing published, the standby stays
    assert "the script made a gloo group" in job.get(keys.event(0)).decode()


def test_a_change_its_members_found_unhealable_falls_back_without_waiting(tmp_path: Path, procs) -> None:  # type: ignore[no-untyped-def]
    """Every replica of a shard lost (docs/mesh.md, section 4): the members record why in the
    store as they fail; the ranks that fail next are not waited for (no standby wait), the group
    restarts at once with that reason, told to the workers."""
    import time

    survivor, victim = child("import time; time.sleep(60)"), child("raise SystemExit(1)")
    procs += [survivor, victim]
    store, controller = make(tmp_path, FakePool(), wait=30.0)
    controller.adopt({0: survivor, 1: victim})
    store.set(keys.UNHEALABLE, "no live replica holds the shard of ranks 1, 3")
    wait_exit(victim)
    started = time.monotonic()
    outcome = controller.step()
    assert time.monotonic() - started < 5.0  # not the 30 s standby wait
    assert outcome.failed == {1: 1} and not outcome.final
    assert proto.AbortNotice.decode("a", store.get(keys.ABORT)).reason == "no live replica holds the shard of ranks 1, 3"


def test_a_migration_in_a_job_with_subgroups_is_planned_like_any_other(tmp_path: Path, procs) -> None:  # type: ignore[no-untyped-def]
    """A job with subgroups (a device mesh): its standby, warm in tmrun.init(), gets a planned
    assignment; the leaver stays a running process of the node until it handed over
    (docs/mesh.md; end to end: tests/e2e/test_mesh.py::test_hsdp_planned_migration_recomputes_nothing)."""
    store, job, controller, pool, (_, b, standby) = _two_ranks_and_a_warm_standby(tmp_path, procs)
    store.set(keys.SUBGROUPS, "1")
    proto.request_migration(job, 1, "drain")
    controller.step()
    plan = proto.ReplacementPlan.decode("p", store.get(keys.plan(1)))
    assert plan.planned and plan.replaced == {1: 2} and not pool.members
    assert proto.Assignment.decode("a", store.get(keys.standby_assign(2))) == proto.Assignment(1, 1, planned=True)
    assert controller.slots[1].process is standby and [s.process for s in controller.slots.leavers] == [b]
    assert "migrate-refused" not in job.get(keys.event(0)).decode()


def test_a_loss_before_a_migrations_switch_cancels_it(tmp_path: Path, procs) -> None:  # type: ignore[no-untyped-def]
    """Rank 1 migrates to standby 2 (planned generation 1); rank 0 dies before the switch (generation
    1 still recovering): generation 2 replaces rank 0 with standby 3 and gives rank 1 back to its
    own process (``returned``), which keeps the state; the migration's joiner is stopped (SIGTERM).
    Once generation 2 recovered, a later loss no longer touches that migration."""
    a, b, joiner, spare = (child("import time; time.sleep(60)") for _ in range(4))
    procs += [a, b, joiner, spare]
    pool = FakePool([FakeMember(2, joiner), FakeMember(3, spare)])
    store, job, controller = api_job(tmp_path, pool, {0: a, 1: b})
    store.set(keys.standby_ready(2), "{}")
    proto.request_migration(job, 1, "drain")
    controller.step()
    assert controller.slots[1].process is joiner
    store.set(keys.standby_ready(3), "{}")
    a.kill()
    wait_exit(a)
    controller.step()
    plan = proto.ReplacementPlan.decode("p", store.get(keys.plan(2)))
    assert plan.replaced == {0: 3} and not plan.planned and plan.returned == (1,)
    assert controller.slots[1].process is b and controller.slots[0].process is spare
    assert joiner.wait(timeout=30) == -15  # stopped: it never played the rank
    assert b.poll() is None and controller.slots.leavers == []
    events = [job.get(keys.event(i)).decode() for i in range(job.add(keys.EVENT_SEQ, 0))]
    assert any("migrate-cancelled" in e for e in events), events


def _two_ranks_and_two_warm_standbys(tmp_path: Path, procs, a: subprocess.Popen[bytes],  # type: ignore[no-untyped-def]
                                     b: subprocess.Popen[bytes]) -> tuple:
    """Ranks 0 and 1 played by ``a`` and ``b``, standbys 4 and 5 warm; a 30 s standby wait."""
    standbys = [child("import time; time.sleep(60)") for _ in range(2)]
    procs += [a, b, *standbys]
    pool = FakePool([FakeMember(4, standbys[0]), FakeMember(5, standbys[1])])
    store, controller = make(tmp_path, pool, wait=30.0)
    controller.adopt({0: a, 1: b})
    store.set(keys.standby_ready(4), "{}")
    store.set(keys.standby_ready(5), "{}")
    return store, controller, pool


def test_every_rank_failed_falls_back_at_once_without_a_plan_of_new_members(tmp_path: Path, procs) -> None:  # type: ignore[no-untyped-def]
    """Both ranks failed (a script's error in its first step on every rank): no rank holds the
    training state, so no plan is published (its joiners all failed their healing, "no member
    holds the training state (every member is new)", with a traceback each, after the standby
    wait); the group restarts at once, said in one line, though warm standbys wait."""
    a, b = child("raise SystemExit(1)"), child("raise SystemExit(1)")
    store, controller, pool = _two_ranks_and_two_warm_standbys(tmp_path, procs, a, b)
    wait_exit(a)
    wait_exit(b)
    outcome = controller.step()
    assert outcome.failed == {0: 1, 1: 1} and not outcome.final
    assert "no rank holds the training state" in proto.AbortNotice.decode("a", store.get(keys.ABORT)).reason
    assert not store.check([keys.plan(1)]) and len(pool.members) == 2


def test_the_last_holder_failing_while_a_joiner_is_not_healed_falls_back(tmp_path: Path, procs) -> None:  # type: ignore[no-untyped-def]
    """Rank 1 is replaced (generation 1); rank 0, the only rank holding the state, fails before
    rank 1's joiner recovered: a generation 2 of new members only would fail its healing; the
    group restarts at once instead."""
    a, b = child("import time; time.sleep(60)"), child("raise SystemExit(1)")
    store, controller, _ = _two_ranks_and_two_warm_standbys(tmp_path, procs, a, b)
    wait_exit(b)
    controller.step()
    assert proto.ReplacementPlan.decode("p", store.get(keys.plan(1))).replaced == {1: 4}
    a.kill()
    wait_exit(a)
    outcome = controller.step()
    assert 0 in outcome.failed and not outcome.final, outcome
    assert "no rank holds the training state" in proto.AbortNotice.decode("a", store.get(keys.ABORT)).reason
    assert not store.check([keys.plan(2)])


def test_the_last_rank_failing_during_the_standby_wait_ends_the_wait(tmp_path: Path, procs) -> None:  # type: ignore[no-untyped-def]
    """Rank 1 failed, no standby warm yet: the controller waits; rank 0 fails meanwhile: no rank
    holds the state any more, so the wait ends at once (it lasted the whole --standby-wait)."""
    a, b = child("import time; time.sleep(1.0); raise SystemExit(1)"), child("raise SystemExit(1)")
    procs += [a, b]
    store, controller = make(tmp_path, FakePool(), wait=30.0)
    controller.adopt({0: a, 1: b})
    wait_exit(b)
    started = time.monotonic()
    outcome = controller.step()
    assert time.monotonic() - started < 10.0  # not the 30 s standby wait
    assert outcome.failed == {0: 1, 1: 1} and not outcome.final
    assert "no rank holds the training state" in proto.AbortNotice.decode("a", store.get(keys.ABORT)).reason
