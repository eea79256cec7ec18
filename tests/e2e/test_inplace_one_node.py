"""In-place replacement end to end on loopback: real tmrun agents, workers and standby workers.

Every drill ends with the job finishing, survivors keeping their PIDs, at most the step in
flight recomputed, and final parameters and optimizer state bitwise equal to a run with no
failure and the same seed.
"""

from __future__ import annotations

import json
import re
from functools import partial
from pathlib import Path

import pytest

from tests.helpers import EXAMPLES, ctl_when_logged, kill_tree, leftovers, run_job, start, tmrun_cmd

STEPS = 12
JOB_TIMEOUT = 240


def _run(tmp: Path, name: str, *tmrun_args: str, nproc: int = 2, standby: int = 1, steps: int = STEPS,
         step_time: float = 0.0, env: dict[str, str] | None = None, script_args: tuple[str, ...] = ()) -> tuple[int, str, str, dict[int, list[tuple[int, int]]]]:
    """Run the example under tmrun; returns (exit code, agent log, final digest, step logs)."""
    work = tmp / name
    work.mkdir()
    cmd = tmrun_cmd(
        "--standalone", "--nproc-per-node", str(nproc), "--standby", str(standby), *tmrun_args,
        str(EXAMPLES / "train_inplace.py"), "--steps", str(steps), "--width", "48", "--batch", "16",
        "--step-time", str(step_time), "--step-log", str(work / "steps-{rank}.log"), "--final", str(work / "final"),
        *script_args,
    )  # fmt: skip
    code, log = run_job(cmd, work / "agent.log", {"TMRUN_STATE_DIR": str(work / "state"), **(env or {})}, JOB_TIMEOUT)
    final = (work / "final").read_text().strip() if (work / "final").exists() else ""
    steps_by_rank: dict[int, list[tuple[int, int]]] = {}
    for rank in range(nproc):
        path = work / f"steps-{rank}.log"
        rows = [line.split() for line in path.read_text().splitlines()] if path.exists() else []
        steps_by_rank[rank] = [(int(r[0]), int(r[2])) for r in rows]
    return code, log, final, steps_by_rank


@pytest.fixture(scope="module")
def reference(one_node_reference: str) -> str:
    return one_node_reference  # tests/e2e/conftest.py: one run per session


def _check(code: int, log: str, final: str, steps: dict[int, list[tuple[int, int]]], reference: str,
           survivors: list[int], max_redone: int = 1) -> None:
    assert code == 0, log
    assert final == reference, "final state differs from the failure-free run\n" + log
    for rank in survivors:
        done = [s for s, _ in steps[rank]]
        assert sorted(set(done)) == list(range(STEPS)), (rank, done)
        assert len(done) - len(set(done)) <= max_redone, (rank, done)
        assert len({pid for _, pid in steps[rank]}) == 1, f"rank {rank} changed process"
    assert "in-place replacement" in log


# the default run keeps a kill at backward (read in the background) and in the optimizer step
@pytest.mark.parametrize("point,overlap", [pytest.param("step", "on", marks=pytest.mark.variant),
                                           pytest.param("forward", "off", marks=pytest.mark.variant),
                                           ("backward", "on"), ("optimizer", "off")])
