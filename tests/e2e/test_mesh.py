"""End to end: examples/train_hsdp.py (FSDP2 HSDP on a 2 x 2 ("replicate", "shard") mesh, a tiny
GPT, AdamW, an LR schedule and a data loader tracked) under tmrun with a standby, compared with
one run under plain torchrun (shared by the module):

* rank 1 SIGKILLed in forward, in backward, in the optimizer step: the standby (waiting in
  ``tmrun.init()``) builds the mesh and model as rank 1, joins the survivors' repaired groups and
  is healed from rank 3 (its shard's replica); every rank's final digest equals the reference,
  survivors keep their processes, at most the step in flight is redone;
* examples/train_dp_tp.py (tensor parallel over "tp" of a ("dp", "tp") mesh) with rank 1 killed
  in backward: the same, healed from its replica along "dp";
* both replicas of a shard (ranks 1 and 3) lost at once: every member says so in one line and
  the job falls back to the group restart at once, which ends with the reference's bits too;
* the same HSDP job over two nodes of two workers (three agents, one a standby node): node 1
  (one replica: ranks 2 and 3) fails and the standby node's two workers take both ranks in place,
  each healed from its shard's replica on node 0;
* a planned migration of rank 1 (tmrun-ctl migrate): the joiner, promoted in ``tmrun.init()``,
  builds its mesh and model while the leaver trains, and the leaver hands its shards over at the
  switch step; nothing is recomputed. The same after a failure in one run, and with the joiner
  killed before the switch (the survivors recover into the controller's newer generation).

(The steady state without a failure, bit for bit against gloo, the standby's sandbox building the
same mesh, and the backend's repair of every group: tests/comm/test_mesh_dist.py. Every test
here ends with every rank's digest equal to torchrun's failure-free run, so a separate run of
the example without a failure would add nothing but a job start.)"""

from __future__ import annotations

import re
import threading
from functools import partial
from pathlib import Path

import pytest

from tests.helpers import (EXAMPLES, ctl_when_logged, drained_on_three_agents, kill_after_steps, kill_tree,
                           kill_when, leftovers, run_agents, start, tmrun_cmd, torchrun_cmd)

pytestmark = pytest.mark.e2e

STEPS = 5
SCRIPT = [str(EXAMPLES / "train_hsdp.py"), "--steps", str(STEPS), "--layers", "1"]
DP_TP = [str(EXAMPLES / "train_dp_tp.py"), "--steps", str(STEPS), "--layers", "1"]
ENV = {"OMP_NUM_THREADS": "1"}


def _run(cmd: list[str], log: Path, expect_ok: bool = True, env: dict[str, str] | None = None) -> str:
    proc = start(cmd, log=log, env={**ENV, **(env or {})})
    try:
        code = proc.wait(timeout=240)
    finally:
        kill_tree(proc)
    text = log.read_text()
    if expect_ok:
        assert code == 0, text[-6000:]
    assert leftovers(proc) == []
    return text


def _finals(work: Path) -> list[str]:
    return [(work / f"final-{r}").read_text().strip() for r in range(4)]


def _tmrun(work: Path, *args: str, script: list[str] = SCRIPT, env: dict[str, str] | None = None) -> str:
    work.mkdir()
    return _run(tmrun_cmd("--standalone", "--nproc-per-node", "4", "--console", "plain", *args, *script,
                          "--final", str(work / "final-{rank}"), "--step-log", str(work / "steps-{rank}")),
                work / "agent.log", env=env)


def _steps(work: Path, rank: int) -> list[tuple[int, int]]:
    """(step, pid) of every step rank ``rank`` committed (the example logs a step once its optimizer stepped)."""
    path = work / f"steps-{rank}"
    rows = [line.split() for line in path.read_text().splitlines()] if path.exists() else []
    return [(int(r[0]), int(r[2])) for r in rows]


def _torchrun(tmp_path_factory: pytest.TempPathFactory, script: list[str]) -> list[str]:
    """Every rank's final digest of one run of ``script`` under plain torchrun (no failure)."""
    work = tmp_path_factory.mktemp("torchrun")
    _run(torchrun_cmd("--standalone", "--nproc-per-node", "4", *script, "--final", str(work / "final-{rank}")),
         work / "torchrun.log")
    finals = _finals(work)
    assert finals[0] == finals[2] and finals[1] == finals[3] and finals[0] != finals[1]  # replicas agree
    return finals


_REFERENCE_EVALS: list[tuple[int, str, str]] = []  # the reference run's evaluations after each update


def _evals(path: Path) -> list[tuple[int, str, str]]:
    """Rank 0's (step, loss, how) lines of train_hsdp.py's --eval-log."""
    lines = path.read_text().splitlines() if path.exists() else []
    return [(int(step), loss, how) for step, loss, how in (line.split() for line in lines)]


