"""tmrun under a real SLURM (tests/e2e/slurm/cluster.py: munged, slurmctld and nine slurmd on
loopback): jobs submitted with sbatch, steps started with srun, failures SLURM itself sees.

* the README's command on a one-node allocation (--standby 1: a standby worker process);
* three nodes, a standby node, no tmrun flag beyond --nproc-per-node and --standby: node ids and
  group ranks follow SLURM_NODEID, log lines name their node, the missing --no-kill is warned of;
  a worker killed on the store host's node: the store host keeps serving, the job finishes;
* a real node loss (slurmd, step daemon, agent and workers SIGKILLed) with the documented sbatch
  script: the standby node takes over in place, SLURM marks the node down and the job still
  completes;
* the store host lost: one line on every other node, no traceback;
* two concurrent steps of one allocation, each with its own store;
* scancel and a time limit: every node's stop line in the log, no traceback, no process left.

The two long scenarios (the node loss waits for SLURM to mark the node down; the time limit for
SLURM's periodic check) run in the background on node groups of their own from the start of the
module, while the others run one after another on a third group: the module takes about as long
as its longest scenario.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.slurm.cluster import SlurmCluster
from tests.helpers import EXAMPLES, wait_until

TRAIN = str(EXAMPLES / "train_inplace.py")
SBATCH_SCRIPT = EXAMPLES / "slurm" / "train.sbatch"
JOB_TIMEOUT = 240
LOSS = ("n0", "n1", "n2")  # the node loss (background)
STOP = ("n3", "n4", "n5")  # scancel and the time limit (background)
MAIN = ("n6", "n7", "n8")  # the others, one after another


def _env() -> dict[str, str]:
    """sbatch exports this to the job: the tmrun of this Python first on PATH."""
    return {"PATH": f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1"}


def _batch(body: str, out: Path, nodes: Sequence[str], *directives: str) -> str:
    lines = ["#!/bin/bash", f"#SBATCH -o {out}", f"#SBATCH -N{len(nodes)}", f"#SBATCH -w {','.join(nodes)}",
             *(f"#SBATCH {d}" for d in directives), body]
    return "\n".join(lines) + "\n"


def _tmrun_lines(log: str) -> str:
    """tmrun's own lines and SLURM's (not the example's per-step prints)."""
    return "\n".join(line for line in log.splitlines() if not line.startswith("[rank"))


def _check_clean(log: str) -> None:
    assert "Traceback" not in log, log
    assert "--- Logging error ---" not in log, log


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _finish(slurm: SlurmCluster, job_id: int, out: Path, nodes: Sequence[str]) -> tuple[str, str]:
    state = slurm.wait_job(job_id, JOB_TIMEOUT)
    gone = lambda: not any(slurm.job_processes(node) for node in nodes)  # noqa: E731
    assert wait_until(gone, 30), [(n, [p.pid for p in slurm.job_processes(n)]) for n in nodes]
    return state, _read(out)


def _processes(slurm: SlurmCluster, nodes: Sequence[str]) -> list[str]:
    """What still runs on these nodes (for a failure's message)."""
    found = []
    for node in nodes:
        for process in slurm.job_processes(node):
            try:
                found.append(f"{node} {process.pid} {process.status()} {' '.join(process.cmdline())[:120]}")
            except Exception:  # noqa: BLE001 - gone meanwhile
                continue
    return found


def _warm(out: Path, timeout: float = 150) -> None:
    assert wait_until(lambda: "warm after" in _read(out), timeout), _read(out) or f"no output in {out}"


class Background:
    """A scenario run on a thread from the start of the module; its test joins it."""

    def __init__(self, scenario: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(scenario,), daemon=True)
        self._thread.start()

    def _run(self, scenario: Callable[[], Any]) -> None:
        try:
            self.result = scenario()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc

    def wait(self, timeout: float = 2 * JOB_TIMEOUT) -> None:
        """Until the scenario ended (its own test reports how)."""
        self._thread.join(timeout)

    def join(self, timeout: float = 2 * JOB_TIMEOUT) -> Any:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the background scenario did not end"
        if self.error is not None:
            raise self.error
        return self.result


# -- the background scenarios ------------------------------------------------------------------


def _group_rank_node(text: str, rank: int) -> str:
    match = re.search(rf"\[tmrun@(n\d) [\d:.]+\] node \d runs group rank {rank} of", text)
    assert match, text
    return match.group(1)


def _node_loss(slurm: SlurmCluster, work: Path) -> dict[str, Any]:
    """slurmd, the step daemon, the agent and the workers of the node at group rank 1 SIGKILLed
    at once, with the documented sbatch script."""
    slurm.wait_idle(LOSS)
    out = work / "loss.out"
    script = SBATCH_SCRIPT.read_text().replace(
        "#!/bin/bash\n", f"#!/bin/bash\n#SBATCH -o {out}\n#SBATCH -w {','.join(LOSS)}\n", 1)
    job = slurm.sbatch(script, work, {**_env(), "NPROC": "1", "TRAIN": TRAIN},
                       args=["--steps", "90", "--step-time", "0.5"])
    try:
        _warm(out)
        victim = _group_rank_node(_read(out), 1)
        slurm.lose_node(victim)
        assert wait_until(lambda: "DOWN" in slurm.node_state(victim), 90), slurm.node_state(victim)
        running_when_down = slurm.job_field(job, "JobState")
        state, log = _finish(slurm, job, out, LOSS)
        return {"victim": victim, "running_when_down": running_when_down, "state": state, "log": log}
    finally:
        slurm.cancel([job])
        slurm.wait_idle(LOSS)


def _stopped(slurm: SlurmCluster, work: Path) -> dict[str, tuple[str, str]]:
    """Two jobs side by side: one cancelled, one past its time limit (cut to zero once it runs:
    SLURM's next check ends it)."""
    slurm.wait_idle(STOP)
    body = f"srun --no-kill tmrun --nproc-per-node 1 --standby 1 {TRAIN} --steps 1000 --step-time 0.3"
    outs = {name: work / f"{name}.out" for name in ("cancel", "timeout")}
    states = {name: work / f"state-{name}" for name in outs}  # each job's event log under its own
    jobs = {name: slurm.sbatch(_batch(body, out, STOP, "--ntasks-per-node=1", "--no-kill", "-t 10"), work,
                               {**_env(), "TMRUN_STATE_DIR": str(states[name])})
            for name, out in outs.items()}
    try:
        for out in outs.values():
            _warm(out)
        slurm.scontrol("update", f"JobId={jobs['timeout']}", "TimeLimit=0")
        slurm.scancel(jobs["cancel"])
        ended = {name: _finish(slurm, jobs[name], outs[name], STOP) for name in jobs}
        return {name: (*ended[name], [json.loads(line) for path in states[name].rglob("*.events.jsonl")
                                      for line in path.read_text().splitlines()])
                for name in jobs}
    finally:
        slurm.cancel(list(jobs.values()))


@pytest.fixture(scope="module")
def background(slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Background]]:
    runs = {"loss": Background(lambda: _node_loss(slurm_cluster, tmp_path_factory.mktemp("loss"))),
            "stop": Background(lambda: _stopped(slurm_cluster, tmp_path_factory.mktemp("stop")))}
    yield runs
    for run in runs.values():  # a test that failed early still waits for its scenario to end
        try:
            run.join()
        except BaseException:  # noqa: BLE001 - reported by its own test
            pass


