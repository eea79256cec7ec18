"""bench/inplace_failover.py: its log arithmetic, and one short end-to-end run (about 15 s) so that
the bench notices when tmrun's log lines or the example's step log change under it."""

from __future__ import annotations

import datetime as dt
import sys

import pytest

from tests.helpers import ROOT, load_script, run

BENCH = ROOT / "bench" / "inplace_failover.py"


def _bench():  # type: ignore[no-untyped-def]
    return load_script(BENCH, "inplace_failover")


def test_log_stamp_takes_the_date_nearest_the_reference() -> None:
    bench = _bench()
    just_after_midnight = dt.datetime(2026, 11, 23, 0, 0, 1).timestamp()
    # a line stamped just before midnight belongs to the previous day
    before = dt.datetime(2026, 11, 22, 23, 59, 59, 500000).timestamp()
    after = dt.datetime(2026, 11, 23, 0, 0, 0, 250000).timestamp()
    assert bench.wall_time("23:59:59.500", just_after_midnight) == before
    assert bench.wall_time("00:00:00.250", just_after_midnight) == after


def test_downtime_and_time_lost() -> None:
    bench = _bench()
    # steps every 1 s; step 3 aborted at t=3.2 and redone at t=4.5
    rows = [(0, 0.0, "p"), (1, 1.0, "p"), (2, 2.0, "p"), (3, 3.2, "p"), (3, 4.5, "p"), (4, 5.5, "p")]
    times = [t for _, t, _ in rows]
    steady = bench.steady_step(times[:3])
    assert steady == 1.0
    assert round(bench.largest_gap(times) - steady, 6) == 0.3  # raw log: 3.2 -> 4.5
    assert round(bench.largest_gap(bench.committed_times(rows)) - steady, 6) == 1.5  # committed: 2.0 -> 4.5


@pytest.mark.e2e
def test_short_scale_run() -> None:
    out = run(
        [sys.executable, str(BENCH), "--runs", "1", "--parts", "scale", "--scale", "2", "--scale-steps", "20",
         "--scale-fail-step", "14", "--timeout", "90"],
        timeout=150,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout
    assert "| 2 | 1 of 1 |" in out.stdout, out.stdout


@pytest.mark.e2e  # starts processes that import torch: not in the unit subset
@pytest.mark.parametrize("bench", ["gpu_inplace.py", "gpu_nccl.py", "gpu_p2p.py"])
def test_gpu_benches_skip_cleanly_without_a_gpu(bench: str) -> None:
    import subprocess

    import torch

    if torch.cuda.is_available():
        pytest.skip(f"a GPU is here: run bench/{bench} itself")
    result = subprocess.run([sys.executable, str(ROOT / "bench" / bench)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 77 and "SKIP" in result.stdout, result.stdout + result.stderr


@pytest.mark.e2e
def test_nccl_bench_collective_checks_pass_on_the_cpu_plane() -> None:
    """bench/gpu_nccl.py's (a): every collective x dtype against its exact reference, on the
    device plane's CPU test mode (gloo) with 3 ranks, so the checks themselves are known to pass
    (and to go through the plane) before they run on a GPU."""
    bench = load_script(ROOT / "bench" / "gpu_nccl.py", "gpu_nccl")
    results = bench.spawn("collectives-cpu", 3, 120, [])
    for r in results:
        assert "failures" in r, r
        assert r["failures"] == [] and r["device_ops"] > 50 and r["plane"]["builds"] == 1, r


@pytest.mark.e2e
@pytest.mark.parametrize("plane", ["tcp", "gloo"])
def test_p2p_bench_tmrun_cases_pass_on_cpu(plane: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/gpu_p2p.py's tmrun cases on CPU tensors (the TCP transport, and the device plane's
    gloo test mode): send/recv in order and at once, batch_isend_irecv of 64 MiB each way (a hang
    before P2P batches), and a 2-stage GPipe pipeline whose gradients match one process's."""
    bench = load_script(ROOT / "bench" / "gpu_p2p.py", "gpu_p2p")
    monkeypatch.setenv("GPU_P2P_ON_CPU", "1")
    if plane == "gloo":
        monkeypatch.setenv("TMRUN_DEVICE_PLANE", "gloo")
    for case in ("tmrun-send", "tmrun-isend", "tmrun-batch", "tmrun-pipeline"):
        result = bench.run_case(case, 90)
        assert result["ok"], result
