"""Recovery totals and the event log's structured fields, from events alone."""

from __future__ import annotations

from tmrun.control.metrics import describe, enrich, link_phases, totals


def _e(seq: int, t: float, kind: str, detail: str, epoch: int = 1, **fields: object) -> dict:
    return {"seq": seq, "time": t, "kind": kind, "epoch": epoch, "detail": detail, **fields}


def test_one_node_details_become_fields() -> None:
    replace = enrich(_e(2, 10, "replace", "rank 1 (pid 5, killed by SIGKILL) -> standby 0 (pid 7)", epoch=1))
    assert replace["ranks"] == [1] and replace["gen"] == 1
    recovered = enrich(_e(3, 11, "recovered", "2 ranks back in 1.250s", epoch=1))
    assert recovered["seconds"] == 1.25 and recovered["phases"]["total"] == 1.25
    assert set(recovered["phases"]) == {"detect", "plan", "connect", "transfer", "recover", "first_step", "total"}


def test_phases_from_the_plan_event() -> None:
    published: dict[int, float] = {}
    link_phases(enrich(_e(2, 10.0, "replace", "rank 1 (pid 5, exit code 1) -> standby 0 (pid 7)", epoch=3)), published)
    recovered = link_phases(enrich(_e(3, 11.0, "recovered", "2 ranks back in 1.250s", epoch=3)), published)
    assert recovered["phases"]["recover"] == 1.0 and recovered["phases"]["plan"] == 0.25
    assert published == {}
    alone = link_phases(enrich(_e(4, 12.0, "recovered", "generation 9: all 2 ranks back in 0.5s")), published)
    assert alone["phases"]["recover"] is None and alone["phases"]["plan"] is None


def test_node_details_become_fields() -> None:
    migrate = enrich(_e(4, 12, "migrate", "generation 2: node 3 took group rank 1 of node 1 "
                                          "(ranks 2->standby 4, 3->standby 5): drain [ab12]", epoch=1))
    assert migrate["gen"] == 2 and migrate["ranks"] == [2, 3] and migrate["nodes"] == [1, 3]
    recovered = enrich(_e(5, 13, "recovered", "generation 2: all 4 ranks back in 0.800s"))
    assert recovered["gen"] == 2 and recovered["seconds"] == 0.8
    given = enrich(_e(6, 14, "join", "node 9 joined", nodes=[9]))
    assert given["nodes"] == [9]  # what the writer gave wins


def test_totals() -> None:
    events = [
        _e(0, 100.0, "join", "node 0 (h) joined", epoch=0),
        _e(1, 100.0, "formed", "formed with 1 active, 0 standby"),
        _e(2, 150.0, "replace", "rank 1 (pid 5, killed by SIGKILL) -> standby 0 (pid 7)"),
        _e(3, 152.0, "recovered", "2 ranks back in 2.000s"),
        _e(4, 160.0, "migrate", "rank 0 (pid 4) -> standby 1 (pid 9): drill", epoch=2),
        _e(5, 161.0, "recovered", "2 ranks back in 1.000s", epoch=3),
        _e(6, 200.0, "closed", "succeeded: workers finished"),
    ]
    t = totals(events, now=999.0)
    assert t["wall_s"] == 100.0 and t["downtime_s"] == 3.0 and t["ettr"] == 0.97
    assert t["recoveries"] == 2 and t["migrations"] == 1 and t["steps_recomputed"] == 1
    assert t["restarts"] == 0 and t["finished"]
    assert "ETTR 97.00%" in describe(t)