def test_killed_rank_is_replaced_in_place(tmp_path: Path, reference: str, point: str, overlap: str) -> None:
    """Rank 1 SIGKILLed at four points of step 5; the standby takes its rank. The optimizer state
    is read in the background (TMRUN_HEAL_OVERLAP=on) or before the joiner resumes (off: what
    ``auto`` does where no core is idle, as on 2 cores)."""
    code, log, final, steps = _run(tmp_path, point, "--inject-failure", f"rank=1,step=5,at={point}",
                                   env={"TMRUN_HEAL_OVERLAP": overlap})
    _check(code, log, final, steps, reference, survivors=[0])
    assert "signal SIGKILL" in log
    # the standby warmed up in its sandbox: collectives served locally, nothing on the network
    assert re.search(r"standby 0 warm after 2 shadow steps \([1-9]\d* collectives served locally, 0 bytes on "
                     r"the network, tracked values finite\)", log), log
    assert "generation 1: all 2 ranks recovered" in log
    # the standby warmed up on a spare device (local rank 2: after the 2 active ranks') and keeps it
    assert "promoted to rank 1 (generation 1); LOCAL_RANK 2" in log, log
    if overlap == "on":  # deferred healing: the optimizer state arrived from rank 0's memory after it resumed
        assert re.search(r"rank 1: recovered into generation 1 .*memory [\d.]+ MB from 1 donor; the optimizer "
                         r"state follows in the background[;)]", log), log
        assert re.search(r"rank 1: the optimizer state arrived \(\d+ MB\) [\d.]+s after healing; waited [\d.]+s", log), log
    else:  # everything read out of rank 0's memory before the joiner resumed
        assert re.search(r"rank 1: recovered into generation 1 .*memory [\d.]+ MB from 1 donor; the optimizer "
                         r"state read before resuming: TMRUN_HEAL_OVERLAP=off[;)]", log), log
        assert "the optimizer state arrived" not in log, log
    # DDP's reducers are reset on every member or on none (a stopped backward), never on one alone
    lines = re.findall(r"rank [01]: recovered into generation 1 .*", log)
    assert len(lines) == 2 and len({"DDP reducers reset" in line for line in lines}) == 1, lines
    pids = {pid for _, pid in steps[1]}
    assert len(pids) == 2, "rank 1 should have been played by two processes"


@pytest.mark.parametrize("point", ["backward", pytest.param("optimizer", marks=pytest.mark.variant)])
def test_killed_rank_is_replaced_on_the_device_plane(tmp_path: Path, reference: str, point: str) -> None:
    """The device plane's life through the real runtime, on CPU: TMRUN_DEVICE_PLANE=gloo puts
    every collective of DDP on one gloo group per generation (what NCCL is on a GPU). Rank 1 dies
    in backward (inside the plane's allreduce) or in the optimizer step; the survivor aborts
    generation 0's group, and generation 1's is built afresh with the promoted standby."""
    env = {"TMRUN_DEVICE_PLANE": "gloo", "GLOO_SOCKET_IFNAME": "lo"}
    code, log, final, steps = _run(tmp_path, point, "--inject-failure", f"rank=1,step=5,at={point}", env=env)
    _check(code, log, final, steps, reference, survivors=[0])
    assert "device plane: CPU tensors on one gloo group per generation" in log
    assert "generation 1: all 2 ranks recovered" in log
    # the joiner was healed over the plane (device to device on a GPU), not through host copies
    assert re.search(r"rank 1: recovered into generation 1 .*healed \[1\], device [\d.]+ MB from 1 donor[;)]", log), log
    assert len({pid for _, pid in steps[1]}) == 2


def test_worker_that_raises_is_replaced(tmp_path: Path, reference: str) -> None:
    code, log, final, steps = _run(tmp_path, "raise", "--inject-failure", "rank=0,step=4,signal=RAISE")
    _check(code, log, final, steps, reference, survivors=[1])
    assert "InjectedFailure" in log, log
    # its exit code, or, where its exit (the interpreter's teardown after the traceback: over a
    # second on a loaded 2-core machine) took longer than the agent's wait after rank 1's
    # report, that report: the rank is fenced and replaced in place either way
    assert re.search(r"rank 0 \(pid \d+, exit code 1\)|rank 0 \(pid \d+\) lost by rank 1", log), log


def test_hung_rank_is_reported_by_survivors_and_fenced(tmp_path: Path, reference: str) -> None:
    """SIGSTOP: the rank's process lives but says nothing. Its peers lose it after the comm
    timeout, report it; the controller SIGKILLs it (fencing) and replaces it in place."""
    code, log, final, steps = _run(tmp_path, "hung", "--inject-failure", "rank=1,step=5,signal=STOP",
                                   env={"TMRUN_COMM_TIMEOUT": "1.5"})
    _check(code, log, final, steps, reference, survivors=[0])
    assert re.search(r"rank 1 \(pid \d+\) lost by rank 0; stopping it", log), log