def _check_evals(got: list[tuple[int, str, str]], reference: list[tuple[int, str, str]], steps: int) -> None:
    """One evaluation line per step, each torchrun's value (run at its step's end or redone)."""
    truth = {s: loss for s, loss, _ in reference}
    assert sorted(s for s, _, _ in got) == list(range(steps)), got
    assert all(loss == truth[s] for s, loss, _ in got), (got, reference)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Every rank's final digest under torchrun, no failure (its evaluations after each update
    kept too: they change no state)."""
    evals = tmp_path_factory.mktemp("evals") / "eval"
    finals = _torchrun(tmp_path_factory, [*SCRIPT, "--eval-log", str(evals)])
    _REFERENCE_EVALS[:] = _evals(evals)
    assert [(s, how) for s, _, how in _REFERENCE_EVALS] == [(s, "end") for s in range(STEPS)], _REFERENCE_EVALS
    return finals


@pytest.fixture(scope="module")
def dp_tp_reference(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return _torchrun(tmp_path_factory, DP_TP)


def test_hsdp_evaluation_voided_after_the_update_is_redone_in_the_next_step(tmp_path: Path,
                                                                           reference: list[str]) -> None:
    """Rank 1 SIGKILLed inside step 2's optimizer step (after the commit vote): the survivors
    apply step 2, then their evaluation after the update (FSDP's all-gathers over "shard", an
    all-reduce of the loss) loses the peer: void, not written. Step 2 is not redone; before step
    3 trains, every rank, the joiner too, evaluates step 2's model again (tm.voided_step). The
    log has one line per step, each torchrun's value; every rank's final digest is torchrun's."""
    work = tmp_path / "eval"
    log = _tmrun(work, "--standby", "1", "--inject-failure", "rank=1,step=2,at=optimizer",
                 script=[*SCRIPT, "--eval-log", str(tmp_path / "eval-log")])
    assert _finals(work) == reference, log[-6000:]
    assert "in-place replacement, generation 1: rank 1" in log, log[-6000:]
    assert re.search(r"rank 0: step 2 committed and then lost a peer", log), log[-6000:]
    got = _evals(tmp_path / "eval-log")
    _check_evals(got, _REFERENCE_EVALS, STEPS)
    assert (2, "redo") in [(s, how) for s, _, how in got], got
    assert "Traceback" not in log, log[-6000:]


@pytest.mark.parametrize("point", [pytest.param("forward", marks=pytest.mark.variant), "backward",
                                   pytest.param("optimizer", marks=pytest.mark.variant)])
def test_hsdp_rank_killed_is_replaced_in_place(tmp_path: Path, reference: list[str], point: str) -> None:
    work = tmp_path / point
    log = _tmrun(work, "--standby", "1", "--inject-failure", f"rank=1,step=2,at={point}")
    assert _finals(work) == reference, log[-6000:]
    assert "in-place replacement, generation 1: rank 1" in log
    # the standby rehearsed as rank 0 in its sandbox (nothing on the network), then ran the
    # script again as rank 1 (another shard than rank 0's: the meshes torch's caches kept from
    # the rehearsal are replaced by this run's, or rank 1's replica diverges from rank 3's)
    assert re.search(r"standby 0 warm after 2 shadow steps \(\d+ collectives served locally, 0 bytes on the network, "
                     r"tracked values finite\)", log), log[-6000:]
    assert "standby 0 runs the script again as rank 1 after its rehearsal" in log, log[-6000:]
    assert re.search(r"rank 1: \d+ device mesh\(es\) that torch's caches kept from the rehearsal replaced by this run's",
                     log), log[-6000:]
    assert "promoted to rank 1 (generation 1) in tmrun.init()" in log  # built as rank 1
    assert re.search(r"rank 1: recovered into generation 1 .*memory [0-9.]+ MB from 1 donor", log), log[-6000:]
    assert "1 in-place recoveries" in log
    redone = int(re.search(r"(\d+) steps recomputed", log).group(1))  # type: ignore[union-attr]
    assert redone <= 1
    for rank in (0, 2, 3):  # survivors: one process each, every step committed at most once
        _check_committed(_steps(work, rank), processes=1, rank=rank)
    _check_committed(_steps(work, 1), processes=2, rank=1)  # its first process, then the promoted standby


def _check_committed(done: list[tuple[int, int]], processes: int, rank: int, failed: frozenset[int] = frozenset({2})) -> None:
    """``done``: (step, pid) of the steps a rank committed. Steps in order, none twice, every one
    but perhaps those of the failures (``failed``): a rank whose step the loss aborted may be healed to it by a rank
    that committed it (the optimizer point: the others may have stepped before they noticed)."""
    steps = [s for s, _ in done]
    assert steps == sorted(set(steps)), (rank, done)
    assert set(range(STEPS)) - failed <= set(steps), (rank, done)
    assert len({pid for _, pid in done}) == processes, (rank, done)


