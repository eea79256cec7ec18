"""Pipeline parallelism x data parallelism in place (examples/train_pp.py: torch.distributed.pipelining,
2 stages x 2 replicas on 4 ranks, one standby): a rank of the first or the last stage killed at a
step's start, in forward or in backward, is replaced in place, healed from its own stage's
replica (tm.set_shard), the joiner runs its pipeline's start-up alone from the messages the lost
rank received in its own (no survivor runs it again), and every rank ends bitwise equal to the same script under plain
torchrun. Also: a joiner lost during that recovery, a stage lost in every replica (the group
restart), a lost node replaced by a standby node, and examples/train_3d.py (PP x TP x DP and
PP x HSDP on 8 ranks)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT, drained_on_three_agents, kill_after_steps, run_agents, run_job, tmrun_cmd, torchrun_cmd

pytestmark = pytest.mark.e2e

SCRIPT = ROOT / "examples" / "train_pp.py"
RANKS = 4
JOB_TIMEOUT = 240


def _run(work: Path, launcher: str, schedule: str, *launcher_args: str, env: dict[str, str] | None = None,
         script_args: tuple[str, ...] = ()) -> tuple[int, str, dict[int, str]]:
    work.mkdir()
    args = [str(SCRIPT), "--steps", "8", "--schedule", schedule, "--final", str(work / "final-{rank}"), *script_args]
    if launcher == "torchrun":
        cmd = torchrun_cmd("--standalone", "--nproc-per-node", str(RANKS), *args)
    else:
        cmd = tmrun_cmd("--standalone", "--nproc-per-node", str(RANKS), "--standby", "1", "--console", "plain",
                        "--standby-wait", "60", *launcher_args, *args)
    code, log = run_job(cmd, work / "log", {"TMRUN_STATE_DIR": str(work / "state"), **(env or {})}, JOB_TIMEOUT)
    finals = {r: (work / f"final-{r}").read_text().strip() for r in range(RANKS) if (work / f"final-{r}").exists()}
    return code, log, finals


class _Lazy(dict):
    """Key -> ``compute(key)``, computed the first time a test asks for it (a selection of these
    tests pays only for the torchrun references it uses)."""

    def __init__(self, compute: Callable[[Any], dict[int, str]]) -> None:
        super().__init__()
        self._compute = compute

    def __missing__(self, key: Any) -> dict[int, str]:
        self[key] = self._compute(key)
        return self[key]


def _pp_reference(root: Path, schedule: str) -> dict[int, str]:
    """Every rank's final digest of examples/train_pp.py under plain torchrun."""
    code, log, got = _run(root / schedule, "torchrun", schedule)
    assert code == 0, log[-3000:]
    assert len(got) == RANKS and got[0] == got[2] and got[1] == got[3], got  # replicas of a stage agree
    return got


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, str]]:
    root = tmp_path_factory.mktemp("pp-reference")
    return _Lazy(lambda schedule: _pp_reference(root, schedule))