@pytest.fixture(autouse=True)
def _start_background_first(background: dict[str, Background]) -> None:
    """Every test of the module starts the background scenarios (the first one actually does)."""


@pytest.fixture
def main_nodes(slurm: SlurmCluster) -> SlurmCluster:
    slurm.wait_idle(MAIN)
    return slurm


# -- the tests ---------------------------------------------------------------------------------


def test_readme_command_on_one_node(main_nodes: SlurmCluster, tmp_path: Path) -> None:
    slurm, out = main_nodes, tmp_path / "job.out"
    body = ("srun -N1 -n1 tmrun --nproc-per-node 2 --standby 1 --inject-failure rank=1,step=6 "
            f"{TRAIN} --steps 12\necho step exit $?")
    job = slurm.sbatch(_batch(body, out, MAIN[:1]), tmp_path, _env())
    state, log = _finish(slurm, job, out, MAIN)
    text = _tmrun_lines(log)
    assert state == "COMPLETED", text
    assert "step exit 0" in log, text
    assert re.search(rf"\[tmrun@{MAIN[0]} [\d:.]+\] in-place replacement, generation 1: rank 1 .* -> standby 0",
                     text), text
    assert "recovery totals:" in text and "1 in-place recoveries" in text, text
    assert "tmrun: warning" not in text, text  # one node: SLURM's reaction to a node loss is moot
    _check_clean(log)