@pytest.mark.parametrize("seed", [11, pytest.param(12, marks=pytest.mark.variant), pytest.param(13, marks=pytest.mark.variant)])
def test_hsdp_rank_killed_at_a_random_moment_is_always_healed_in_place(tmp_path: Path, reference: list[str],
                                                                       seed: int) -> None:
    """Rank 3 SIGKILLed by the test at a random moment of a step (not at a drill's fixed point):
    before the commit vote, a kill after rank 3's reduce-scatter with rank 2 and before its
    replicate all-reduce with rank 1 let ranks 0 and 2 commit a step rank 1 could not, so the
    shard of ranks 1 and 3 had no holder at the agreed step and the job fell back to its group
    restart (about 1 kill in 9). With the vote every survivor skips that step alike: the job is
    healed in place, with torchrun's bits."""
    import random

    pick = random.Random(seed)
    work = tmp_path / f"seed{seed}"
    # steps of about 0.2 s here (0.1 s of it a sleep after the optimizer step): the kill lands
    # within steps 2 to 6 of 12, in compute or a collective about half the time
    delay = pick.uniform(0.0, 0.8)
    killer = kill_after_steps(work / "steps-3", 2, delay)
    log = _tmrun(work, "--standby", "1", script=[*SCRIPT[:2], str(RANDOM_STEPS), *SCRIPT[3:], "--step-time", "0.1",
                                                 "--eval-log", str(tmp_path / "eval-log")])
    killer.join(timeout=10)
    assert "falling back" not in log and "no live replica" not in log, log[-6000:]
    assert "in-place replacement, generation 1: rank 3" in log, log[-6000:]
    assert _finals(work) == _long_reference(tmp_path), log[-6000:]
    # the evaluation after each update (FSDP's all-gathers, an all-reduce): the kill may land in
    # it (the step committed, the evaluation void and redone in the next step): one line per step,
    # torchrun's value
    _check_evals(_evals(tmp_path / "eval-log"), _LONG_REFERENCE_EVALS, RANDOM_STEPS)


def test_hsdp_rank_lost_during_the_commit_vote_is_healed_in_place(tmp_path: Path, reference: list[str]) -> None:
    """The vote of step 2 reaches ranks 0 and 2 ("commit") but not rank 1, and rank 3 is lost:
    the outcome of a rank killed *during* the vote's all-reduce (TMRUN_TEST_LOSE_VOTE makes rank
    1's vote lose rank 3 after it went through; rank 3 dies at its optimizer step). Ranks 0 and 2
    apply step 2; rank 1, which held the only other copy of rank 3's shard, used to skip it, so
    that shard had no holder at step 2 and the job fell back to its group restart. Rank 1 now
    learns from the survivors' records that the step was committed and applies it too: healed
    in place, with torchrun's bits."""
    work = tmp_path / "vote"
    log = _tmrun(work, "--standby", "1", "--inject-failure", "rank=3,step=2,at=optimizer",
                 env={"TMRUN_TEST_LOSE_VOTE": "1:2:3"})
    assert "rank 1: the commit vote of step 2 lost a peer, and another survivor committed the step" in log, log[-6000:]
    assert "falling back" not in log and "no live replica" not in log, log[-6000:]
    assert "in-place replacement, generation 1: rank 3" in log, log[-6000:]
    assert _finals(work) == reference, log[-6000:]
    for rank in (0, 1, 2):  # every survivor committed step 2 once, in its own process
        _check_committed(_steps(work, rank), processes=1, rank=rank, failed=frozenset())


def test_hsdp_standby_imports_ahead_then_replaces_a_rank(tmp_path: Path, reference: list[str]) -> None:
    """The cold standby of a job with subgroups (``TMRUN_REHEARSAL=0``: no rehearsal), waiting in
    tmrun.init(), imports the modules rank 0 imported in its set-up and first steps
    (torch._dynamo through FSDP2's first fully_shard, DTensor's operators: about 0.6 s of a cold
    joiner's 0.8 s build here) before any failure; then a rank killed by the test is replaced in
    place, with torchrun's bits."""
    work = tmp_path / "warm"
    agent, steps = work / "agent.log", work / "steps-3"
    killer = kill_when(steps, lambda: agent.exists() and "in its first steps" in agent.read_text() and steps.exists())
    log = _tmrun(work, "--standby", "1", script=[*SCRIPT[:2], str(RANDOM_STEPS), *SCRIPT[3:], "--step-time", "0.3"],
                 env={"TMRUN_REHEARSAL": "0"})
    killer.join(timeout=10)
    assert "rehears" not in log, log[-6000:]
    imported = re.search(r"imported ahead (\d+) modules rank 0 imported in its set-up", log)
    assert imported and int(imported.group(1)) > 0, log[-6000:]
    assert "torch._dynamo" not in log  # nothing of it failed to import here
    assert log.index("in its first steps") < log.index("promoted to rank 3"), log[-6000:]
    assert "in-place replacement, generation 1: rank 3" in log, log[-6000:]
    assert _finals(work) == _long_reference(tmp_path), log[-6000:]