@pytest.mark.parametrize(("schedule", "failure", "neighbour"), [
    ("1f1b", "rank=3,step=5", 2),               # the last stage, at a step's start
    pytest.param("gpipe", "rank=0,step=3", 1, marks=pytest.mark.variant),  # the first stage
    ("1f1b", "rank=2,step=4,at=backward", 3),   # the first stage, in backward (1F1B's steady state)
    ("gpipe", "rank=1,step=2,at=forward", 0),   # the last stage, in forward
    # zero bubble, two stages per rank in a V (rank 0 holds the first and the last): its
    # backward split into input and weight parts, rank 0 lost in it
    ("zbv", "rank=0,step=4,at=backward", 1),
])
def test_a_lost_stage_rank_is_replaced_in_place_bitwise_equal_to_torchrun(
        tmp_path: Path, reference: dict[str, dict[int, str]], schedule: str, failure: str, neighbour: int) -> None:
    code, log, finals = _run(tmp_path / "tmrun", "tmrun", schedule, "--inject-failure", failure)
    assert code == 0, log[-4000:]
    assert "1 in-place recoveries" in log and "group restart" not in log, log[-4000:]
    lost = int(failure.split(",")[0].split("=")[1])
    # healed from its own stage: the replica of the same stage is the only donor that sent
    assert f"rank {lost}: recovered" in log and "from 1 donor" in log, log[-4000:]
    # the joiner ran its pipeline's start-up alone, from the lost rank's recording; no survivor
    # (its neighbour included) ran it again
    assert re.search(rf"rank {lost}: the pipeline start-up of schedule 0 ran on this joiner alone \([1-9]\d* of the",
                     log), log[-4000:]
    assert "runs torch's start-up again" not in log, log[-4000:]
    assert neighbour != lost
    assert finals == reference[schedule], (finals, reference[schedule])
    # the standby rehearsed as rank 0 (the first stage) in its sandbox, its pipeline's start-up
    # fed with the messages rank 0 received in its first step, then ran again as the lost rank
    assert re.search(r"standby 0: its rehearsal's pipeline start-up received [1-9]\d* messages rank 0 received", log), \
        log[-4000:]
    assert re.search(r"standby 0 warm after 2 shadow steps \(\d+ collectives served locally, 0 bytes on the network",
                     log), log[-4000:]
    assert f"standby 0 runs the script again as rank {lost} after its rehearsal" in log, log[-4000:]


def _evaluations(work: Path) -> dict[tuple[int, int], set[str]]:
    """(rank, step) -> the evaluation losses the last stage's ranks logged for that step."""
    logged: dict[tuple[int, int], set[str]] = {}
    for rank in range(RANKS):
        path = work / f"eval-{rank}"
        for line in path.read_text().splitlines() if path.exists() else ():
            step, loss = line.split()
            logged.setdefault((rank, int(step)), set()).add(loss)
    return logged


@pytest.fixture(scope="module")
def eval_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int, int], tuple[dict[int, str], dict]]:
    """(eval_at, every, first) -> the torchrun run's final digests and evaluation losses
    (schedule.eval every ``every`` steps from step ``first``, at the step's start or end)."""
    root = tmp_path_factory.mktemp("pp-eval-reference")

    def compute(key: tuple[str, int, int]) -> tuple[dict[int, str], dict]:
        work = root / "-".join(map(str, key))
        code, log, finals = _run(work, "torchrun", "1f1b", script_args=_eval_args(work, *key))
        assert code == 0, log[-3000:]
        return finals, _evaluations(work)

    return _Lazy(compute)


def _eval_args(work: Path, eval_at: str, every: int = 2, first: int = 0) -> tuple[str, ...]:
    return ("--eval-every", str(every), "--eval-from", str(first), "--eval-at", eval_at,
            "--eval-log", str(work / "eval-{rank}"))


@pytest.mark.parametrize(("eval_at", "every", "first", "failure"), [
    ("start", 2, 0, "rank=1,step=4"),  # nanoGPT's shape: the redone step's first use of the schedule is eval()
    ("end", 2, 0, "rank=0,step=4,at=backward"),  # torchtitan's validator: survivors last started for evaluation
    # the job's first evaluation in the doomed step: no survivor ran an evaluation's start-up yet
    ("end", 3, 2, "rank=0,step=2,at=backward"),
])
def test_a_pipeline_that_evaluates_in_its_loop_is_replaced_in_place(
        tmp_path: Path, eval_reference: dict[tuple[str, int, int], tuple[dict[int, str], dict]], eval_at: str,
        every: int, first: int, failure: str) -> None:
    """schedule.eval() every few steps, before or after the step's training: torch 2.14 starts
    the stages again at each switch between eval() and step(). Before: a survivor's switch in the
    doomed step read its neighbour's metadata from zeros (EOFError): three ranks died and the job
    restarted from step 0; the joiner's first eval() ran a first start-up its peers did not; the
    standby's rehearsal failed (a later step's switch was not in rank 0's recording). Before
    2026-12-06, the job's first evaluation in a doomed step (no evaluation start-up seen yet) did
    the same to ranks 1 and 3; it now gets the training start-up's metadata. Now: in place, every
    rank's final digest and every evaluation loss equal to torchrun's."""
    work = tmp_path / "tmrun"
    code, log, finals = _run(work, "tmrun", "1f1b", "--inject-failure", failure,
                             script_args=_eval_args(work, eval_at, every, first))
    assert code == 0, log[-4000:]
    assert "1 in-place recoveries" in log and "group restart" not in log, log[-4000:]
    reference_finals, reference_evaluations = eval_reference[(eval_at, every, first)]
    assert finals == reference_finals, (finals, reference_finals)
    evaluations = _evaluations(work)
    assert evaluations.keys() == reference_evaluations.keys(), (evaluations, reference_evaluations)
    assert evaluations == reference_evaluations, (evaluations, reference_evaluations)  # redone: the same value
    assert re.search(r"standby 0 warm after 2 shadow steps \(\d+ collectives served locally, 0 bytes on the network",
                     log), log[-4000:]
    if eval_at == "start":  # the lost rank's start-ups (eval's, then training's) alone, then eval's switch
        assert "rank 1: the pipeline 2 start-ups of schedule 0 ran on this joiner alone" in log, log[-4000:]
        assert "runs torch's start-up again" not in log, log[-4000:]
    else:
        assert ("the pipeline of rank(s) [0] runs torch's start-up again at the next step, with the joiner (its P2P "
                "warm-up and shape inference: the schedules were last started for an evaluation)") in log, log[-4000:]