def test_a_recovery_whose_survivors_had_committed_recomputed_nothing() -> None:
    """A rank lost in its optimizer step: every survivor's step committed, the group resumes at
    the next one (the event says 0); an event that says nothing counts the step in flight."""
    events = [
        _e(1, 100.0, "formed", "formed with 1 active, 0 standby"),
        _e(2, 150.0, "replace", "rank 1 (pid 5, killed by SIGKILL) -> standby 0 (pid 7)"),
        _e(3, 151.0, "recovered", "2 ranks back in 1.000s", steps_recomputed=0),
        _e(4, 160.0, "replace", "rank 0 (pid 4, killed by SIGKILL) -> standby 1 (pid 9)", epoch=2),
        _e(5, 161.0, "recovered", "2 ranks back in 1.000s", epoch=2, steps_recomputed=1),
        _e(6, 170.0, "replace", "rank 1 (pid 7, killed by SIGKILL) -> standby 2 (pid 11)", epoch=3),
        _e(7, 171.0, "recovered", "2 ranks back in 1.000s", epoch=3),
        _e(8, 172.0, "replace", "rank 0 (pid 9, killed by SIGKILL) -> standby 3 (pid 12)", epoch=4),
        _e(9, 173.0, "recovered", "2 ranks back in 1.000s", epoch=4, steps_recomputed="x"),  # malformed: the default
        _e(10, 200.0, "closed", "succeeded: workers finished"),
    ]
    assert totals(events, now=999.0)["steps_recomputed"] == 0 + 1 + 1 + 1


def test_restarts_are_counted_and_flagged() -> None:
    events = [
        _e(0, 0.0, "formed", "formed with 2 active, 0 standby"),
        _e(1, 5.0, "fallback", "rank 1: no standby ready within 60s"),
        _e(2, 6.0, "replace", "epoch 2: node 1 restarts in place"),
    ]
    t = totals(events, now=10.0)
    # the fallback and the new epoch it starts are ONE group restart
    assert t["restarts"] == 1 and t["restarts_excluded"] and t["ettr"] == 1.0 and not t["finished"]
    # a new epoch without a fallback (a node lost, no standby node) is a restart of its own
    later = [*events, _e(3, 8.0, "replace", "epoch 3: node 0 restarts in place")]
    assert totals(later, now=10.0)["restarts"] == 2
    assert "not in the downtime" in describe(t)
    assert totals([], now=5.0)["ettr"] == 1.0


def test_a_failed_job_has_no_ettr() -> None:
    """A job that ended failed printed 'downtime 0.000s ... ETTR 100.00%': its work since the last
    checkpoint is lost, which no event measures, so it claims no ETTR."""
    events = [
        _e(0, 0.0, "formed", "formed with 2 active, 0 standby"),
        _e(1, 5.0, "failure", "node 0: rank 1 (pid 5) exit code 1"),
        _e(2, 6.0, "closed", "failed: workers failed with no restarts left: rank 1 exit code 1"),
    ]
    t = totals(events, now=10.0)
    assert t["failed"] and t["ettr"] is None and t["finished"]
    assert "ETTR none (the job failed)" in describe(t) and "100" not in describe(t)
    ok = totals([*events[:1], _e(1, 6.0, "closed", "succeeded: workers finished")], now=10.0)
    assert not ok["failed"] and ok["ettr"] == 1.0


def test_a_measured_restart_is_in_the_downtime_and_the_recomputed_steps() -> None:
    """A group restart that redid 26 steps printed '0 steps recomputed, ETTR 100.00%': its
    restarted event (control.restarts) now brings its downtime and steps into the totals."""
    events = [
        _e(0, 0.0, "formed", "formed with 2 active, 0 standby"),
        _e(1, 50.0, "fallback", "rank 1: no standby ready within 60s"),
        _e(2, 50.1, "replace", "epoch 2: node 0 restarts in place"),
        _e(3, 70.0, "restarted", "epoch 2: the group restart cost 20.000s", seconds=20.0, steps_recomputed=26,
           resumed=0, high_water=25),
        _e(4, 100.0, "closed", "succeeded: workers finished"),
    ]
    t = totals(events, now=999.0)
    assert t["downtime_s"] == 20.0 and t["ettr"] == 0.8 and t["steps_recomputed"] == 26
    assert t["restarts"] == 1 and t["restarts_measured"] == 1 and not t["restarts_excluded"]
    assert describe(t).endswith("26 steps recomputed, 1 group restart (counted above)")
    # a restart that could not be measured (no progress: a script without the worker API)
    unmeasured = [*events[:3], _e(3, 99.0, "restarted", "epoch 2: the group restart was not measured", seconds=None,
                                  steps_recomputed=None), events[4]]
    u = totals(unmeasured, now=999.0)
    assert u["restarts_excluded"] and u["downtime_s"] == 0.0 and "(not in the downtime)" in describe(u)