def _long_reference(tmp_path: Path) -> list[str]:
    """The RANDOM_STEPS-step run under torchrun (shared by the random-moment tests of one session)."""
    if not _LONG_REFERENCE:
        work = tmp_path.parent / f"torchrun-{RANDOM_STEPS}-steps"
        if not work.exists():
            work.mkdir()
            _run(torchrun_cmd("--standalone", "--nproc-per-node", "4", *SCRIPT[:2], str(RANDOM_STEPS), *SCRIPT[3:],
                              "--final", str(work / "final-{rank}"), "--eval-log", str(work / "eval")),
                 work / "torchrun.log")
        _LONG_REFERENCE.extend(_finals(work))
        _LONG_REFERENCE_EVALS[:] = _evals(work / "eval")
    return _LONG_REFERENCE


_LONG_REFERENCE: list[str] = []
_LONG_REFERENCE_EVALS: list[tuple[int, str, str]] = []  # its evaluations after each update (they change no state)
RANDOM_STEPS = 12


@pytest.mark.variant  # two failures in a row run by default on one node (test_inplace_one_node)
def test_hsdp_two_failures_one_after_the_other(tmp_path: Path, reference: list[str]) -> None:
    """Rank 1 killed in step 1's forward, then rank 2 in step 3's backward: two generations, the
    second standby (started when the first was promoted) waits in tmrun.init() too; rank 1's
    joiner is a survivor of the second change (its groups were joined, then repaired)."""
    work = tmp_path / "two"
    log = _tmrun(work, "--standby", "1", "--inject-failure", "rank=1,step=1,at=forward",
                 "--inject-failure", "rank=2,step=3,at=backward")
    assert _finals(work) == reference, log[-6000:]
    assert "promoted to rank 2 (generation 2) in tmrun.init()" in log
    assert re.search(r"rank 1: recovered into generation 2 .*healed \[2\]", log), log[-6000:]
    assert "2 in-place recoveries" in log
    for rank in (0, 3):
        _check_committed(_steps(work, rank), processes=1, rank=rank, failed=frozenset({1, 3}))


def test_hsdp_joiner_killed_before_it_rebuilt_its_groups(tmp_path: Path, reference: list[str]) -> None:
    """Rank 1 killed in step 2, then its joiner killed as soon as it joined the default group
    (the "promotion" drill: before it re-created the mesh's groups). The survivors, waiting for
    the joiner's address in rank 1's subgroups, give up that generation at once when the next one
    is published (no store timeout, no group restart); the second standby takes rank 1 in
    generation 2 and the job ends with torchrun's bits, survivors in their first processes."""
    work = tmp_path / "joiner"
    log = _tmrun(work, "--standby", "1", "--inject-failure", "rank=1,step=2",
                 "--inject-failure", "rank=1,who=joiner")
    assert _finals(work) == reference, log[-6000:]
    assert "in-place replacement, generation 2: rank 1" in log, log[-6000:]
    assert re.search(r"rank [03]: generation 2 superseded generation 1 while waiting for \S+/replace/", log), log[-6000:]
    assert "promoted to rank 1 (generation 2) in tmrun.init()" in log
    assert re.search(r"rank 1: recovered into generation 2 .*from 1 donor", log), log[-6000:]
    assert "group restart" not in log and "Traceback" not in log, log[-6000:]
    for rank in (0, 2, 3):
        _check_committed(_steps(work, rank), processes=1, rank=rank)


def test_hsdp_survivor_killed_while_the_joiner_builds_its_groups(tmp_path: Path, reference: list[str]) -> None:
    """Rank 1 killed in step 2; rank 0 (rank 1's shard group partner) killed once its default
    group took the joiner in, before it repaired rank 1's subgroups: the joiner is building its
    mesh and waits for rank 0's address in their shard group, which never comes. The joiner
    gives up as soon as generation 2 is published (not after the store's timeout: minutes,
    the survivors long gone) and leaves in one line; the remaining standbys take ranks 0 and 1
    (rank 2 heals rank 0's shard, rank 3 rank 1's), and the job ends with torchrun's bits in
    place, ranks 2 and 3 in their first processes."""
    work = tmp_path / "build"
    log = _tmrun(work, "--standby", "3", "--inject-failure", "rank=1,step=2",
                 "--inject-failure", "rank=0,at=subgroups")
    assert _finals(work) == reference, log[-8000:]
    assert re.search(r"joiner of rank 1: generation \d+ superseded generation 1 while waiting for .*, while the "
                     r"script built its groups \(a survivor was lost\); this joiner leaves", log), log[-8000:]
    assert "group restart" not in log and "Traceback" not in log, log[-8000:]
    for rank in (2, 3):
        _check_committed(_steps(work, rank), processes=1, rank=rank)