@pytest.mark.parametrize(("schedule", "seed"), [
    ("1f1b", 1),  # rank 1 (the last stage), 0.17 s after its fourth step
    pytest.param("gpipe", 0, marks=pytest.mark.variant),
    pytest.param("zbv", 2, marks=pytest.mark.variant),
    pytest.param("interleaved-1f1b", 3, marks=pytest.mark.variant),
])
def test_a_rank_killed_at_a_random_moment_is_replaced_in_place(
        tmp_path: Path, reference: dict[str, dict[int, str]], schedule: str, seed: int) -> None:
    """A random rank SIGKILLed by the test at a random moment of a random step (not at a drill's
    fixed point: in a P2P exchange, between a stage's forward and backward, in the commit vote,
    in the optimizer step): in place, every rank's final digest torchrun's (a longer campaign of
    such kills, by hand: docs/status.md)."""
    import random

    pick = random.Random(seed)
    rank, after, delay = pick.randrange(RANKS), pick.randrange(2, 5), pick.uniform(0.0, 0.2)
    work = tmp_path / "tmrun"
    killer = kill_after_steps(work / f"steps-{rank}", after, delay)  # steps of about 0.15 s here
    code, log, finals = _run(work, "tmrun", schedule, script_args=(
        "--step-log", str(work / "steps-{rank}"), "--step-time", "0.1"))  # a pause does not change the bits
    killer.join(timeout=10)
    assert code == 0, log[-4000:]
    assert "1 in-place recoveries" in log and "falling back" not in log and "restarted: epoch" not in log, log[-4000:]
    assert f"in-place replacement, generation 1: rank {rank}" in log, log[-4000:]
    assert finals == reference[schedule], (finals, reference[schedule])


def test_a_rank_lost_before_its_start_up_was_recorded_starts_its_pipeline_again(
        tmp_path: Path, reference: dict[str, dict[int, str]]) -> None:
    """Rank 3 (the last stage) left no recording of its pipeline's start-up (as a rank lost
    inside its first start-up; a test-only hook keeps it from publishing): its joiner cannot run
    the start-up alone, so its neighbour (rank 2) runs the start-up again with it, the other
    replica's pipeline goes on, and the bits are torchrun's."""
    code, log, finals = _run(tmp_path / "tmrun", "tmrun", "1f1b", "--inject-failure", "rank=3,step=4",
                             env={"TMRUN_TEST_PIPELINE_UNRECORDED": "3"})
    assert code == 0, log[-4000:]
    assert "1 in-place recoveries" in log and "group restart" not in log, log[-4000:]
    assert "rank 2: the pipeline of rank(s) [3] runs torch's start-up again" in log, log[-4000:]
    assert not any(f"rank {r}: the pipeline of" in log for r in (0, 1)), log[-4000:]
    assert "ran on this joiner alone" not in log, log[-4000:]
    assert finals == reference["1f1b"], (finals, reference["1f1b"])