def test_two_failures_with_one_standby(tmp_path: Path, reference: str) -> None:
    code, log, final, steps = _run(
        tmp_path, "two", "--inject-failure", "rank=1,step=2", "--inject-failure", "rank=0,step=9", step_time=0.3
    )
    assert code == 0, log
    assert final == reference
    assert len(re.findall(r"in-place replacement, generation \d", log)) == 2


def test_joiner_killed_during_promotion(tmp_path: Path, reference: str) -> None:
    code, log, final, steps = _run(
        tmp_path, "joiner", "--inject-failure", "rank=1,step=3", "--inject-failure", "rank=1,who=joiner"
    )
    _check(code, log, final, steps, reference, survivors=[0])
    assert len(re.findall(r"in-place replacement, generation \d", log)) == 2


def test_standby_killed_before_the_failure(tmp_path: Path, reference: str) -> None:
    """The standby dies while it waits (drill on the first standby via a timer is not possible,
    so the test kills it by PID as soon as it is warm); the pool starts another one in time."""
    import threading

    work_log = tmp_path / "standby" / "agent.log"
    killed: list[int] = []

    def kill_first_standby() -> None:
        import os
        import signal as sig
        import time

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not killed:
            text = work_log.read_text() if work_log.exists() else ""
            found = re.search(r"\[tmrun worker (\d+) [^\]]*\] standby 0 warm", text)
            if found:
                os.kill(int(found.group(1)), sig.SIGKILL)
                killed.append(int(found.group(1)))
            time.sleep(0.05)

    killer = threading.Thread(target=kill_first_standby, daemon=True)
    killer.start()
    # 1 s a step: the standby is warm (and killed) well before step 9's failure even on a loaded
    # 2-core machine (at 0.4 s it was once warm 0.1 s after the failure and became its joiner)
    code, log, final, steps = _run(tmp_path, "standby", "--inject-failure", "rank=1,step=9", step_time=1.0)
    killer.join(timeout=5)
    assert killed, log
    _check(code, log, final, steps, reference, survivors=[0])
    assert "standby worker 0 (pid" in log and "-> standby 1" in log


def test_donor_killed_during_state_transfer(tmp_path: Path, reference: str) -> None:
    code, log, final, steps = _run(
        tmp_path, "transfer", "--inject-failure", "rank=1,step=3", "--inject-failure", "rank=0,at=transfer",
        nproc=3,
    )
    assert code == 0, log
    assert len(re.findall(r"in-place replacement, generation \d", log)) == 2


MIGRATION_STEPS = 24


@pytest.fixture(scope="module")
def migration_reference(one_node_migration_reference: str) -> str:
    return one_node_migration_reference  # tests/e2e/conftest.py: one run per session


def _migrate_while_training(tmp_path: Path, name: str, *tmrun_args: str,
                            env: dict[str, str] | None = None) -> tuple[int, str, str, dict]:
    """Run the example with tmrun-ctl migrate 1 issued once the standby is warm."""
    import threading

    work = tmp_path / name
    requested: list[str] = []
    request = partial(ctl_when_logged, work / "agent.log", ["standby 0 warm"], ["migrate", "1", "--reason", "drill"],
                      work / "state", requested)
    thread = threading.Thread(target=request, daemon=True)
    thread.start()
    # paced so that the request (tmrun-ctl in its own process) lands well before the last step, even
    # on a loaded 2-core machine; the reference is not paced (pacing does not change the result)
    result = _run(tmp_path, name, *tmrun_args, steps=MIGRATION_STEPS, step_time=0.4, env=env)
    thread.join(timeout=5)
    assert requested and "migration of rank 1 requested" in requested[0], requested
    return result


@pytest.mark.parametrize("handover,path,overlap", [("auto", "memory", "on"),
                                                   pytest.param("auto", "memory", "off", marks=pytest.mark.variant),
                                                   pytest.param("socket", "socket", "on", marks=pytest.mark.variant)])