def test_three_nodes_no_other_flags_and_a_worker_killed_on_the_store_host(main_nodes: SlurmCluster,
                                                                           tmp_path: Path) -> None:
    """srun tmrun --nproc-per-node 1 --standby 1 on three nodes, nothing else: node ids and group
    ranks follow SLURM_NODEID, every line names its node, the missing --no-kill is warned of.
    Rank 0's worker, on the node that hosts the store, is killed: the standby node takes rank 0
    in place and the store host keeps serving the store until the job ends."""
    slurm, out = main_nodes, tmp_path / "job.out"
    first, second, third = MAIN
    body = (f"srun tmrun --nproc-per-node 1 --standby 1 --inject-failure rank=0,step=8 {TRAIN} "
            "--steps 20 --step-time 0.2\necho step exit $?")
    job = slurm.sbatch(_batch(body, out, MAIN, "--ntasks-per-node=1"), tmp_path, _env())
    state, log = _finish(slurm, job, out, MAIN)
    text = _tmrun_lines(log)
    assert state == "COMPLETED" and "step exit 0" in log, text
    assert re.search(rf"\[tmrun@{first} [\d:.]+\] node 0 runs group rank 0 of 2 in epoch 1", text), text
    assert re.search(rf"\[tmrun@{second} [\d:.]+\] node 1 runs group rank 1 of 2 in epoch 1", text), text
    assert re.search(r"replace: generation 1: node 2 replaces node 0 at group rank 0 in place", text), text
    assert re.search(rf"\[tmrun@{third} [\d:.]+\] this standby node now runs ranks \[0\] in place", text), text
    assert re.search(rf"\[tmrun@{first} [\d:.]+\] .*serves the job's store until the job ends", text), text
    assert "recovered: generation 1: all 2 ranks back in" in text, text
    assert "closed: succeeded: workers finished" in text, text
    # the job lacks --no-kill, the step lacks --no-kill: said once each, on the first node
    assert text.count("tmrun: warning:") == 2, text
    assert "add `#SBATCH --no-kill`" in text and "`srun --no-kill ...`" in text, text
    assert "node_rank is only used" not in log and "tmrun: error" not in text, text
    _check_clean(log)


def test_two_concurrent_steps_have_their_own_stores(main_nodes: SlurmCluster, tmp_path: Path) -> None:
    slurm, out = main_nodes, tmp_path / "job.out"
    step = (f"srun --overlap --no-kill -N2 --ntasks-per-node=1 tmrun --nproc-per-node 1 {TRAIN} --steps 15 "
            "--step-time 0.2")
    body = f"{step} > {tmp_path}/step-a.log 2>&1 &\n{step} > {tmp_path}/step-b.log 2>&1 &\nwait\necho both done"
    job = slurm.sbatch(_batch(body, out, MAIN[:2], "--ntasks-per-node=1", "--exclusive", "--no-kill"), tmp_path,
                       _env())
    state, log = _finish(slurm, job, out, MAIN)
    logs = [_read(tmp_path / f"step-{name}.log") for name in "ab"]
    assert state == "COMPLETED" and "both done" in log, logs
    stores = set()
    for text in logs:
        match = re.search(r"rendezvous store at (\S+) \(run id (slurm-\d+\.\d+)\)", text)
        assert match, text
        stores.add(match.groups())
        assert "formed with 2 active" in text and "closed: succeeded: workers finished" in text, text
        _check_clean(text)
    assert len({s[0] for s in stores}) == 2 and len({s[1] for s in stores}) == 2, stores