def test_a_rank_lost_before_the_other_replicas_first_start_up_is_replaced_in_place(
        tmp_path: Path, reference: dict[str, dict[int, str]]) -> None:
    """Rank 0 killed in the job's first step (its backward) while the other replica has not
    started its pipeline yet (a delay drill keeps rank 2 5 s from its first forward; rank 3 waits
    for its metadata): their first start-up runs in the doomed step, its receives served locally
    with nothing of their own recorded. Before 2026-12-06: zeros, ranks 2 and 3 died (EOFError),
    the job restarted from step 0. Now each takes its replica's recording (rank 2 rank 0's, rank
    3 rank 1's: the same stages), the job is healed in place and the bits are torchrun's. The
    standby rehearses with the start-ups rank 0 published (it failed on zeros before: a cold
    standby)."""
    code, log, finals = _run(tmp_path / "tmrun", "tmrun", "1f1b", "--inject-failure", "rank=0,step=0,at=backward",
                             "--inject-failure", "rank=2,step=0,at=forward,delay=5")
    assert code == 0, log[-4000:]
    assert "rank 2 sleeps 5s at forward of step 0" in log, log[-4000:]
    assert "1 in-place recoveries" in log and "group restart" not in log, log[-4000:]
    for rank in (2, 3):
        assert re.search(rf"rank {rank}: its pipeline start-up of schedule 0 in a doomed step had nothing of its own "
                         r"recorded: [1-9]\d* receive\(s\) served from a replica's recording", log), log[-4000:]
    assert "Traceback" not in log, log[-4000:]  # no rank died
    # the standby's rehearsal had no recording of rank 0's first step: it took the start-ups rank 0 published
    assert "it rehearses with the pipeline start-ups rank 0 recorded before it" in log, log[-4000:]
    assert "standby 0 warm after 2 shadow steps" in log, log[-4000:]
    assert finals == reference["1f1b"], (finals, reference["1f1b"])


def _torchrun_finals(work: Path, nproc: int, args: list[str]) -> dict[int, str]:
    """Every rank's final digest of one run of ``args`` (with ``--final`` into ``work``) under
    plain torchrun on one node."""
    work.mkdir()
    code, log = run_job(torchrun_cmd("--standalone", "--nproc-per-node", str(nproc), *args,
                                     "--final", str(work / "final-{rank}")), work / "log", {}, JOB_TIMEOUT)
    assert code == 0, log[-4000:]
    return {r: (work / f"final-{r}").read_text().strip() for r in range(nproc)}


def test_a_planned_migration_of_a_stage_rank_recomputes_nothing(tmp_path: Path) -> None:
    """tm.migrate() by rank 1 (the last stage of the first replica) after step 8: the joiner is
    handed its state (not healed) and runs its pipeline's start-up alone from the leaver's
    recording; nothing is recomputed and the bits are torchrun's. 18 paced steps: a rehearsed
    standby is warm only after rank 0's first step, its rehearsal and two paced shadow steps
    (a request before then is refused: "no warm standby"), and the joiner must run steps after
    the switch."""
    steps = "18"
    work = tmp_path / "tmrun"
    work.mkdir()
    args = [str(SCRIPT), "--steps", steps, "--schedule", "1f1b"]
    reference = _torchrun_finals(tmp_path / "torchrun", RANKS, args)
    cmd = tmrun_cmd("--standalone", "--nproc-per-node", str(RANKS), "--standby", "1", "--console", "plain",
                    *args, "--final", str(work / "final-{rank}"),
                    "--migrate-at", "8", "--migrate-rank", "1", "--step-time", "1.0")
    code, log = run_job(cmd, work / "log", {"TMRUN_STATE_DIR": str(work / "state")}, JOB_TIMEOUT)
    assert code == 0, log[-4000:]
    assert "planned migration, generation 1: rank 1" in log, log[-4000:]
    assert "1 in-place recoveries (1 planned), 0 steps recomputed" in log, log[-4000:]
    resumed = re.search(r"rank 1: recovered into generation 1 in [\d.]+s; resume at step (\d+)", log)
    assert resumed and int(resumed.group(1)) < int(steps), log[-4000:]  # the joiner trained on
    assert "rank 1: the pipeline start-up of schedule 0 ran on this joiner alone" in log, log[-4000:]
    assert "runs torch's start-up again" not in log, log[-4000:]
    finals = {r: (work / f"final-{r}").read_text().strip() for r in range(RANKS)}
    assert finals == reference


