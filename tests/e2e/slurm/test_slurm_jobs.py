"""tmrun under a real SLURM (tests/e2e/slurm/cluster.py: munged, slurmctld and three slurmd on
loopback): jobs submitted with sbatch, steps started with srun, failures SLURM itself sees.

* the README's command on a one-node allocation (--standby 1: a standby worker process);
* three nodes, a standby node, no tmrun flag beyond --nproc-per-node and --standby: node ids and
  group ranks follow SLURM_NODEID, log lines name their node, the missing --no-kill is warned of;
  a worker killed on the store host's node: the store host keeps serving, the job finishes;
* a real node loss (slurmd, step daemon, agent and workers SIGKILLed) with the documented sbatch
  script: the standby node takes over in place, SLURM marks the node down and the job still
  completes;
* two concurrent steps of one allocation, each with its own store;
* scancel and a time limit: every node's stop line in the log, no traceback, no process left.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests.e2e.slurm.cluster import SlurmCluster
from tests.helpers import EXAMPLES, wait_until

TRAIN = str(EXAMPLES / "train_inplace.py")
SBATCH_SCRIPT = EXAMPLES / "slurm" / "train.sbatch"
JOB_TIMEOUT = 240


def _env() -> dict[str, str]:
    """sbatch exports this to the job: the tmrun of this Python first on PATH."""
    return {"PATH": f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}",
            "TMRUN_STATE_DIR": os.environ.get("TMRUN_STATE_DIR", "")} | {"OMP_NUM_THREADS": "1"}


def _batch(body: str, out: Path, *directives: str) -> str:
    lines = ["#!/bin/bash", f"#SBATCH -o {out}", *(f"#SBATCH {d}" for d in directives), body]
    return "\n".join(lines) + "\n"


def _submit(slurm: SlurmCluster, work: Path, script: str, extra_env: dict[str, str] | None = None) -> int:
    return slurm.sbatch(script, work, {**_env(), **(extra_env or {})})


def _tmrun_lines(log: str) -> str:
    """tmrun's own lines and SLURM's (not the example's per-step prints)."""
    return "\n".join(line for line in log.splitlines() if not line.startswith("[rank"))


def _check_clean(log: str) -> None:
    assert "Traceback" not in log, log
    assert "--- Logging error ---" not in log, log


def _finish(slurm: SlurmCluster, job_id: int, out: Path) -> tuple[str, str]:
    state = slurm.wait_job(job_id, JOB_TIMEOUT)
    assert wait_until(lambda: not slurm.job_processes(), 30), [p.pid for p in slurm.job_processes()]
    return state, out.read_text() if out.exists() else ""


def test_readme_command_on_one_node(slurm: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "job.out"
    body = ("srun -N1 -n1 tmrun --nproc-per-node 2 --standby 1 --inject-failure rank=1,step=6 "
            f"{TRAIN} --steps 12\necho step exit $?")
    job = _submit(slurm, tmp_path, _batch(body, out, "-N1"))
    state, log = _finish(slurm, job, out)
    text = _tmrun_lines(log)
    assert state == "COMPLETED", text
    assert "step exit 0" in log, text
    assert re.search(r"\[tmrun@n0 [\d:.]+\] in-place replacement, generation 1: rank 1 .* -> standby 0", text), text
    assert "recovery totals:" in text and "1 in-place recoveries" in text, text
    assert "tmrun: warning" not in text, text  # one node: SLURM's reaction to a node loss is moot
    _check_clean(log)


def test_three_nodes_no_other_flags_and_a_worker_killed_on_the_store_host(slurm: SlurmCluster, tmp_path: Path) -> None:
    """srun tmrun --nproc-per-node 1 --standby 1 on three nodes, nothing else: node ids and group
    ranks follow SLURM_NODEID, every line names its node, the missing --no-kill is warned of.
    Rank 0's worker, on the node that hosts the store, is killed: the standby node takes rank 0
    in place and the store host keeps serving the store until the job ends."""
    out = tmp_path / "job.out"
    body = (f"srun tmrun --nproc-per-node 1 --standby 1 --inject-failure rank=0,step=8 {TRAIN} "
            "--steps 20 --step-time 0.2\necho step exit $?")
    job = _submit(slurm, tmp_path, _batch(body, out, "-N3", "--ntasks-per-node=1"))
    state, log = _finish(slurm, job, out)
    text = _tmrun_lines(log)
    assert state == "COMPLETED" and "step exit 0" in log, text
    assert re.search(r"\[tmrun@n0 [\d:.]+\] node 0 runs group rank 0 of 2 in epoch 1", text), text
    assert re.search(r"\[tmrun@n1 [\d:.]+\] node 1 runs group rank 1 of 2 in epoch 1", text), text
    assert re.search(r"replace: generation 1: node 2 replaces node 0 at group rank 0 in place", text), text
    assert re.search(r"\[tmrun@n2 [\d:.]+\] this standby node now runs ranks \[0\] in place", text), text
    assert re.search(r"\[tmrun@n0 [\d:.]+\] .*serves the job's store until the job ends", text), text
    assert "recovered: generation 1: all 2 ranks back in" in text, text
    assert "closed: succeeded: workers finished" in text, text
    # the job lacks --no-kill, the step lacks --no-kill: said once each, on the first node
    assert text.count("tmrun: warning:") == 2, text
    assert "add `#SBATCH --no-kill`" in text and "`srun --no-kill ...`" in text, text
    assert "node_rank is only used" not in log and "tmrun: error" not in text, text
    _check_clean(log)


def _group_rank_node(text: str, rank: int) -> str:
    match = re.search(rf"\[tmrun@(n\d) [\d:.]+\] node \d runs group rank {rank} of", text)
    assert match, text
    return match.group(1)


def test_real_node_loss_with_the_documented_sbatch_script(slurm: SlurmCluster, tmp_path: Path) -> None:
    """slurmd, the step daemon, the agent and the workers of the node at group rank 1 SIGKILLed
    at once: tmrun's standby node takes over in place at once; SlurmdTimeout later SLURM marks the
    node down and, thanks to the script's --no-kill, the job trains to the end."""
    out = tmp_path / "job.out"
    script = SBATCH_SCRIPT.read_text().replace("#!/bin/bash\n", f"#!/bin/bash\n#SBATCH -o {out}\n", 1)
    job = slurm.sbatch(script, tmp_path, {**_env(), "NPROC": "1", "TRAIN": TRAIN},
                       args=["--steps", "100", "--step-time", "0.5"])
    assert wait_until(lambda: "warm after" in (out.read_text() if out.exists() else ""), 120), (
        out.read_text() if out.exists() else "no output")
    victim = _group_rank_node(out.read_text(), 1)
    slurm.lose_node(victim)
    assert wait_until(lambda: "DOWN" in slurm.node_state(victim), 60), slurm.node_state(victim)
    assert slurm.job_field(job, "JobState") == "RUNNING", out.read_text()
    state, log = _finish(slurm, job, out)
    text = _tmrun_lines(log)
    assert state == "COMPLETED", text
    assert "tmrun step exit code: 0" in log, text
    assert re.search(rf"lost: node {victim[1:]} \(active\)", text), text
    assert re.search(rf"replace: generation 1: node \d replaces node {victim[1:]} at group rank 1 in place", text), text
    assert "recovered: generation 1: all 2 ranks back in" in text, text
    assert "closed: succeeded: workers finished" in text, text
    assert "tmrun: warning" not in text, text  # the documented script sets everything


def test_store_host_lost_every_other_node_stops_with_one_line(slurm: SlurmCluster, tmp_path: Path) -> None:
    """The step's first node (the store's host) lost as a whole: every other agent says so in one
    `tmrun: error:` line and exits, with no traceback (surviving it is a store outside the job)."""
    out = tmp_path / "job.out"
    body = (f"srun --no-kill -o {tmp_path}/task-%t.out tmrun --nproc-per-node 1 --standby 1 {TRAIN} "
            "--steps 1000 --step-time 0.3")
    _submit(slurm, tmp_path, _batch(body, out, "-N3", "--ntasks-per-node=1", "--no-kill"))
    tasks = [tmp_path / f"task-{task}.out" for task in range(3)]
    assert wait_until(lambda: any("warm after" in t.read_text() for t in tasks if t.exists()), 150), out.read_text()
    slurm.lose_node("n0")
    said = "tmrun: error: lost the job's store at"
    assert wait_until(lambda: all(said in t.read_text() for t in tasks[1:]), 60), [t.read_text() for t in tasks[1:]]
    assert wait_until(lambda: not slurm.job_processes("n1") and not slurm.job_processes("n2"), 60), (
        [t.read_text() for t in tasks[1:]])
    for task in tasks[1:]:
        text = task.read_text()
        assert text.count("tmrun: error: lost the job's store at") == 1, text
        assert "Traceback" not in text and "frame #" not in text, text


def test_two_concurrent_steps_have_their_own_stores(slurm: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "job.out"
    step = (f"srun --overlap --no-kill -N2 --ntasks-per-node=1 tmrun --nproc-per-node 1 {TRAIN} --steps 25 "
            "--step-time 0.2")
    body = f"{step} > {tmp_path}/step-a.log 2>&1 &\n{step} > {tmp_path}/step-b.log 2>&1 &\nwait\necho both done"
    job = _submit(slurm, tmp_path, _batch(body, out, "-N2", "--ntasks-per-node=1", "--exclusive", "--no-kill"))
    state, log = _finish(slurm, job, out)
    logs = [(tmp_path / f"step-{name}.log").read_text() for name in "ab"]
    assert state == "COMPLETED" and "both done" in log, logs
    stores = set()
    for text in logs:
        match = re.search(r"rendezvous store at (\S+) \(run id (slurm-\d+\.\d+)\)", text)
        assert match, text
        stores.add(match.groups())
        assert "formed with 2 active" in text and "closed: succeeded: workers finished" in text, text
        _check_clean(text)
    assert len({s[0] for s in stores}) == 2 and len({s[1] for s in stores}) == 2, stores


def _stopped_cleanly(slurm: SlurmCluster, job: int, out: Path, reason: str) -> str:
    state, log = _finish(slurm, job, out)
    text = _tmrun_lines(log)
    assert reason in text, text
    for node in ("n0", "n1", "n2"):  # every agent says it stopped, the standby's included
        assert re.search(rf"\[tmrun@{node} [\d:.]+\] received SIGTERM", text), (node, text)
    _check_clean(log)
    return state


def test_scancel_and_time_limit_stop_every_node_cleanly(slurm: SlurmCluster, tmp_path: Path) -> None:
    """Two jobs side by side: one cancelled, one past its time limit (cut to zero once it runs:
    SLURM's next check ends it). Every agent's stop line is in the job log, no traceback, and no
    process of either job is left."""
    body = f"srun --no-kill tmrun --nproc-per-node 1 --standby 1 {TRAIN} --steps 1000 --step-time 0.3"
    outs = {name: tmp_path / f"{name}.out" for name in ("cancel", "timeout")}
    jobs = {name: _submit(slurm, tmp_path, _batch(body, out, "-N3", "--ntasks-per-node=1", "--no-kill", "-t 10"))
            for name, out in outs.items()}
    for out in outs.values():
        assert wait_until(lambda o=out: "warm after" in (o.read_text() if o.exists() else ""), 150), (
            out.read_text() if out.exists() else "no output")
    slurm.scontrol("update", f"JobId={jobs['timeout']}", "TimeLimit=0")
    slurm.scancel(jobs["cancel"])
    assert _stopped_cleanly(slurm, jobs["cancel"], outs["cancel"], "CANCELLED") == "CANCELLED"
    assert _stopped_cleanly(slurm, jobs["timeout"], outs["timeout"], "DUE TO TIME LIMIT") == "TIMEOUT"
    assert slurm.job_processes() == []


@pytest.fixture(autouse=True)
def _state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMRUN_STATE_DIR", str(tmp_path / "state"))
