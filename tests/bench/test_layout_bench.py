"""bench/layout_recovery.py: its flag checks and the layouts' sizes. Unit, no jobs (the kill
arithmetic is bench/random_kill.py's, tested in test_random_kill.py)."""

from __future__ import annotations

import sys

import pytest

from tests.helpers import ROOT, assert_one_line_usage_error, load_script

BENCH = ROOT / "bench" / "layout_recovery.py"


def _bench():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        return load_script(BENCH, "layout_recovery")
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_defaults_name_every_layout_at_about_the_same_size() -> None:
    args = _bench().parse_args([])
    assert [s.name for s in args.specs] == ["ddp", "hsdp", "tp", "pp", "3d", "pp_hsdp"]
    assert all(abs(s.parameters - 1.6e6) / 1.6e6 < 0.05 for s in args.specs), args.specs
    assert [s.ranks for s in args.specs] == [4, 4, 4, 4, 8, 8]
    assert [s.subgroups for s in args.specs] == [False, True, True, True, True, True]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--runs", "0"], "--runs must be at least 1"),
        (["--params", "10"], "--params must be between 1e4 and 1e8"),
        (["--layouts", "ddp,moe"], "unknown layout 'moe'"),
        (["--layouts", ","], "--layouts names none"),
        (["--kill-step", "2"], "--kill-step must be at least 3"),
        (["--kill-step", "10", "--steps", "12"], "--steps must be at least --kill-step + 3"),
        (["--step-time", "-1"], "--step-time must not be negative"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_flags_exit_2_with_one_line(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert_one_line_usage_error(_bench().parse_args, flags, "layout_recovery.py", message, capsys)


def test_parameter_counts_match_the_models() -> None:
    torch = pytest.importorskip("torch")
    bench = _bench()
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from train_3d import build_stage as blocks_of
        from train_inplace import build_model
        from train_pp import build_stage as stack_of
    finally:
        sys.path.remove(str(ROOT / "examples"))

    def count(module: torch.nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    assert count(build_model(64, 3)) == bench.mlp_parameters(64, 3) + 64 + 1  # the head
    assert count(stack_of(0, 1, 64, 3)) == bench.mlp_parameters(64, 3)
    assert count(blocks_of(0, 1, 16, 3)) == bench.block_parameters(16, 3)


def test_ddp_with_a_subgroup_is_ddps_model_in_a_job_with_subgroups() -> None:
    bench = _bench()
    every = bench.layouts(1_600_000)
    ddp, sub = every["ddp"], every["ddp_sub"]
    assert sub.script == ddp.script and sub.parameters == ddp.parameters and sub.subgroups and not ddp.subgroups
    assert sub.size_args == (*ddp.size_args, "--subgroup")
    assert "ddp_sub" not in bench.parse_args([]).layouts  # not in the default set
    assert bench.parse_args(["--layouts", "ddp,ddp_sub"]).layouts == ["ddp", "ddp_sub"]


def test_the_kill_waits_for_what_says_the_standby_is_warm() -> None:
    bench = _bench()
    ddp, hsdp = bench.layouts(1_600_000)["ddp"], bench.layouts(1_600_000)["hsdp"]
    assert bench.warm_marker(ddp) == "] standby 0 warm after"  # its sandbox's shadow steps
    assert bench.warm_marker(hsdp) == "] standby 0 warm after"  # its rehearsal's shadow steps
    assert bench.warm_marker(hsdp, rehearsal=False) == "in its first steps"  # the modules imported ahead
    assert bench.warm_marker(hsdp, warm_imports=False, rehearsal=False) == "] standby 0 warm in tmrun.init()"


def test_the_report_gives_each_layouts_downtime_and_recovery_over_ddps(capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench()
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from random_kill import KillMetrics
    finally:
        sys.path.remove(str(ROOT / "bench"))
    args = bench.parse_args(["--layouts", "ddp,tp", "--runs", "2"])

    def run(name: str, index: int, downtime: float, recovery: float):  # type: ignore[no-untyped-def]
        metrics = KillMetrics(steady=0.1, downtime=downtime, stall=downtime, lost_work=0.0, committed=0.0,
                              recomputed=0, in_flight=8, t_last=1.0, t_next=1.2)
        return bench.Run(name, index, ok=True, metrics=metrics, recovery=recovery)

    runs = [run("ddp", 0, 0.10, 0.10), run("ddp", 1, 0.10, 0.12), run("tp", 0, 0.30, 0.15), run("tp", 1, 0.20, 0.18)]
    bench.report(args, runs, 1.0)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
            for line in capsys.readouterr().out.splitlines() if line.startswith("| ddp") or line.startswith("| tp")}
    assert rows["ddp"][6] == "1.00" and rows["ddp"][8] == "1.00"
    assert rows["tp"][6] == "2.50"  # downtime: median 0.25 over DDP's 0.10
    assert rows["tp"][7] == "0.150 / 0.165 / 0.180" and rows["tp"][8] == "1.50"  # recovery: 0.165 over 0.11