def test_every_replica_of_a_shard_lost_falls_back_to_the_group_restart(tmp_path: Path,
                                                                       reference: list[str]) -> None:
    """Ranks 1 and 3 hold the same shard (HSDP: replicas along "replicate"); both killed at the
    same step, nobody can heal their joiners: every member fails the healing with one line, and
    the controller falls back to the group restart at once (no waiting for standbys), which ends
    with the reference's bits (the script restarts from step 0; the drills do not fire again)."""
    work = tmp_path / "both"
    # both standbys say they are warm 4 s after the ranks' first step (tests only), long after the
    # kills: both losses are in the first plan (with a warm standby the first loss gets a plan of
    # its own, superseded by the second's, and the survivors wait out the first one's connect
    # timeout: the double-failure path of docs/reliability.md, not the case under test)
    log = _tmrun(work, "--standby", "2", "--inject-failure", "rank=1,step=2", "--inject-failure", "rank=3,step=2",
                 env={"TMRUN_TEST_STANDBY_DELAY": "0:4,1:4"})
    assert _finals(work) == reference, log[-6000:]
    line = "no live replica holds the shard of ranks 1, 3"
    assert re.search(rf"\[tmrun worker \d+ [0-9:.]+\] rank 0: {line}", log), log[-6000:]
    assert re.search(rf"failed and {line} .*falling back to restarting the worker group", log), log[-6000:]
    assert "in-place replacement, generation 1: rank 1 " in log and "generation 2" not in log  # one plan
    assert "waiting up to" not in log.split(line, 1)[1]  # the fallback did not wait for more standbys
    # an expected fallback: one line per worker, no traceback; the agent does not call the
    # script one that does not use the worker API
    assert "Traceback" not in log and "RecoveryError" not in log, log[-6000:]
    assert "does not use the tmrun worker API" not in log, log[-6000:]
    assert re.search(r"no in-place replacement: the node's in-place replacement gave up \(no live replica", log), \
        log[-6000:]


def test_a_failed_rehearsal_leaves_a_cold_standby_that_replaces_the_rank(tmp_path: Path, reference: list[str]) -> None:
    """The script raises in the standby's rehearsal (a test hook: its first shadow step): the
    standby says so in one line, runs the script again as a cold standby waiting in
    tmrun.init(), and replaces rank 3 in place, with torchrun's bits."""
    work = tmp_path / "failed"
    log = _tmrun(work, "--standby", "1", "--inject-failure", "rank=3,step=2,at=backward",
                 env={"TMRUN_TEST_REHEARSAL_RAISE": "1"})
    assert ("standby: the script's rehearsal failed (RuntimeError: test: the rehearsal raises); it waits for its "
            "rank cold instead (in tmrun.init())") in log, log[-6000:]
    assert log.index("rehearsal failed") < log.index("standby 0 warm in tmrun.init()"), log[-6000:]
    assert "in-place replacement, generation 1: rank 3" in log and "Traceback" not in log, log[-6000:]
    assert _finals(work) == reference, log[-6000:]


def test_dp_tp_rank_killed_is_replaced_in_place(tmp_path: Path, dp_tp_reference: list[str]) -> None:
    """examples/train_dp_tp.py: tensor parallel over "tp" (MLPs column / row split), gradients
    averaged over "dp" by hand. Rank 1 (dp 0, tp 1) SIGKILLed at the start of step 2's backward:
    its standby builds the mesh and the TP model as rank 1 and is healed from rank 3 (dp 1, tp 1);
    every rank's final digest equals torchrun's, survivors keep their processes."""
    work = tmp_path / "tp"
    log = _tmrun(work, "--standby", "1", "--inject-failure", "rank=1,step=2,at=backward", script=DP_TP)
    assert _finals(work) == dp_tp_reference, log[-6000:]
    assert re.search(r"standby 0 warm after 2 shadow steps \(\d+ collectives served locally, 0 bytes on the network",
                     log), log[-6000:]
    assert "standby 0 runs the script again as rank 1 after its rehearsal" in log, log[-6000:]
    assert "promoted to rank 1 (generation 1) in tmrun.init()" in log
    assert re.search(r"rank 1: recovered into generation 1 .*from 1 donor", log), log[-6000:]
    assert "1 in-place recoveries" in log
    for rank in (0, 2, 3):
        _check_committed(_steps(work, rank), processes=1, rank=rank)


