"""bench/torchtitan_failover.py: its flag checks, kill plan and summaries, and that ``--help``
works without torch. Unit, no jobs (the kill arithmetic is bench/random_kill.py's, tested in
test_random_kill.py; the bench's own run is an e2e matter)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, assert_one_line_usage_error, load_script

BENCH = ROOT / "bench" / "torchtitan_failover.py"


def _bench():  # type: ignore[no-untyped-def]
    return load_script(BENCH, "torchtitan_failover")


def test_defaults_and_launchers() -> None:
    args = _bench().parse_args([])
    assert (args.runs, args.layout, args.steps, args.checkpoint_every, args.seed) == (3, "ddp", 20, 5, 0)
    assert args.launchers == ["torchrun", "tmrun"]
    assert _bench().parse_args(["--launchers", "tmrun", "--layout", "hsdp"]).launchers == ["tmrun"]
    assert _bench().LAYOUTS["ddp"][0] == 2 and _bench().LAYOUTS["hsdp"][0] == 4 and _bench().LAYOUTS["tp_dp"][0] == 4
    assert set(_bench().LAYOUT_NAMES) == set(_bench().LAYOUTS)
    assert args.compile is False and _bench().parse_args(["--layout", "tp_dp", "--compile"]).compile is True


def test_compile_adds_torchtitans_flag_under_both_launchers(tmp_path: Path) -> None:
    bench = _bench()
    for launcher in ("torchrun", "tmrun"):
        plain, _ = bench.command(bench.parse_args(["--layout", "tp_dp"]), launcher, tmp_path, tmp_path)
        compiled, _ = bench.command(bench.parse_args(["--layout", "tp_dp", "--compile"]), launcher, tmp_path, tmp_path)
        assert "--compile.enable" not in plain and compiled.count("--compile.enable") == 1
        assert "--parallelism.tensor_parallel_degree" in compiled


def test_async_checkpoint_saves_asynchronously_under_both_launchers(tmp_path: Path) -> None:
    bench = _bench()
    tmrun, _ = bench.command(bench.parse_args([]), "tmrun", tmp_path, tmp_path)
    assert "--checkpoint.enable" not in tmrun  # by default tmrun saves nothing (it heals from the ranks)
    for launcher in ("torchrun", "tmrun"):
        cmd, _ = bench.command(bench.parse_args(["--async-checkpoint", "--checkpoint-every", "4"]), launcher,
                               tmp_path, tmp_path)
        assert cmd.count("--checkpoint.enable") == 1 and cmd[cmd.index("--checkpoint.interval") + 1] == "4"
        assert cmd[cmd.index("--checkpoint.async_mode") + 1] == "async"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--runs", "0"], "--runs must be at least 1"),
        (["--layout", "tp"], "unknown --layout 'tp'"),
        (["--checkpoint-every", "0"], "--checkpoint-every must be at least 1"),
        (["--steps", "8"], "--steps must be at least 9 with --checkpoint-every 5"),
        (["--checkpoint-every", "18"], "--steps must be at least 22 with --checkpoint-every 18"),
        (["--launchers", "srun"], "unknown launcher 'srun'"),
        (["--launchers", ","], "--launchers names none"),
        (["--timeout", "0"], "--timeout must be positive"),
        (["--steps", "x"], "invalid int value"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_flags_exit_2_with_one_line(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert_one_line_usage_error(_bench().parse_args, flags, "torchtitan_failover.py", message, capsys)


def test_kill_plan_is_seeded_and_lands_after_a_checkpoint() -> None:
    bench = _bench()
    assert bench.kill_range(20, 5) == (6, 17)
    assert bench.kill_range(20, 1) == (5, 17)  # still a steady step before the kill
    plan = bench.kill_plan(0, 20, 20, 5)
    assert plan == bench.kill_plan(0, 20, 20, 5) and plan != bench.kill_plan(1, 20, 20, 5)
    assert all(6 <= step <= 17 and 0 <= fraction < 1 for step, fraction in plan)
    assert bench.kill_plan(0, 2, 20, 5) == plan[:2]  # more runs do not change the first ones


def test_summaries() -> None:
    bench = _bench()
    assert bench.spread([3.0, 1.0, float("nan"), 2.0]) == "1.00 / 2.00 / 3.00"
    assert bench.spread([]) == "-" and bench.spread([float("nan")]) == "-"
    tables = load_script(ROOT / "bench" / "hsdp_failover.py", "hsdp_failover")  # this bench's tables come from there
    assert tables.distinct([5, 5, 0, -1]) == "0, 5"
    assert bench.digests_agree([["a", "a"], ["a", "a"]]) is True
    assert bench.digests_agree([["a", "a"], ["a", "b"]]) is False
    assert bench.digests_agree([["a", "a"], [], ["a", ""]]) is None  # incomplete runs are left out


def test_help_starts_without_torch() -> None:
    code = ("import sys; sys.modules['torch'] = None; sys.modules['torchtitan'] = None; "
            "sys.argv = ['torchtitan_failover.py', '--help']; "
            f"import runpy; runpy.run_path({str(BENCH)!r}, run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--checkpoint-every" in out.stdout and "--layout" in out.stdout
