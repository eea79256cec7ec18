"""bench/idle_cpu.py: the roles it counts a launcher's processes under, the cores it computes
from two samples, and (end to end, short) one run of each launcher."""

from __future__ import annotations

import sys

import pytest

from tests.helpers import ROOT, load_script, run

BENCH = ROOT / "bench" / "idle_cpu.py"


def _bench():  # noqa: ANN202 (a module loaded from a path)
    return load_script(BENCH, "idle_cpu")


def test_each_process_of_a_launchers_tree_is_counted_under_its_role() -> None:
    bench = _bench()
    script = str(ROOT / "examples" / "train_inplace.py")
    assert bench.role_of(["python", "-m", "tmrun.cli.main", "--standby", "1", script, "--steps", "9"]) == "launcher"
    assert bench.role_of(["python", "-m", "torch.distributed.run", "--nproc-per-node", "2", script]) == "launcher"
    assert bench.role_of(["python", "-u", script, "--steps", "9"]) == "worker"
    assert bench.role_of(["python", "-m", "tmrun.worker.standby_process"]) == "standby"
    assert bench.role_of(["python", "-c", "anything else"]) == "launcher"


def test_cores_used_count_only_the_processes_sampled_at_both_ends() -> None:
    bench = _bench()
    before = {1: ("launcher", 10.0), 2: ("worker", 5.0), 3: ("worker", 7.0), 4: ("standby", 1.0)}
    after = {1: ("launcher", 10.5), 2: ("worker", 6.0), 3: ("worker", 7.5), 5: ("standby", 9.0)}
    used = bench.shares(before, after, 10.0)  # process 4 ended, 5 started: neither counted
    assert used == pytest.approx({"launcher": 0.05, "worker": 0.15, "standby": 0.0})


@pytest.mark.e2e  # starts processes that import torch: not in the unit subset
def test_one_short_run_of_each_launcher_reports_its_roles() -> None:
    out = run([sys.executable, str(BENCH), "--runs", "1", "--warm-steps", "12", "--window", "2", "--steps", "60",
               "--step-time", "0.1"], timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {line.split("|")[1].strip(): line for line in out.stdout.splitlines() if line.startswith("| t")}
    assert set(rows) == {"torchrun+gloo", "tmrun"}, out.stdout
    standby = float(rows["tmrun"].split("|")[4])
    assert 0.0 < standby < 1.0, out.stdout  # a warm standby was sampled
    assert rows["torchrun+gloo"].split("|")[4].strip() == "-", out.stdout