def test_hsdp_over_nodes_a_failed_node_is_replaced_in_place(tmp_path: Path, reference: list[str]) -> None:
    """Three agents (``--nnodes 2 --standby 1 --nproc-per-node 2``): node 0 runs ranks 0 and 1
    (one replica: both shards), node 1 ranks 2 and 3 (the other), node 2 stands by. Rank 2 is
    SIGKILLed in step 2's backward: node 1 stops both its workers, the standby node's two workers
    (waiting in ``tmrun.init()``) take ranks 2 and 3 in one generation, each healed from its
    shard's replica on node 0 (ranks 0 and 1, which keep their processes); the final digests
    equal torchrun's on one node (the same ranks, the same mesh)."""
    work = tmp_path / "nodes"
    work.mkdir()
    codes, logs = run_agents(work, 3, lambda port: tmrun_cmd(
        "--nnodes", "2", "--standby", "1", "--nproc-per-node", "2",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "mesh-nodes",
        "--rdzv-conf", "heartbeat_interval=0.5", "--inject-failure", "rank=2,step=2,at=backward",
        *SCRIPT, "--final", str(work / "final-{rank}"), "--step-log", str(work / "steps-{rank}"),
    ), {**ENV, "TMRUN_STATE_DIR": str(work / "state")}, 200)  # fmt: skip
    text = "\n".join(logs)
    assert codes == [0, 0, 0], text[-8000:]
    assert _finals(work) == reference, text[-8000:]
    assert "replace: generation 1: node 2 replaces node 1 at group rank 1 in place (ranks 2->standby 2000, " \
           "3->standby 2001)" in logs[0], logs[0]
    for rank in (2, 3):
        assert f"promoted to rank {rank} (generation 1) in tmrun.init()" in logs[2], logs[2]
        assert re.search(rf"rank {rank}: recovered into generation 1 .*from 1 donor", logs[2]), logs[2]
    assert "1 in-place recoveries" in logs[0] and "Traceback" not in text, text[-8000:]
    redone = int(re.search(r"(\d+) steps recomputed", logs[0]).group(1))  # type: ignore[union-attr]
    assert redone <= 1
    for rank in (0, 1):  # node 0: the same processes throughout
        _check_committed(_steps(work, rank), processes=1, rank=rank)
    for rank in (2, 3):  # node 1's processes, then the standby node's
        _check_committed(_steps(work, rank), processes=2, rank=rank)


def test_hsdp_over_nodes_a_drained_node_moves_to_the_standby_node(tmp_path: Path) -> None:
    """The two-node HSDP job above with its standby node warm (its two workers rehearsed, then
    wait in ``tmrun.init()``): ``tmrun-ctl drain 1`` moves node 1 (ranks 2 and 3, one replica)
    to the standby node at a step boundary. Each joiner builds its mesh and model as its rank
    while node 1 trains on, node 1's workers hand their shards over at the switch and exit 0, its
    agent leaves; nothing is recomputed and every rank's final digest equals torchrun's (one
    node, the same ranks and mesh). It was refused ("the job has subgroups") until 2026-12-06."""
    work = tmp_path / "drain"
    work.mkdir()
    codes, logs, requested = drained_on_three_agents(
        work, 2, "mesh-drain", [*SCRIPT[:2], str(RANDOM_STEPS), *SCRIPT[3:], "--step-time", "1",
                                "--final", str(work / "final-{rank}"), "--step-log", str(work / "steps-{rank}")],
        {**ENV, "TMRUN_STATE_DIR": str(work / "state")}, 240)
    text = "\n".join(logs)
    assert requested and "draining node 1 (group rank 1)" in requested[0], (requested, text[-8000:])
    assert codes == [0, 0, 0], text[-8000:]
    assert re.search(r"migrate: generation 1: node 2 replaces node 1 at group rank 1 in place "
                     r"\(ranks 2->standby 2000, 3->standby 2001\): drain", logs[0]), text[-8000:]
    assert "this node leaves, the job goes on" in logs[1], logs[1]
    for rank in (2, 3):
        assert f"promoted to rank {rank} (generation 1) in tmrun.init()" in logs[2], logs[2]
        assert re.search(rf"rank {rank}: handed \d+ bytes to the joiner", logs[1]), logs[1]
    assert "refused" not in text and "Traceback" not in text, text[-8000:]
    assert _finals(work) == _long_reference(tmp_path), text[-8000:]
    for rank in range(4):  # nothing recomputed; node 1's ranks change process once
        done = _steps(work, rank)
        assert [s for s, _ in done] == list(range(RANDOM_STEPS)), (rank, done)
        assert len({pid for _, pid in done}) == (2 if rank >= 2 else 1), (rank, done)