def test_planned_migration_recomputes_nothing(tmp_path: Path, migration_reference: str, handover: str,
                                              path: str, overlap: str) -> None:
    """tmrun-ctl migrate 1 while the job trains: the leaver hands its state to the standby at a
    step boundary and exits 0; no step is redone; the result equals a run without migration.
    On one host the joiner reads the leaver's memory; --handover socket sends it instead. The
    optimizer state follows in the background (TMRUN_HEAL_OVERLAP=on) or is read before the
    joiner resumes (off)."""
    code, log, final, by_rank = _migrate_while_training(tmp_path, "migrate", "--handover", handover,
                                                        env={"TMRUN_HEAL_OVERLAP": overlap})
    assert code == 0, log
    assert "planned migration, generation 1" in log and "previous process" in log
    assert re.search(r"rank 1: handed \d+ bytes to the joiner in [\d.]+s; leaving\n", log), log
    assert re.search(r"rank 1's previous process \(pid \d+\) left cleanly \(exit code 0\)", log), log
    rest = "follow in the background" if overlap == "on" else "read before resuming: TMRUN_HEAL_OVERLAP=off"
    assert re.search(rf"received the model \(\d+ bytes\) in [\d.]+s \({path}\); \d+ bytes of optimizer state "
                     rf"{rest}\n", log), log
    assert len(re.findall(r"rank 1: optimizer state complete \(\d+ bytes\)", log)) == 1, log
    # no backward was stopped and every reducer had rebuilt its buckets: DDP keeps them (no rebuild)
    assert len(re.findall(r"rank [01]: recovered into generation 1 ", log)) == 2, log
    assert "DDP reducers reset" not in log, log
    assert final == migration_reference
    for rank in (0, 1):
        done = [s for s, _ in by_rank[rank]]
        assert done == list(range(MIGRATION_STEPS)), (rank, done)  # nothing recomputed
    assert len({pid for _, pid in by_rank[0]}) == 1 and len({pid for _, pid in by_rank[1]}) == 2


def test_planned_migration_builds_the_device_communicator_before_the_switch(tmp_path: Path,
                                                                           migration_reference: str) -> None:
    """The two-phase switch on the device plane (gloo test mode on CPU): rank 0 and the joiner
    build generation 1's device group in the background while the leaver trains on, so the
    switch itself builds nothing; nothing is recomputed and the bits equal the run without it."""
    env = {"TMRUN_DEVICE_PLANE": "gloo", "GLOO_SOCKET_IFNAME": "lo"}
    code, log, final, by_rank = _migrate_while_training(tmp_path, "migrate-plane", env=env)
    assert code == 0, log
    assert re.search(r"rank 1: handed \d+ bytes to the joiner", log) and "left cleanly (exit code 0)" in log, log
    assert final == migration_reference
    ahead = re.findall(r"worker (\d+) [^\]]*\] device plane: generation 1's communicator built ahead of the switch", log)
    assert len(set(ahead)) == 2, log  # rank 0's process and the joiner's
    for rank in (0, 1):
        assert [s for s, _ in by_rank[rank]] == list(range(MIGRATION_STEPS)), rank


def test_leaver_killed_during_the_handover(tmp_path: Path, migration_reference: str) -> None:
    """The leaver dies once its joiner is connected, before it sent anything: the joiner takes
    the same committed state from rank 0 instead; nothing is lost or recomputed."""
    code, log, final, by_rank = _migrate_while_training(
        tmp_path, "leaverkill", "--inject-failure", "rank=1,at=handover")
    assert code == 0, log
    assert "handover failed" in log and "healing from the other ranks instead" in log, log
    assert re.search(r"rank 1's previous process \(pid \d+\) left with exit code -9", log), log
    assert final == migration_reference
    for rank in (0, 1):
        assert [s for s, _ in by_rank[rank]] == list(range(MIGRATION_STEPS)), rank
    assert len({pid for _, pid in by_rank[0]}) == 1