@pytest.mark.variant  # by default: a joiner lost on one node and in HSDP (test_inplace_one_node, test_mesh)
def test_a_joiner_lost_during_the_recovery_is_replaced_too(tmp_path: Path,
                                                           reference: dict[str, dict[int, str]]) -> None:
    """Rank 1 (the last stage) killed at step 3's start, then its joiner killed as soon as it was
    promoted (before it built its groups and stage): the survivors give up that generation when
    the next is published, the second standby takes rank 1 and runs its pipeline's start-up alone,
    and the bits are torchrun's."""
    code, log, finals = _run(tmp_path / "tmrun", "tmrun", "1f1b", "--inject-failure", "rank=1,step=3",
                             "--inject-failure", "rank=1,who=joiner")
    assert code == 0, log[-4000:]
    assert "in-place replacement, generation 2: rank 1" in log, log[-4000:]
    assert "promoted to rank 1 (generation 2) in tmrun.init()" in log, log[-4000:]
    assert "rank 1: the pipeline start-up of schedule 0 ran on this joiner alone" in log, log[-4000:]
    assert "runs torch's start-up again" not in log, log[-4000:]
    assert "group restart" not in log and "Traceback" not in log, log[-4000:]
    assert finals == reference["1f1b"], (finals, reference["1f1b"])


def test_a_stage_lost_in_every_replica_falls_back_to_the_group_restart(
        tmp_path: Path, reference: dict[str, dict[int, str]]) -> None:
    """Ranks 1 and 3 hold the last stage in both replicas; both killed at step 2's start, nobody
    holds that stage any more: one line per survivor, the group restart at once (the script
    starts again from step 0; the drills do not fire again), torchrun's bits at the end."""
    # both standbys say they are warm 4 s after the ranks' first step (tests only): both losses
    # are in the first plan (as in tests/e2e/test_mesh.py's HSDP case)
    code, log, finals = _run(tmp_path / "tmrun", "tmrun", "1f1b", "--inject-failure", "rank=1,step=2",
                             "--inject-failure", "rank=3,step=2", "--standby", "2",
                             env={"TMRUN_TEST_STANDBY_DELAY": "0:4,1:4"})
    assert code == 0, log[-4000:]
    line = "no live replica holds the shard of ranks 1, 3"
    assert re.search(rf"rank [02]: {line}", log), log[-4000:]
    assert re.search(rf"{line} .*falling back to restarting the worker group", log), log[-4000:]
    assert "Traceback" not in log, log[-4000:]
    assert finals == reference["1f1b"], (finals, reference["1f1b"])


THREE_D = ROOT / "examples" / "train_3d.py"


def _three_d_args(inner: str, schedule: str, work: Path) -> list[str]:
    return [str(THREE_D), "--steps", "6", "--inner", inner, "--schedule", schedule, "--final", str(work / "final-{rank}")]


def _three_d_finals(work: Path) -> dict[int, str]:
    return {r: (work / f"final-{r}").read_text().strip() for r in range(8) if (work / f"final-{r}").exists()}


def _three_d_reference(root: Path, inner: str, schedule: str) -> dict[int, str]:
    """The 8 ranks' final digests of examples/train_3d.py under plain torchrun."""
    work = root / f"{inner}-{schedule}"
    got = _torchrun_finals(work, 8, _three_d_args(inner, schedule, work)[:-2])  # its own --final
    # replicas agree: "dp" is the outer dimension of the tp mesh, the middle one of the fsdp mesh
    twins = [(r, r + 4) for r in range(4)] if inner == "tp" else [(r, r + 2) for r in (0, 1, 4, 5)]
    assert len(got) == 8 and all(got[a] == got[b] for a, b in twins), got
    assert len(set(got.values())) == 4  # and the four (stage, inner shard) positions differ
    return got


