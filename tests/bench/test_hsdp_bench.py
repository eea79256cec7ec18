"""bench/hsdp_failover.py: its flag checks, parameter count and summaries, and that the script
starts. Unit, no jobs (the kill arithmetic is bench/random_kill.py's, tested in test_random_kill.py)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from tests.helpers import ROOT, assert_one_line_usage_error, load_script

BENCH = ROOT / "bench" / "hsdp_failover.py"


def _bench():  # type: ignore[no-untyped-def]
    return load_script(BENCH, "hsdp_failover")


def test_defaults_and_launchers() -> None:
    args = _bench().parse_args([])
    assert (args.runs, args.dim, args.layers, args.steps, args.kill_step, args.checkpoint_every) == (3, 256, 4, 30, 15, 10)
    assert args.launchers == ["torchrun", "tmrun"]
    assert _bench().parse_args(["--launchers", "tmrun"]).launchers == ["tmrun"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--runs", "0"], "--runs must be at least 1"),
        (["--dim", "33"], "--dim must be even"),
        (["--layers", "0"], "--layers must be at least 1"),
        (["--kill-step", "20", "--steps", "21"], "--steps must be at least --kill-step + 3"),
        (["--kill-step", "5"], "--checkpoint-every must be at most --kill-step"),
        (["--launchers", "srun"], "unknown launcher 'srun'"),
        (["--launchers", ","], "--launchers names none"),
        (["--dim", "x"], "invalid int value"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_flags_exit_2_with_one_line(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert_one_line_usage_error(_bench().parse_args, flags, "hsdp_failover.py", message, capsys)


def test_parameter_count_matches_the_model() -> None:
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from tiny_gpt import GPT, GPTConfig
    finally:
        sys.path.remove(str(ROOT / "examples"))
    for dim, layers in ((32, 2), (256, 4)):
        model = GPT(GPTConfig(dim=dim, layers=layers))
        assert _bench().gpt_parameters(dim, layers) == sum(p.numel() for p in model.parameters())
    assert isinstance(torch.__version__, str)


def test_summaries() -> None:
    bench = _bench()
    assert bench.spread([3.0, 1.0, float("nan"), 2.0]) == "1.00 / 2.00 / 3.00"
    assert bench.spread([]) == "-" and bench.spread([float("nan")]) == "-"
    assert bench.spread([0.1234], "{:.3f}") == "0.123 / 0.123 / 0.123"
    assert bench.distinct([5, 5, 4, -1]) == "4, 5"
    assert bench.distinct([-1]) == "-"
    assert bench.digests_agree([["a", "b"], ["a", "b"]]) is True
    assert bench.digests_agree([["a", "b"], ["a", "c"]]) is False
    assert bench.digests_agree([["a", "b"], [], ["a", ""]]) is None  # incomplete runs are left out
    assert math.isnan(bench.NAN)


def test_help_starts_without_torch() -> None:
    code = ("import sys; sys.modules['torch'] = None; sys.argv = ['hsdp_failover.py', '--help']; "
            f"import runpy; runpy.run_path({str(BENCH)!r}, run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--kill-step" in out.stdout and "--checkpoint-every" in out.stdout