def test_store_host_lost_every_other_node_stops_with_one_line(main_nodes: SlurmCluster, tmp_path: Path,
                                                             background: dict[str, Background]) -> None:
    """The step's first node (the store's host) lost as a whole: every other agent says so in one
    `tmrun: error:` line and exits, with no traceback (surviving it is a store outside the job).
    It runs once the background scenarios ended: they kill nodes and jobs too, at the moment
    their standbys turn warm, which is this test's moment as well; on this host (every slurmd on
    one machine) a kill by SLURM in one of them has been seen to take this job's other nodes
    down with it, with no line (2 of 4 runs on a loaded machine), which no real cluster does.
    The loss itself stops every process of the node before it kills any (SlurmCluster.lose_node):
    killed one by one, the batch step's daemon could see its script die and have slurmctld end
    the job everywhere at once (a CI run); and it kills children first: killed after its step
    daemon, a stopped srun was woken by the kernel (an orphaned process group) and ended the step
    on the other nodes with SIGKILL (two CI runs, reproduced in 2026-12-07's thirteenth session)."""
    for scenario in background.values():
        scenario.wait()
    slurm, out = main_nodes, tmp_path / "job.out"
    body = (f"srun --no-kill -o {tmp_path}/task-%t.out tmrun --nproc-per-node 1 --standby 1 {TRAIN} "
            "--steps 1000 --step-time 0.3")
    slurm.sbatch(_batch(body, out, MAIN, "--ntasks-per-node=1", "--no-kill"), tmp_path, _env())
    tasks = [tmp_path / f"task-{task}.out" for task in range(3)]
    assert wait_until(lambda: any("warm after" in _read(t) for t in tasks), 150), _read(out)
    slurm.lose_node(MAIN[0])
    said = "tmrun: error: lost the job's store at"
    others = MAIN[1:]
    assert wait_until(lambda: all(said in _read(t) for t in tasks[1:]), 60), (
        [_read(t) for t in tasks[1:]], _processes(slurm, others))
    assert wait_until(lambda: not any(slurm.job_processes(n) for n in others), 60), (
        [_read(t) for t in tasks[1:]], _processes(slurm, others))
    for task in tasks[1:]:
        text = task.read_text()
        assert text.count(said) == 1, text
        assert "Traceback" not in text and "frame #" not in text, text


def test_real_node_loss_with_the_documented_sbatch_script(background: dict[str, Background]) -> None:
    """tmrun's standby node takes over in place at once; SlurmdTimeout later SLURM marks the node
    down and, thanks to the script's --no-kill, the job trains to the end."""
    run = background["loss"].join()
    victim, text = run["victim"], _tmrun_lines(run["log"])
    assert run["running_when_down"] == "RUNNING", text
    assert run["state"] == "COMPLETED", text
    assert "tmrun step exit code: 0" in run["log"], text
    rank = LOSS.index(victim)
    assert re.search(rf"lost: node {rank} \(active\)", text), text
    assert re.search(rf"replace: generation 1: node \d replaces node {rank} at group rank 1 in place", text), text
    assert "recovered: generation 1: all 2 ranks back in" in text, text
    assert "closed: succeeded: workers finished" in text, text
    assert "tmrun: warning" not in text, text  # the documented script sets everything


def test_scancel_and_time_limit_stop_every_node_cleanly(background: dict[str, Background]) -> None:
    """Every agent's stop line is in the job log (the standby's too), no traceback, and no
    process of either job is left (checked when each job ended)."""
    results = background["stop"].join()
    for (name, reason, final) in (("cancel", "CANCELLED", "CANCELLED"), ("timeout", "DUE TO TIME LIMIT", "TIMEOUT")):
        state, log, events = results[name]
        text = _tmrun_lines(log)
        assert state == final, text
        assert reason in text, text
        for node in STOP:
            assert re.search(rf"\[tmrun@{node} [\d:.]+\] received SIGTERM", text), (name, node, text)
        assert "the job goes on" not in text, text  # the standby no longer says so as the job ends
        _check_clean(log)
        # the event log has every agent's stop line too (a "stop" event per node), and the end
        stops = [e for e in events if e["kind"] == "stop"]
        assert sorted(n for e in stops for n in e["nodes"]) == [0, 1, 2], (name, events)
        assert sum("while standing by; this standby leaves" in e["detail"] for e in stops) == 1, (name, stops)
        closed = [e for e in events if e["kind"] == "closed"]
        assert len(closed) == 1 and "received SIGTERM" in closed[0]["detail"], (name, events)