@pytest.fixture(scope="module")
def three_d_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict[int, str]]:
    """(inner, schedule) -> :func:`_three_d_reference`, run on first use."""
    root = tmp_path_factory.mktemp("3d-reference")
    return _Lazy(lambda key: _three_d_reference(root, *key))


# tp-1f1b is a variant (CI time): by default DP x PP x TP is replaced in place, node by node,
# in test_a_lost_node_of_a_3d_job_is_replaced_by_a_standby_node
@pytest.mark.parametrize("inner, schedule, failure", [
    pytest.param("tp", "1f1b", "rank=5,step=3,at=backward", marks=pytest.mark.variant),
    ("fsdp", "gpipe", "rank=2,step=3,at=forward"),
    pytest.param("fsdp", "1f1b", "rank=5,step=3,at=backward", marks=pytest.mark.variant),
])
def test_3d_lost_rank_is_replaced_in_place_bitwise_equal_to_torchrun(
        tmp_path: Path, three_d_reference: dict[tuple[str, str], dict[int, str]], inner: str, schedule: str,
        failure: str) -> None:
    """examples/train_3d.py on 8 ranks. ``tp``: a (2, 2, 2) ("dp", "pp", "tp") mesh; rank 5 (dp 1,
    first stage, tp 1) killed in 1F1B's backward is healed from rank 1 (dp 0, the same stage and
    tp shard). ``fsdp`` (torchtitan's PP x HSDP shape): a ("pp", "dp", "shard") mesh, each stage
    fully_shard-ed on ("dp", "shard"); rank 2 (first stage, dp 1, shard 0) killed in GPipe's
    forward is healed from rank 0, rank 5 (last stage, dp 0, shard 1) killed in 1F1B's backward
    from rank 7. The joiner runs its pipeline's start-up alone (its stage's TP or FSDP
    collectives served locally), no other rank runs it again, every rank ends with torchrun's
    bits."""
    lost = int(re.match(r"rank=(\d+)", failure).group(1))
    work = tmp_path / "tmrun"
    work.mkdir()
    code, log = run_job(tmrun_cmd("--standalone", "--nproc-per-node", "8", "--standby", "1", "--console", "plain",
                                  "--inject-failure", failure, *_three_d_args(inner, schedule, work)),
                        work / "log", {"TMRUN_STATE_DIR": str(work / "state")}, JOB_TIMEOUT)
    assert code == 0, log[-4000:]
    assert "1 in-place recoveries" in log and "group restart" not in log, log[-4000:]
    assert re.search(rf"rank {lost}: recovered .*from 1 donor", log), log[-4000:]
    assert f"rank {lost}: the pipeline start-up of schedule 0 ran on this joiner alone" in log, log[-4000:]
    assert "runs torch's start-up again" not in log, log[-4000:]
    assert _three_d_finals(work) == three_d_reference[inner, schedule]
    # the standby rehearsed as rank 0 (the first stage, every inner index 0): nothing on the
    # network, the pipeline's start-up fed from rank 0's first step; its meshes replaced by the
    # lost rank's
    assert re.search(r"standby 0 warm after 2 shadow steps \(\d+ collectives served locally, 0 bytes on the network",
                     log), log[-4000:]
    assert re.search(r"standby 0: its rehearsal's pipeline start-up received [1-9]\d* messages", log), log[-4000:]
    assert re.search(rf"rank {lost}: \d+ device mesh\(es\) that torch's caches kept from the rehearsal replaced", log), \
        log[-4000:]