def test_hsdp_planned_migration_recomputes_nothing(tmp_path: Path) -> None:
    """tmrun-ctl migrate 1 while the HSDP job trains: the standby (warm: it rehearsed, then runs
    the script again once assigned) is promoted for a planned generation; rank 1 trains on until
    the switch step, hands its local shards and optimizer state to the joiner (built as rank 1,
    joined to the default group and to both of rank 1's mesh groups) and exits 0; the groups
    without rank 1 are resynchronised; no step is redone and every rank's final digest equals
    torchrun's. RANDOM_STEPS paced steps: the rehearsal is warm after the ranks' first step, its
    build and two paced shadow steps, and the request must land well before the last step (with
    5 steps of 2 s the switch came at the last boundary under CI's load: the joiner ran none)."""
    work = tmp_path / "migrate"
    requested: list[str] = []
    request = partial(ctl_when_logged, work / "agent.log", ["standby 0 warm after 2 shadow steps"],
                      ["migrate", "1", "--reason", "drill"], work / "state", requested)
    thread = threading.Thread(target=request, daemon=True)
    thread.start()
    log = _tmrun(work, "--standby", "1", script=[*SCRIPT[:2], str(RANDOM_STEPS), *SCRIPT[3:], "--step-time", "1",
                                                 "--eval-log", str(tmp_path / "eval-log")],
                 env={"TMRUN_STATE_DIR": str(work / "state")})
    thread.join(timeout=5)
    assert requested and "migration of rank 1 requested" in requested[0], (requested, log[-6000:])
    assert _finals(work) == _long_reference(tmp_path), log[-6000:]
    # an evaluation after each update (the leaver's FSDP root unsharded by it at the switch): each
    # step's once, torchrun's value
    _check_evals(_evals(tmp_path / "eval-log"), _LONG_REFERENCE_EVALS, RANDOM_STEPS)
    assert "planned migration, generation 1: rank 1" in log, log[-6000:]
    assert "promoted to rank 1 (generation 1) in tmrun.init()" in log
    assert re.search(r"rank 1: received the model \(\d+ bytes\) in [\d.]+s \(memory\)", log), log[-6000:]
    assert re.search(r"rank 1's previous process \(pid \d+\) left cleanly \(exit code 0\)", log), log[-6000:]
    assert re.search(r"rank 1: handed \d+ bytes to the joiner", log), log[-6000:]
    assert "1 in-place recoveries (1 planned)" in log and "0 steps recomputed" in log, log[-6000:]
    assert "Traceback" not in log and "refused" not in log, log[-6000:]
    for rank in (0, 2, 3):  # survivors: one process each, every step committed exactly once
        _check_committed(_steps(work, rank), processes=1, rank=rank, failed=frozenset())
    done = _steps(work, 1)  # the leaver's steps, then the joiner's: each step once
    assert [s for s, _ in done] == list(range(RANDOM_STEPS)) and len({pid for _, pid in done}) == 2, done



@pytest.mark.variant  # by default: HSDP's failure and HSDP's planned migration, each on its own
def test_hsdp_failure_then_planned_migration(tmp_path: Path, reference: list[str]) -> None:
    """The example with an injected failure and a planned migration in one run (its docstring's
    command): rank 2 SIGKILLed in step 1's backward is replaced in place by one standby, then rank
    1 asks to be moved once it committed step 1 (``--migrate-at``: ``tm.migrate()``) and the other
    standby, warm after its rehearsal, takes it over at a step boundary (paced steps: the switch
    comes before the last step). Every rank's final digest equals
    torchrun's failure-free, migration-free run; only the failure's step may be redone."""
    work = tmp_path / "both"
    log = _tmrun(work, "--standby", "2", "--inject-failure", "rank=2,step=1,at=backward",
                 script=[*SCRIPT, "--migrate-at", "1", "--migrate-rank", "1", "--step-time", "1.5"])
    assert _finals(work) == reference, log[-6000:]
    assert "in-place replacement, generation 1: rank 2" in log, log[-6000:]
    assert "planned migration, generation 2: rank 1" in log, log[-6000:]
    assert re.search(r"rank 1's previous process \(pid \d+\) left cleanly \(exit code 0\)", log), log[-6000:]
    assert re.search(r"rank 1: handed \d+ bytes to the joiner", log), log[-6000:]
    assert "2 in-place recoveries (1 planned)" in log, log[-6000:]
    redone = int(re.search(r"(\d+) steps recomputed", log).group(1))  # type: ignore[union-attr]
    assert redone <= 1
    assert "Traceback" not in log and "refused" not in log, log[-6000:]
    for rank in (0, 3):  # survivors of both changes: one process each, every step committed once
        _check_committed(_steps(work, rank), processes=1, rank=rank, failed=frozenset({1}))
    _check_committed(_steps(work, 1), processes=2, rank=1, failed=frozenset({1}))  # the leaver, then its joiner
    _check_committed(_steps(work, 2), processes=2, rank=2, failed=frozenset({1}))  # killed, then its joiner


