"""A failure stops the survivors' step in flight at once (tmrun.worker.interrupt), end to end.

tests/scripts/interrupt_train.py has steps of seconds: each of its layers sleeps in forward and
in backward and counts its runs, and its loop carries a data loader position, an LR schedule
and a gradient scaler. Rank 1 is SIGKILLed at the start of its forward (or of its backward) of
step 2; the survivor, rank 0, must stop that step within a few layers instead of finishing it
(counted, not timed), run the loop body's ``finally`` and context manager exactly once per
attempt, redo only that step, keep its process, and end bitwise equal to a run without the
failure, scheduler, scaler and loader position included.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import SCRIPTS, run_job, tmrun_cmd

pytestmark = pytest.mark.e2e

LAYERS = 12
STEPS = 4
FAIL_STEP = 2
JOB_TIMEOUT = 240


def _run(work: Path, *tmrun_args: str, wrap: str = "tm", script_args: tuple[str, ...] = ()) -> tuple[str, list[list[str]], str]:
    work.mkdir()
    cmd = tmrun_cmd("--standalone", "--nproc-per-node", "2", "--standby", "1", *tmrun_args,
                    str(SCRIPTS / "interrupt_train.py"), "--steps", str(STEPS), "--layers", str(LAYERS),
                    "--slow", "0.05", "--log", str(work / "log-{rank}"), "--final", str(work / "final-{rank}"),
                    "--wrap", wrap, *script_args)
    code, log = run_job(cmd, work / "agent.log", {"TMRUN_STATE_DIR": str(work / "state")}, JOB_TIMEOUT)
    assert code == 0, log
    finals = {(work / f"final-{rank}").read_text() for rank in (0, 1)}
    assert len(finals) == 1, "the ranks ended with different states\n" + log
    rows = [line.split() for line in (work / "log-0").read_text().splitlines()]
    return finals.pop(), rows, log


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """tm.ddp's run without a failure. FSDP2 with one shard per replica gives the same bits
    (the replicas' gradients averaged over 2 ranks either way)."""
    final, rows, _ = _run(tmp_path_factory.mktemp("interrupt") / "ref")
    assert [int(r[0]) for r in rows] == list(range(STEPS))
    return final


@pytest.mark.parametrize(("point", "wrap"), [("forward", "tm"), pytest.param("backward", "tm", marks=pytest.mark.variant),
                                             ("backward", "torch"),
                                             pytest.param("forward", "hsdp", marks=pytest.mark.variant),
                                             ("backward", "hsdp")])
def test_the_survivor_stops_the_doomed_step_at_once(tmp_path: Path, reference: str, point: str, wrap: str) -> None:
    """wrap="torch": the script wraps its model in DistributedDataParallel itself and gives it to
    tm.track (no tm.ddp): stopped the same way, same bits as tm.ddp's run without the failure.
    wrap="hsdp": FSDP2 (fully_shard per block, one shard per replica); the survivor resets FSDP's
    iteration state that the stop left mid-step, and ends with the bits of tm.ddp's run without
    the failure."""
    if (point, wrap) == ("backward", "hsdp"):
        # the drill's "backward" point of a sharded module comes at the end of its backward (its
        # first block's output gradient): rank 1 kills itself in its 3rd layer's backward instead
        final, rows, log = _run(tmp_path / f"{point}-{wrap}", wrap=wrap,
                                script_args=("--die-in-backward", f"1,{FAIL_STEP},3"))
    else:
        final, rows, log = _run(tmp_path / f"{point}-{wrap}", "--inject-failure",
                                f"rank=1,step={FAIL_STEP},at={point}", wrap=wrap)
    assert final == reference, "final state (model, optimizer, scheduler, scaler, loader) differs"
    steps = [int(r[0]) for r in rows]
    assert steps == [0, 1, FAIL_STEP, *range(FAIL_STEP, STEPS)], steps  # only the step in flight redone
    assert len({r[1] for r in rows}) == 1, "the survivor changed process"
    aborted, redone = rows[FAIL_STEP], rows[FAIL_STEP + 1]
    forwards, backwards = int(aborted[3]), int(aborted[4])
    assert aborted[2] == "1" and redone[2] == "0"
    recovered = re.findall(r"rank [01]: recovered into generation 1 .*", log)
    assert len(recovered) == 2, log
    if wrap == "hsdp":
        assert (forwards <= LAYERS // 2 and backwards == 0) if point == "forward" else \
            (forwards == LAYERS and backwards <= LAYERS // 2), aborted  # stopped, not finished
        survivor, joiner = sorted(recovered)
        assert "FSDP's iteration state reset" in survivor, recovered
        assert "FSDP's iteration state reset" not in joiner, recovered  # it had no step to stop
        assert not any("DDP reducers reset" in line for line in recovered), recovered
    elif point == "forward":
        assert forwards <= LAYERS // 2 and backwards == 0, aborted  # stopped, not finished
        # no backward was stopped: DDP keeps its buckets (no reset, no rebuild)
        assert not any("DDP reducers reset" in line for line in recovered), recovered
    else:
        assert forwards == LAYERS and backwards <= LAYERS // 2, aborted
        # the survivor's reducer waited for the stopped backward: every member resets its own
        assert all("DDP reducers reset" in line for line in recovered), recovered
    assert (int(redone[3]), int(redone[4])) == (LAYERS, LAYERS)
    for row in rows:  # the loop body's finally and context manager ran once per attempt
        assert (row[5], row[6]) == ("1", "1"), row
    # what the aborted attempt advanced was undone: the redone step saw the same position
    assert aborted[9] == redone[9] == str(FAIL_STEP + 1)