def test_migrate_without_a_job_is_a_clear_error(tmp_path: Path) -> None:
    import os
    import subprocess

    env = {**os.environ, "TMRUN_STATE_DIR": str(tmp_path / "none")}
    result = subprocess.run([*tmrun_cmd()[:2], "tmrun.cli.ctl", "migrate", "1"], capture_output=True, text=True,
                            timeout=60, env=env)
    assert result.returncode == 1 and "no running tmrun job" in result.stderr and "Traceback" not in result.stderr
    result = subprocess.run([*tmrun_cmd()[:2], "tmrun.cli.ctl", "migrate", "--", "-3"], capture_output=True,
                            text=True, timeout=60, env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    for args in ([], ["1", "--node", "1"], ["--node", "-1"]):  # neither, both, a negative node
        result = subprocess.run([*tmrun_cmd()[:2], "tmrun.cli.ctl", "migrate", *args], capture_output=True,
                                text=True, timeout=60, env=env)
        assert result.returncode == 2 and "Traceback" not in result.stderr, args
        assert ("rank or --node" in result.stderr) or ("--node must be 0 or more" in result.stderr), result.stderr


def test_api_script_runs_unchanged_under_torchrun(tmp_path: Path, reference: str) -> None:
    """Without a standby (plain torchrun) the worker API trains normally, with the same result."""
    from tests.helpers import free_port, torchrun_cmd

    cmd = torchrun_cmd(
        "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        str(EXAMPLES / "train_inplace.py"), "--steps", str(STEPS), "--width", "48", "--batch", "16",
        "--final", str(tmp_path / "final"),
    )  # fmt: skip
    proc = start(cmd, log=tmp_path / "torchrun.log")
    try:
        assert proc.wait(timeout=JOB_TIMEOUT) == 0, (tmp_path / "torchrun.log").read_text()
    finally:
        kill_tree(proc)
        assert leftovers(proc) == []
    assert (tmp_path / "final").read_text().strip() == reference


def test_cold_standby_warms_up_after_its_assignment(tmp_path: Path, reference: str) -> None:
    """--shadow-steps 0: the standby did no step before the failure; it runs DDP's first two
    iterations locally once assigned (DDP rebuilds its buckets with a collective in the second),
    then joins, and the result is still exact."""
    code, log, final, steps = _run(tmp_path, "cold", "--shadow-steps", "0", "--inject-failure", "rank=1,step=5")
    _check(code, log, final, steps, reference, survivors=[0])
    assert "assigned rank 1 cold: warming up first" in log


def test_no_warm_standby_falls_back_to_a_group_restart(tmp_path: Path, reference: str) -> None:
    """Rank 1 dies at step 0, long before the standby is warm (it runs all 12 steps in its
    sandbox at 0.3 s each first); with --standby-wait 0 tmrun says so and restarts the group as
    torchrun would; the drill does not fire again and the job finishes."""
    code, log, final, _ = _run(tmp_path, "fallback", "--standby-wait", "0", "--shadow-steps", "12",
                               "--inject-failure", "rank=1,step=0", step_time=0.3)
    assert code == 0, log
    assert "no standby ready within 0s: falling back to restarting the worker group" in log
    assert "Traceback" not in log, log  # the standby that was not needed leaves quietly (one line, or stopped)
    assert "1 group restart (counted above)" in log, log  # the fallback's restart, counted once
    assert final == reference


@pytest.mark.parametrize("standby", [pytest.param("no warm standby", marks=pytest.mark.variant), "no standby"])
def test_a_group_restart_counts_its_downtime_and_the_steps_it_recomputed(tmp_path: Path, standby: str) -> None:
    """Rank 1 dies at step 10 with no warm standby (its sandbox runs 40 steps first), or in a
    job without standbys (--standby 0: the drill fires in the first start only): the group
    restarts, and the script resumes from its checkpoint of step 7 (saved every 4 steps). The
    leader's restarted event counts steps 8 and 9 as recomputed (completed before the failure
    and again after), and the restart's downtime from the failure until step 10 completed; the
    totals include both. Before, such a restart printed '0 steps recomputed' and left its
    downtime out."""
    how = (("--standby-wait", "0", "--shadow-steps", "40") if standby == "no warm standby"
           else ("--max-restarts", "1"))
    code, log, _, steps = _run(tmp_path, "restart", *how, "--inject-failure", "rank=1,step=10", steps=14,
                               step_time=0.2, standby=1 if standby == "no warm standby" else 0,
                               script_args=("--checkpoint", str(tmp_path / "ckpt.pt"), "--checkpoint-every", "4"))
    assert code == 0, log
    done = [s for s, _ in steps[0]]
    # what the script itself did (rank 0's line of step 9 comes after its paced sleep: the group's
    # stop, right after rank 1's death at the start of step 10, may come first on a loaded machine)
    assert done in (list(range(10)) + list(range(8, 14)), list(range(9)) + list(range(8, 14))), done
    events = [json.loads(line) for path in (tmp_path / "restart" / "state").rglob("*.events.jsonl")
              for line in path.read_text().splitlines()]
    restarted = [e for e in events if e["kind"] == "restarted"]
    assert len(restarted) == 1, events
    event = restarted[0]
    assert (event["high_water"], event["resumed"], event["steps_recomputed"]) == (9, 8, 2), event
    failed_at = [e["time"] for e in events if e["kind"] == "failure"][0]
    back = event["marks"]["back"]
    assert event["marks"]["failed"] <= failed_at < back, event
    # "back" is when step 10, the first one not completed before the failure, completed on
    # every rank (estimated from records published about once a second): rank 0 logged it then
    logged = [float(line.split()[1]) for line in (tmp_path / "restart" / "steps-0.log").read_text().splitlines()
              if line.split()[0] == "10"]
    assert len(logged) == 1 and abs(back - logged[0]) < 0.8, (logged, event)  # a record up to 3 steps later
    assert event["seconds"] >= 2 * 0.2, event  # at least the two recomputed steps
    totals = re.search(r"recovery totals: downtime ([\d.]+)s over [\d.]+s, ETTR [\d.]+%, 0 in-place recoveries "
                       r"\(0 planned\), 2 steps recomputed, 1 group restart \(counted above\)", log)
    assert totals is not None, log
    assert abs(float(totals.group(1)) - event["seconds"]) < 0.002, (totals.group(0), event)


def test_joiner_killed_during_a_migration(tmp_path: Path, migration_reference: str) -> None:
    """tmrun-ctl migrate 1, and the migration's joiner SIGKILLed during its promotion: a failure
    during a planned change (docs/reliability.md). The leaver gives up its handover at once (the
    newer generation shows its joiner was lost) and leaves; rank 0, which lost the joiner in the
    switch's healing, recovers into the new generation, whose standby heals from it. Bitwise
    equal to a run without failure; rank 0 keeps its process; at most the step in flight redone.
    Before: rank 0 raised out of the switch and the leaver waited 60 s for the dead joiner's
    address; the job fell back to a group restart."""
    code, log, final, by_rank = _migrate_while_training(tmp_path, "joinerkill", "--inject-failure", "rank=1,who=joiner")
    assert code == 0, log
    assert final == migration_reference, log
    assert "falling back" not in log, log
    assert "nobody to hand over to: leaving" in log, log
    # rank 0 lost the joiner in the switch, or (the newer generation out before it got there)
    # skipped the switch: either way it recovers in place into generation 2
    assert ("lost a member during the migration's switch" in log
            or "rank 0: generation 2 superseded generation 1" in log), log
    assert re.search(r"in-place replacement, generation 2: rank 1 \(pid \d+, signal SIGKILL\)", log), log
    for rank in (0, 1):
        done = [s for s, _ in by_rank[rank]]
        assert sorted(set(done)) == list(range(MIGRATION_STEPS)), (rank, done)
        assert len(done) - len(set(done)) <= 1, (rank, done)
    assert len({pid for _, pid in by_rank[0]}) == 1, "rank 0 changed process"


@pytest.fixture(scope="module")
def batchnorm_reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The example with batch norm (``--batchnorm``) under plain torchrun, no failure."""
    from tests.helpers import free_port, torchrun_cmd

    work = tmp_path_factory.mktemp("batchnorm-torchrun")
    cmd = torchrun_cmd(
        "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        str(EXAMPLES / "train_inplace.py"), "--steps", str(STEPS), "--width", "48", "--batch", "16", "--batchnorm",
        "--final", str(work / "final"),
    )  # fmt: skip
    code, log = run_job(cmd, work / "torchrun.log", {}, JOB_TIMEOUT)
    assert code == 0, log
    return (work / "final").read_text().strip()


@pytest.mark.parametrize("point", [pytest.param("forward", marks=pytest.mark.variant), "backward"])
def test_batch_norm_statistics_of_an_aborted_step_are_put_back(tmp_path: Path, batchnorm_reference: str,
                                                              point: str) -> None:
    """A model with batch norm: the survivor's aborted forward moved the running statistics (in
    place, without the tensors' version counters); its redo moves them again. Without putting the
    step-start buffers back, the job ended "1 in-place recovery", exit 0, with other numbers than
    torchrun's (the replica check leaves buffers out)."""
    code, log, final, steps = _run(tmp_path, point, "--inject-failure", f"rank=1,step=4,at={point}",
                                   script_args=("--batchnorm",))
    _check(code, log, final, steps, batchnorm_reference, survivors=[0])
    assert "no collective synchronises" not in log, log  # DDP broadcasts its buffers: nothing is lost


@pytest.fixture(scope="module")
def scaler_schedule_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """torchrun's final lines (every rank) with a gradient scaler and an LR scheduler."""
    from tests.helpers import free_port, torchrun_cmd

    work = tmp_path_factory.mktemp("scaler-torchrun")
    code, log = run_job(torchrun_cmd(
        "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        str(EXAMPLES / "train_inplace.py"), "--steps", str(STEPS), "--width", "48", "--batch", "16",
        "--grad-scaler", "tracked", "--lr-schedule", "tracked", "--final", str(work / "final-{rank}"),
    ), work / "torchrun.log", {}, JOB_TIMEOUT)  # fmt: skip
    assert code == 0, log
    reference = {r: (work / f"final-{r}").read_text().strip() for r in (0, 1)}
    assert reference[0] == reference[1] and f" scale {2.0 ** (16 + STEPS // 2):g} lr " in reference[0], reference
    return reference


@pytest.mark.parametrize("tracking", ["tracked", "untracked"])
def test_a_gradient_scaler_and_an_lr_scheduler_are_handed_to_the_joiner(
        tmp_path: Path, scaler_schedule_reference: dict[int, str], tracking: str) -> None:
    """A torch.amp.GradScaler whose scale doubles every 2 steps and a StepLR (x0.9 a step),
    given to tm.track or (``untracked``) not: then tmrun tracks them for the script and rank 0
    says so in one line. Rank 1 killed in step 4's backward: the joiner receives the scale and
    the scheduler's epoch the survivors reached (fresh ones would start at 2**16 and the first
    learning rate), the aborted step's ``update()`` and scheduler step are undone on the
    survivor, and both ranks end with torchrun's parameters, optimizer state, scale and rate."""
    script_args = ("--grad-scaler", tracking, "--lr-schedule", tracking)
    reference = scaler_schedule_reference
    finals = str(tmp_path / tracking / "final-{rank}")
    code, log, _, steps = _run(tmp_path, tracking, "--inject-failure", "rank=1,step=4,at=backward",
                               script_args=(*script_args, "--final", finals))
    _check(code, log, reference[0], steps, reference[0], survivors=[0])
    assert {r: Path(finals.format(rank=r)).read_text().strip() for r in (0, 1)} == reference
    assert "not tracked" not in log, log
    adopted = re.findall(r"tracked for the script: (.*?): a joiner receives", log)
    if tracking == "tracked":
        assert adopted == [], log
    else:  # said once, by rank 0 (the joiner, rank 1, tracks them too and says nothing)
        assert adopted == ["'optimizer/lr_scheduler' (StepLR), 'tmrun/grad_scaler' (GradScaler)"], log


def test_buffers_kept_per_rank_are_flagged_when_their_rank_is_lost(tmp_path: Path) -> None:
    """DDP with broadcast_buffers=False: each rank's batch-norm statistics are its own, and the lost
    rank's go with its process. The joiner says so in one line (naming the buffers and its donor)
    rather than end with other numbers than a run without the failure, unflagged."""
    code, log, _, _ = _run(tmp_path, "per-rank", "--inject-failure", "rank=1,step=4,at=backward",
                           script_args=("--batchnorm", "--no-broadcast-buffers"))
    assert code == 0, log
    assert re.search(r"rank 1: the tracked modules keep buffers that no collective synchronises \('1\.running_mean', "
                     r"'1\.running_var', '1\.num_batches_tracked' and 3 more; .*continues from rank 0's",
                     log), log