def _migrate_with_failure(work: Path, reference: list[str], standby: int, injection: str,
                          staying: tuple[int, ...]) -> str:
    """Rank 1 asks to be moved after step 1 (paced steps) while ``injection`` strikes: every
    rank's final digest equals torchrun's, the migration was planned, no group restart, no
    traceback, and the ``staying`` ranks kept their processes. Returns the log."""
    # cold standbys (no rehearsal): warm as soon as the ranks' first step started, before rank 1
    # asks after its step 1 (two rehearsing standbys, each running two paced shadow steps on this
    # 2-core machine beside 4 ranks, may not be: the request is then refused, "no warm standby");
    # migrations to a rehearsed standby: the two tests above
    log = _tmrun(work, "--standby", str(standby), "--inject-failure", injection,
                 script=[*SCRIPT, "--migrate-at", "1", "--migrate-rank", "1", "--step-time", "1.5"],
                 env={"TMRUN_REHEARSAL": "0"})
    assert _finals(work) == reference, log[-6000:]
    assert "planned migration, generation 1: rank 1" in log, log[-6000:]
    assert "falling back" not in log and "Traceback" not in log, log[-6000:]
    for rank in staying:
        assert len({pid for _, pid in _steps(work, rank)}) == 1, (rank, _steps(work, rank))
    return log


@pytest.mark.variant  # by default: a joiner lost in a DDP migration, and HSDP's survivor lost at the switch
def test_hsdp_joiner_killed_during_a_planned_migration(tmp_path: Path, reference: list[str]) -> None:
    """Rank 1 asks to be moved; its joiner (promoted in tmrun.init()) is SIGKILLed at once, while
    rank 1 still trains: the controller replaces it with the other standby in an unplanned
    generation. No survivor commits toward the dead joiner at the switch step: all recover into
    the newer generation (whose joiner is healed from rank 3), the leaver has nobody to hand
    over to and leaves. Every rank's final digest equals torchrun's; no group restart, no
    traceback, the survivors keep their processes. (The links prepared for the dead joiner end
    when the newer generation's links are prepared, not at their connect timeout: counted in
    tests/native/test_replacement.py.)"""
    log = _migrate_with_failure(tmp_path / "joinerkill", reference, 2, "rank=1,who=joiner", staying=(0, 2, 3))
    assert re.search(r"in-place replacement, generation 2: rank 1 \(pid \d+, signal SIGKILL\)", log), log[-6000:]
    # the survivors see the newer generation at the switch step, or (the joiner killed before
    # they got there) while waiting for its address in the default group: either way, in place
    assert re.search(r"rank [023]: generation 2 superseded generation 1 while waiting for", log), log[-6000:]
    assert "nobody to hand over to: leaving" in log, log[-6000:]


@pytest.mark.variant  # by default: a DDP leaver killed in its handover, and HSDP's planned migration
def test_hsdp_leaver_killed_during_the_handover(tmp_path: Path, reference: list[str]) -> None:
    """Rank 1 asks to be moved and is SIGKILLed once its joiner is connected, before it handed
    anything over: the joiner heals from rank 3 (its shard's replica) instead, in the planned
    generation; the groups are repaired as in any migration. Every rank's final digest equals
    torchrun's; no group restart, no traceback, the survivors keep their processes."""
    log = _migrate_with_failure(tmp_path / "leaverkill", reference, 1, "rank=1,at=handover", staying=(0, 2, 3))
    assert "the leaver's handover failed" in log and "healing from the other ranks instead" in log, log[-6000:]
    assert re.search(r"rank 1: recovered into generation 1 .*from 1 donor", log), log[-6000:]


def test_hsdp_survivor_killed_at_the_switch(tmp_path: Path, reference: list[str]) -> None:
    """Rank 1 asks to be moved; rank 2 (staying, a replica of rank 0's shard) is SIGKILLed once
    it prepared its links to the joiner, before the switch: the controller replaces it with the
    other standby in an unplanned generation, healed from rank 0, and cancels the migration
    (rank 1's process keeps its rank, the joiner is stopped). Every rank's final digest equals
    torchrun's; no group restart, no traceback, ranks 0, 1 and 3 keep their processes."""
    log = _migrate_with_failure(tmp_path / "survivorkill", reference, 2, "rank=2,at=switch", staying=(0, 1, 3))
    assert re.search(r"in-place replacement, generation 2: rank 2 \(pid \d+, signal SIGKILL\)", log), log[-6000:]
    assert re.search(r"generation 2: the migration of rank 1 \(generation 1\) had not switched: cancelled", log), log[-6000:]
    assert "generation 3" not in log, log[-6000:]  # one generation for the loss
