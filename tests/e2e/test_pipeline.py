"""Pipeline parallelism x data parallelism in place (examples/train_pp.py: torch.distributed.pipelining,
2 stages x 2 replicas on 4 ranks, one standby): a rank of the first or the last stage killed at a
step's start, in forward or in backward, is replaced in place, healed from its own stage's
replica (tm.set_shard), its pipeline runs torch's start-up again with the joiner (the other
replica's pipeline goes on), and every rank ends bitwise equal to the same script under plain
torchrun."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import ROOT, run_job, tmrun_cmd, torchrun_cmd

pytestmark = pytest.mark.e2e

SCRIPT = ROOT / "examples" / "train_pp.py"
RANKS = 4
JOB_TIMEOUT = 240


def _run(work: Path, launcher: str, schedule: str, *launcher_args: str) -> tuple[int, str, dict[int, str]]:
    work.mkdir()
    args = [str(SCRIPT), "--steps", "8", "--schedule", schedule, "--final", str(work / "final-{rank}")]
    if launcher == "torchrun":
        cmd = torchrun_cmd("--standalone", "--nproc-per-node", str(RANKS), *args)
    else:
        cmd = tmrun_cmd("--standalone", "--nproc-per-node", str(RANKS), "--standby", "1", "--console", "plain",
                        "--standby-wait", "60", *launcher_args, *args)
    code, log = run_job(cmd, work / "log", {"TMRUN_STATE_DIR": str(work / "state")}, JOB_TIMEOUT)
    finals = {r: (work / f"final-{r}").read_text().strip() for r in range(RANKS) if (work / f"final-{r}").exists()}
    return code, log, finals


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, str]]:
    root = tmp_path_factory.mktemp("pp-reference")
    finals = {}
    for schedule in ("gpipe", "1f1b"):
        code, log, got = _run(root / schedule, "torchrun", schedule)
        assert code == 0, log[-3000:]
        assert len(got) == RANKS and got[0] == got[2] and got[1] == got[3], got  # replicas of a stage agree
        finals[schedule] = got
    return finals


@pytest.mark.parametrize(("schedule", "failure", "neighbour"), [
    ("1f1b", "rank=3,step=5", 2),               # the last stage, at a step's start
    ("gpipe", "rank=0,step=3", 1),              # the first stage
    ("1f1b", "rank=2,step=4,at=backward", 3),   # the first stage, in backward (1F1B's steady state)
    ("gpipe", "rank=1,step=2,at=forward", 0),   # the last stage, in forward
])
def test_a_lost_stage_rank_is_replaced_in_place_bitwise_equal_to_torchrun(
        tmp_path: Path, reference: dict[str, dict[int, str]], schedule: str, failure: str, neighbour: int) -> None:
    code, log, finals = _run(tmp_path / "tmrun", "tmrun", schedule, "--inject-failure", failure)
    assert code == 0, log[-4000:]
    assert "1 in-place recoveries" in log and "group restart" not in log, log[-4000:]
    lost = int(failure.split(",")[0].split("=")[1])
    # healed from its own stage: the replica of the same stage is the only donor that sent
    assert f"rank {lost}: recovered" in log and "from 1 donor" in log, log[-4000:]
    # the joiner's pipeline neighbour started its pipeline again; the other replica's did not
    assert f"rank {neighbour}: the pipeline of rank(s) [{lost}] runs torch's start-up again" in log, log[-4000:]
    others = set(range(RANKS)) - {lost, neighbour}
    assert not any(f"rank {r}: the pipeline of" in log for r in others), log[-4000:]
    assert finals == reference[schedule], (finals, reference[schedule])


def test_a_planned_migration_of_a_stage_rank_recomputes_nothing(tmp_path: Path,
                                                                 reference: dict[str, dict[int, str]]) -> None:
    """tm.migrate() by rank 1 (the last stage of the first replica) after step 5: the joiner is
    handed its state (not healed), and its pipeline still starts again with it; nothing is
    recomputed and the bits are torchrun's."""
    work = tmp_path / "tmrun"
    work.mkdir()
    cmd = tmrun_cmd("--standalone", "--nproc-per-node", str(RANKS), "--standby", "1", "--console", "plain",
                    str(SCRIPT), "--steps", "8", "--schedule", "1f1b", "--final", str(work / "final-{rank}"),
                    "--migrate-at", "5", "--migrate-rank", "1", "--step-time", "1.0")
    code, log = run_job(cmd, work / "log", {"TMRUN_STATE_DIR": str(work / "state")}, JOB_TIMEOUT)
    assert code == 0, log[-4000:]
    assert "planned migration, generation 1: rank 1" in log, log[-4000:]
    assert "1 in-place recoveries (1 planned), 0 steps recomputed" in log, log[-4000:]
    assert "rank 0: the pipeline of rank(s) [1] runs torch's start-up again" in log, log[-4000:]
    finals = {r: (work / f"final-{r}").read_text().strip() for r in range(RANKS)}
    assert finals == reference["1f1b"]
