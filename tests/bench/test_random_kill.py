"""bench/random_kill.py: its pure arithmetic (percentiles, the per-kill metrics from synthetic step
logs and kill times, the recovery phases from events) and that the script starts. Unit, no jobs."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from tests.helpers import ROOT, load_script

BENCH = ROOT / "bench" / "random_kill.py"


def _bench():  # type: ignore[no-untyped-def]
    return load_script(BENCH, "random_kill")


def test_percentile_interpolates_between_closest_ranks() -> None:
    bench = _bench()
    values = [float(v) for v in (7, 1, 10, 3, 2, 9, 4, 6, 8, 5)]  # order does not matter
    assert bench.percentile(values, 0) == 1.0
    assert bench.percentile(values, 50) == 5.5
    assert bench.percentile(values, 90) == pytest.approx(9.1)  # numpy's default ("linear")
    assert bench.percentile(values, 100) == 10.0
    assert bench.summary(values) == pytest.approx((1.0, 5.5, 9.1, 10.0))
    assert bench.summary([3.0]) == (3.0, 3.0, 3.0, 3.0)
    assert bench.percentile([2.0, float("nan"), 4.0], 50) == 3.0  # NaN (not measured) is left out
    assert math.isnan(bench.percentile([], 50))


def test_tmrun_kill_the_aborted_step_is_not_a_completion() -> None:
    bench = _bench()
    # steps 0..9 every second; rank 1 killed at 9.4, in step 10; the survivor logs step 10
    # aborted at 9.6 and again, redone, at 11.0
    rows = [(s, float(s), "100") for s in range(10)] + [(10, 9.6, "100"), (10, 11.0, "100"), (11, 12.0, "100")]
    assert bench.completions(rows, redone_aborted=True)[-3:] == [(9, 9.0), (10, 11.0), (11, 12.0)]
    assert (10, 9.6) in bench.completions(rows, redone_aborted=False)
    m = bench.kill_metrics(rows, 9.4, redone_aborted=True)
    assert m.steady == 1.0
    assert (m.t_last, m.t_next, m.in_flight) == (9.0, 11.0, 10)
    assert m.downtime == pytest.approx(1.0)  # (11 - 9) - 1
    assert m.stall == pytest.approx(0.6)  # (11 - 9.4) - 1
    assert bench.recovery_stall(m) == pytest.approx(0.6)  # the work lost in flight is not counted
    assert m.lost_work == pytest.approx(0.4)  # 9.4 - 9
    assert m.downtime == pytest.approx(m.stall + m.lost_work)
    assert m.committed == pytest.approx(1.0)  # step 10 done at 11, expected at 9 + 1
    assert m.recomputed == 0
    assert math.isnan(m.after)  # only one completion after t_next in this log
    slower = rows + [(12, 13.5, "100"), (13, 14.5, "100")]  # step 12 took 1.5 s: (f) = (13.5 - 11) - 2
    assert bench.kill_metrics(slower, 9.4, redone_aborted=True).after == pytest.approx(0.5)
    assert math.isnan(bench.kill_metrics(slower, 9.4, t_end=13.0, redone_aborted=True).after)  # past the next kill


def test_a_step_logged_twice_by_different_processes_is_kept() -> None:
    bench = _bench()
    rows = [(3, 1.0, "10"), (3, 2.0, "11"), (3, 3.0, "10"), (4, 4.0, "11")]
    assert bench.completions(rows, redone_aborted=True) == [(3, 2.0), (3, 3.0), (4, 4.0)]


def test_torchrun_kill_restart_from_the_checkpoint() -> None:
    bench = _bench()
    # train_checkpoint logs steps done (1-based), checkpoint at 10; killed at 15.3, during the
    # 16th step; the restarted group redoes 11..15 from 20 on and completes 16 at 25
    rows = [(s, float(s), "0.5") for s in range(1, 16)] + [(s, 9.0 + s, "0.5") for s in range(11, 18)]
    m = bench.kill_metrics(rows, 15.3)
    assert (m.t_last, m.t_next, m.in_flight, m.steady) == (15.0, 20.0, 16, 1.0)
    assert m.downtime == pytest.approx(4.0)
    assert m.stall == pytest.approx(3.7)
    assert m.lost_work == pytest.approx(0.3)
    assert m.committed == pytest.approx(9.0)  # step 16 at 25, expected at 16
    assert m.recomputed == 5  # 11..15


def test_a_step_completed_just_after_the_kill_is_before_the_stall() -> None:
    bench = _bench()
    # the kill (9.995) comes while rank 0 is writing its line of step 10 (10.0): the work was
    # done; the stall is the gap after it
    rows = [(s, float(s), "0.5") for s in range(1, 11)] + [(11, 15.0, "0.5"), (12, 16.0, "0.5")]
    m = bench.kill_metrics(rows, 9.995)
    assert (m.t_last, m.t_next, m.in_flight) == (10.0, 15.0, 11)
    assert m.downtime == pytest.approx(4.0)
    assert m.stall == pytest.approx(4.005)
    assert bench.recovery_stall(m) == pytest.approx(4.0)  # the step done before the kill is no stall
    assert m.lost_work == pytest.approx(-0.005)
    assert m.committed == pytest.approx(4.0)
    assert m.recomputed == 0


def test_the_window_ends_at_the_next_kill() -> None:
    bench = _bench()
    rows = [(s, float(s), "0.5") for s in range(1, 16)] + [(s, 9.0 + s, "0.5") for s in range(11, 18)]
    # a second kill at 22.5, before step 16 was completed again: (d) is not known
    m = bench.kill_metrics(rows, 15.3, t_end=22.5)
    assert m.downtime == pytest.approx(4.0)
    assert math.isnan(m.committed) and m.recomputed == -1
    # no completion after the kill within the window, or too few before it: nothing measured
    assert bench.kill_metrics(rows, 15.3, t_end=19.0) is None
    assert bench.kill_metrics(rows, 1.5) is None


def test_recovered_phases_from_events() -> None:
    bench = _bench()
    phases = {"detect": 0.001, "plan": 0.0007, "connect": 0.1, "transfer": 0.01, "first_step": 0.11,
              "recover": 0.15, "total": 0.156}  # fmt: skip
    events = [
        {"kind": "failure", "gen": 1},
        {"kind": "recovered", "gen": 1, "phases": phases, "marks": {"seen": 100.004}},
        {"kind": "recovered", "gen": 2, "phases": dict(phases, first_step=None)},
        {"kind": "recovered", "gen": 3, "phases": phases},  # beyond the kills counted
    ]
    got = bench.recovered_phases(events, 2, kill_times=[100.0, 200.0])
    assert len(got) == 2
    assert got[0]["kill_to_seen"] == pytest.approx(0.004)
    assert {k: v for k, v in got[0].items() if k != "kill_to_seen"} == phases
    assert math.isnan(got[1]["first_step"]) and got[1]["connect"] == 0.1
    assert math.isnan(got[1]["kill_to_seen"])  # no marks


def test_help_starts_without_torch() -> None:
    out = subprocess.run([sys.executable, str(BENCH), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--kills" in out.stdout and "--quick" in out.stdout