def _on_three_agents(work: Path, nproc: int, failure: str, script_args: list[str]) -> tuple[list[int], list[str]]:
    """The job over three agents on loopback (``--nnodes 2 --standby 1``: two active nodes of
    ``nproc`` ranks and a standby node), ``failure`` injected; their exit codes and logs."""
    return run_agents(work, 3, lambda port: tmrun_cmd(
        "--nnodes", "2", "--standby", "1", "--nproc-per-node", str(nproc),
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"nodes-{nproc}",
        "--rdzv-conf", "heartbeat_interval=0.5", "--inject-failure", failure, *script_args,
    ), {"OMP_NUM_THREADS": "1", "TMRUN_STATE_DIR": str(work / "state")}, JOB_TIMEOUT)  # fmt: skip


def test_a_lost_node_of_a_3d_job_is_replaced_by_a_standby_node(
        tmp_path: Path, three_d_reference: dict[tuple[str, str], dict[int, str]]) -> None:
    """examples/train_3d.py (DP x PP x TP) over three agents (``--nnodes 2 --standby 1
    --nproc-per-node 4``): node 0 runs ranks 0-3 (replica 0: both stages, both "tp" shards),
    node 1 ranks 4-7 (replica 1), node 2 stands by with four warm workers. Rank 6 is SIGKILLed
    at step 3's start: node 1 stops its other workers, the standby node's four take ranks 4-7 in
    one generation, each its own role (stage and "tp" shard), healed from its twin on node 0;
    node 0's ranks keep their processes; the bits are torchrun's on one node."""
    work = tmp_path / "nodes"
    work.mkdir()
    codes, logs = _on_three_agents(work, 4, "rank=6,step=3", _three_d_args("tp", "1f1b", work))
    text = "\n".join(logs)
    assert codes == [0, 0, 0], text[-8000:]
    assert "replace: generation 1: node 2 replaces node 1 at group rank 1 in place" in logs[0], logs[0]
    for rank in (4, 5, 6, 7):
        assert f"promoted to rank {rank} (generation 1) in tmrun.init()" in logs[2], logs[2]
        assert re.search(rf"rank {rank}: recovered into generation 1 .*from 1 donor", logs[2]), logs[2]
        assert f"rank {rank}: the pipeline start-up of schedule 0 ran on this joiner alone" in logs[2], logs[2]
    for rank in (0, 1, 2, 3):
        assert f"rank {rank}: recovered into generation 1" in logs[0], logs[0]
    assert "runs torch's start-up again" not in text, text[-8000:]  # node 0's pipelines went on
    assert "1 in-place recoveries" in logs[0] and "Traceback" not in text, text[-8000:]
    assert _three_d_finals(work) == three_d_reference["tp", "1f1b"]


@pytest.mark.variant  # by default: a drained node of an HSDP job (test_mesh), a lost node of a PP job (below)
def test_a_drained_node_of_a_pp_job_moves_to_the_standby_node(tmp_path: Path) -> None:
    """The PP job over three agents below, no failure: once the standby node's two workers are
    warm (rehearsed, waiting in ``tmrun.init()``), ``tmrun-ctl drain 1`` moves node 1 (the second
    replica's pipeline: ranks 2 and 3) to them at a step boundary; each joiner is handed its
    leaver's state and runs its pipeline's start-up alone; nothing is recomputed and the bits
    are torchrun's on one node."""
    work = tmp_path / "nodes"
    work.mkdir()
    args = [str(SCRIPT), "--steps", "12", "--schedule", "1f1b"]
    reference = _torchrun_finals(tmp_path / "torchrun", RANKS, args)
    codes, logs, requested = drained_on_three_agents(
        work, 2, "pp-drain", [*args, "--step-time", "1.0", "--final", str(work / "final-{rank}")],
        {"OMP_NUM_THREADS": "1", "TMRUN_STATE_DIR": str(work / "state")}, JOB_TIMEOUT)
    text = "\n".join(logs)
    assert requested and "draining node 1 (group rank 1)" in requested[0], (requested, text[-8000:])
    assert codes == [0, 0, 0], text[-8000:]
    assert "migrate: generation 1: node 2 replaces node 1 at group rank 1 in place" in logs[0], logs[0]
    assert "1 in-place recoveries (1 planned), 0 steps recomputed" in logs[0], logs[0]
    for rank in (2, 3):
        assert f"rank {rank}: the pipeline start-up of schedule 0 ran on this joiner alone" in logs[2], logs[2]
    assert "runs torch's start-up again" not in text and "Traceback" not in text, text[-8000:]
    finals = {r: (work / f"final-{r}").read_text().strip() for r in range(RANKS)}
    assert finals == reference


@pytest.mark.variant  # by default: a drained node of an HSDP job (test_mesh), a lost node of a 3-D job (above)
def test_a_drained_node_of_a_3d_job_moves_to_the_standby_node(tmp_path: Path) -> None:
    """examples/train_3d.py (DP x PP x TP) over three agents as above, no failure: once the
    standby node's four workers are warm, ``tmrun-ctl drain 1`` moves node 1 (replica 1: ranks
    4-7) to them at a step boundary, each its own role; nothing is recomputed and the bits are
    torchrun's on one node (the same steps, paced)."""
    work = tmp_path / "nodes"
    work.mkdir()
    args = _three_d_args("tp", "1f1b", work)
    args = [*args[:2], "12", *args[3:-2]]  # 12 steps, no --final
    reference = _torchrun_finals(tmp_path / "torchrun", 8, args)
    codes, logs, requested = drained_on_three_agents(
        work, 4, "3d-drain", [*args, "--step-time", "1.5", "--final", str(work / "final-{rank}")],
        {"OMP_NUM_THREADS": "1", "TMRUN_STATE_DIR": str(work / "state")}, 2 * JOB_TIMEOUT)
    text = "\n".join(logs)
    assert requested and "draining node 1 (group rank 1)" in requested[0], (requested, text[-8000:])
    assert codes == [0, 0, 0], text[-8000:]
    assert "migrate: generation 1: node 2 replaces node 1 at group rank 1 in place" in logs[0], logs[0]
    assert "1 in-place recoveries (1 planned), 0 steps recomputed" in logs[0], logs[0]
    assert "runs torch's start-up again" not in text and "Traceback" not in text, text[-8000:]
    assert _three_d_finals(work) == reference


@pytest.mark.variant  # CI time: the 3-D job's lost node (above, PP x TP x DP) takes the same path with more roles
def test_a_lost_node_of_a_pp_job_is_replaced_by_a_standby_node(tmp_path: Path,
                                                               reference: dict[str, dict[int, str]]) -> None:
    """Three agents (``--nnodes 2 --standby 1 --nproc-per-node 2``): node 0 runs ranks 0 and 1 (the
    first replica's pipeline: stages 0 and 1), node 1 ranks 2 and 3 (the second's), node 2 stands
    by. Rank 2 is SIGKILLed at step 3's start: node 1 stops both its workers, the standby node's
    two workers take ranks 2 and 3 in one generation, each healed from its stage's replica on
    node 0, and each runs its pipeline's start-up alone; node 0's ranks keep their processes and
    their pipeline; the bits are torchrun's on one node."""
    work = tmp_path / "nodes"
    work.mkdir()
    codes, logs = _on_three_agents(work, 2, "rank=2,step=3", [str(SCRIPT), "--steps", "8", "--schedule", "1f1b",
                                                            "--final", str(work / "final-{rank}")])
    text = "\n".join(logs)
    assert codes == [0, 0, 0], text[-8000:]
    assert "replace: generation 1: node 2 replaces node 1 at group rank 1 in place" in logs[0], logs[0]
    for rank in (2, 3):
        assert f"promoted to rank {rank} (generation 1) in tmrun.init()" in logs[2], logs[2]
        assert re.search(rf"rank {rank}: recovered into generation 1 .*from 1 donor", logs[2]), logs[2]
    assert "rank 0: recovered into generation 1" in logs[0], logs[0]
    assert "runs torch's start-up again" not in text, text[-8000:]  # node 0's pipeline went on
    for rank in (2, 3):
        assert f"rank {rank}: the pipeline start-up of schedule 0 ran on this joiner alone" in logs[2], logs[2]
    assert "1 in-place recoveries" in logs[0] and "Traceback" not in text, text[-8000:]
    finals = {r: (work / f"final-{r}").read_text().strip() for r in range(RANKS)}
    assert finals == reference["1f1b"], (finals, reference["1f1b"])
