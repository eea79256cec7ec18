"""tmrun-ctl against an operations endpoint on loopback (no whole job), and its import cost."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from datetime import timedelta
import os
from pathlib import Path

import pytest
from torch.distributed import PrefixStore, TCPStore
from typer.testing import CliRunner

from tmrun.cli.ctl import app
from tmrun.control.events import record_event
from tmrun.control.ops import OpsServer
from tmrun.launcher.runfile import write_runfile
from tmrun.protocol import keys
from tmrun.protocol.membership import Membership, Phase
from tmrun.protocol.messages import MigrateRequest, NodeInfo

RUN = "ctl-test"


@pytest.mark.e2e  # starts Python processes: not in the unit subset
def test_ctl_does_not_import_torch() -> None:
    """tmrun-ctl and everything it imports start without torch (nor tmrun modules that load it)."""
    code = ("import sys, tmrun.cli.ctl; from tmrun.cli.ctl import app; "
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'tmrun.comm', 'tmrun.worker'))); "
            "print(bad)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "tmrun.cli.ctl", "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "status" in result.stdout
    imported = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line]
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")]


@pytest.mark.e2e  # starts Python processes: not in the unit subset
def test_import_tmrun_still_registers_the_backend_when_torch_comes_later() -> None:
    code = ("import tmrun, sys, importlib.util; assert 'torch' not in sys.modules; "
            "assert importlib.util.find_spec('torch') is not None; "  # a library testing for torch
            "import torch.distributed as d; print(d.Backend.TMRUN)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "tmrun", result.stderr


@pytest.fixture()
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("TMRUN_STATE_DIR", str(tmp_path / "state"))
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    store = PrefixStore(keys.job_prefix(RUN), master)
    membership = Membership(epoch=1, phase=Phase.RUNNING, active=[0, 1], standby=[2], reason="formed")
    store.set(keys.STATE, membership.to_json())
    for node_id in range(3):
        store.add(keys.NODE_SEQ, 1)
        store.set(keys.node_order(node_id), str(node_id))
        store.set(keys.node_info(node_id), NodeInfo(host=f"h{node_id}", addr="", pid=100 + node_id).encode())
    record_event(store, "formed", 1, "formed with 2 active, 1 standby")
    ops = OpsServer(store, RUN, event_log=str(tmp_path / "events.jsonl"), request_timeout=0.5)
    address = ops.start("127.0.0.1")
    write_runfile(RUN, f"127.0.0.1:{master.port}", ops=address)
    yield store, address
    ops.stop()


def test_status_found_on_this_host(job) -> None:  # type: ignore[no-untyped-def]
    result = CliRunner().invoke(app, ["status"])
    assert result.exit_code == 0, result.output
    assert f"job {RUN}" in result.output and "running, epoch 1" in result.output and "ETTR" in result.output
    data = json.loads(CliRunner().invoke(app, ["status", "--json"]).output)
    assert [n["role"] for n in data["nodes"]] == ["active", "active", "standby"]
    assert data["totals"]["ettr"] == 1.0 and data["membership"]["phase"] == "running"


def test_events_json_and_endpoint(job) -> None:  # type: ignore[no-untyped-def]
    store, address = job
    record_event(store, "replace", 1, "rank 1 (pid 5, killed by SIGKILL) -> standby 0 (pid 7)")
    result = CliRunner().invoke(app, ["events", "--json", "--endpoint", address])
    rows = [json.loads(line) for line in result.output.splitlines()]
    assert [r["kind"] for r in rows] == ["formed", "replace"] and rows[1]["ranks"] == [1]
    text = CliRunner().invoke(app, ["events", "--since", "1"]).output
    assert "epoch 1 replace: rank 1" in text and "formed" not in text


@pytest.mark.e2e  # over half a second: waits out a timeout (the unit subset stays within a minute)
def test_events_follow_stops_at_the_end_of_the_job(job) -> None:  # type: ignore[no-untyped-def]
    store, _ = job
    threading.Timer(0.7, lambda: record_event(store, "closed", 1, "succeeded: workers finished")).start()
    started = time.monotonic()
    result = CliRunner().invoke(app, ["events", "--follow"])
    assert result.exit_code == 0 and "closed: succeeded" in result.output
    assert time.monotonic() - started < 10


def test_migrate_writes_the_request(job) -> None:  # type: ignore[no-untyped-def]
    store, _ = job
    result = CliRunner().invoke(app, ["migrate", "1", "--reason", "slow GPU", "--run-id", RUN])
    assert result.exit_code == 0 and "migration of rank 1 requested (request 0)" in result.output
    assert MigrateRequest.decode("m", store.get(keys.migrate_request(0))) == MigrateRequest(1, "slow GPU")


def _first_migrate_request(store) -> MigrateRequest:  # type: ignore[no-untyped-def]
    """The first migration request tmrun-ctl writes (waited for up to 10 s)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not store.check([keys.migrate_request(0)]):
        time.sleep(0.05)
    return MigrateRequest.decode("m", store.get(keys.migrate_request(0)))


def test_drain_reports_when_the_agent_left(job) -> None:  # type: ignore[no-untyped-def]
    store, _ = job

    def leader() -> None:  # plays the leader: moves the node, then its agent leaves
        request = _first_migrate_request(store)
        record_event(store, "migrate", 1, f"generation 1: node 2 took group rank 1 of node 1: {request.reason}")
        record_event(store, "recovered", 1, "generation 1: all 4 ranks back in 0.500s")
        record_event(store, "left", 1, "node 1 (retired): its agent left", nodes=[1])

    thread = threading.Thread(target=leader, daemon=True)
    thread.start()
    result = CliRunner().invoke(app, ["drain", "1", "--wait", "20"])
    thread.join(timeout=5)
    assert result.exit_code == 0, result.output
    assert "draining node 1 (group rank 1)" in result.output and "node 1 drained: its agent left" in result.output


def test_drain_refused(job) -> None:  # type: ignore[no-untyped-def]
    store, _ = job
    threading.Timer(0.5, lambda: record_event(store, "migrate-refused", 1,
                                              "node at group rank 0: no warm standby node")).start()
    result = CliRunner().invoke(app, ["drain", "0", "--wait", "20"])
    assert result.exit_code == 1 and "refused" in result.output


@pytest.mark.parametrize(
    "args,code,message",
    [
        (["status", "--endpoint", "nonsense"], 1, "malformed operations endpoint"),
        (["status", "--endpoint", "127.0.0.1:1"], 1, "no tmrun job answers"),
        (["status", "--run-id", "other"], 1, "no running tmrun job with run id 'other'"),
        (["status", "--timeout", "0"], 2, "--timeout"),
        (["events", "--since", "-1"], 2, "--since"),
        (["drain", "--", "-1"], 2, "0 or more"),
        (["drain", "5"], 1, "no node at group rank 5"),
        (["migrate"], 2, "rank or --node"),
        (["migrate", "1", "--node", "1"], 2, "rank or --node"),
        (["plan", "--gpus", "64"], 2, "--node-mttf-hours"),
        (["plan", "--gpus", "12", "--node-mttf-hours", "100", "--recovery-seconds", "5"], 2, "multiple"),
    ],
)
def test_bad_input_is_one_line(job, args: list[str], code: int, message: str) -> None:  # type: ignore[no-untyped-def]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == code, result.output
    assert message in result.output and "Traceback" not in result.output
    assert len([line for line in result.output.splitlines() if line.strip()]) == 1, result.output


def test_plan(job) -> None:  # type: ignore[no-untyped-def]
    result = CliRunner().invoke(app, ["plan", "--gpus", "65536", "--job-mttf-minutes", "27.02",
                                      "--recovery-seconds", "20", "--json"])
    data = json.loads(result.output)
    assert round(data["restart_only"]["loss"] * 100, 2) == 16.47 and data["best"]["standby"] > 0
    text = CliRunner().invoke(app, ["plan", "--gpus", "65536", "--job-mttf-minutes", "27.02",
                                    "--recovery-seconds", "20"]).output
    assert "ETTR 83.53%" in text and "standbys that pay for themselves" in text
    measured = CliRunner().invoke(app, ["plan", "--gpus", "64", "--node-mttf-hours", "100"])
    assert measured.exit_code == 2 and "no measured recovery yet" in measured.output


def test_found_from_the_slurm_allocation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No run file on this host, inside the job's allocation: the leader's endpoint is on the
    first node at 30400 + job id mod 1000 (when that port was free for the leader)."""
    monkeypatch.setenv("TMRUN_STATE_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("SLURM_JOB_ID", "77123")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "127.0.0.1")
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    store = PrefixStore(keys.job_prefix("slurm-77123.0"), master)
    store.set(keys.STATE, Membership(epoch=1, phase=Phase.RUNNING, active=[0]).to_json())
    ops = OpsServer(store, "slurm-77123.0", port=30400 + 123)
    try:
        if ops.port != 30400 + 123:
            pytest.skip("port 30523 is taken on this machine")
        ops.start("127.0.0.1")
        result = CliRunner().invoke(app, ["status", "--json"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.output)["run_id"] == "slurm-77123.0"
    finally:
        ops.stop()


def test_drain_when_the_job_ends_first(job) -> None:  # type: ignore[no-untyped-def]
    store, _ = job

    def leader() -> None:
        request = _first_migrate_request(store)
        record_event(store, "migrate", 1, f"generation 1: node 2 replaces node 1: {request.reason}")
        record_event(store, "closed", 1, "succeeded: workers finished")

    threading.Thread(target=leader, daemon=True).start()
    result = CliRunner().invoke(app, ["drain", "1", "--wait", "20"])
    assert result.exit_code == 0 and "node 1 drained: the job ended" in result.output, result.output


@pytest.mark.e2e  # starts Python processes: not in the unit subset
def test_usage_mistakes_are_one_line(tmp_path: Path) -> None:
    """typer's own usage errors (an unknown option, a value of the wrong type, an unknown
    command) are one line and exit code 2 too, not a box."""
    env = {"TMRUN_STATE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    for args, needle in ((["status", "--bogus"], "No such option"), (["migrate", "abc"], "Invalid value"),
                         (["reboot"], "No such command")):
        result = subprocess.run([sys.executable, "-m", "tmrun.cli.ctl", *args], capture_output=True, text=True,
                                timeout=60, env=env)
        lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
        assert result.returncode == 2 and len(lines) == 1 and needle in lines[0], (args, lines)
        assert lines[0].startswith("tmrun: error: ")


def test_located_in_a_slurm_allocation_by_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No job on this host, inside a SLURM allocation: the leader's endpoint is on the first node,
    at the port of the step the run id names (step 0 by default)."""
    from tmrun.cli.ctl import _locate

    monkeypatch.setenv("TMRUN_STATE_DIR", str(tmp_path / "empty"))
    for key in [k for k in os.environ if k.startswith("SLURM")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "localhost")
    assert _locate(None, None)[0] == ("localhost", 30400 + 242)
    assert _locate("slurm-4242.1", None)[0] == ("localhost", 30400 + (4242 + 101) % 1000)


# ---- exactly one job (issue 31) ----------------------------------------------------------------
def _second_job(run_id: str, token: str | None = None):  # type: ignore[no-untyped-def]
    """Another job's leader on this host: its store, operations endpoint and run file."""
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    store = PrefixStore(keys.job_prefix(run_id), master)
    store.set(keys.STATE, Membership(epoch=1, phase=Phase.RUNNING, active=[0], reason="formed").to_json())
    ops = OpsServer(store, run_id, request_timeout=0.5, token=token)
    address = ops.start("127.0.0.1")
    write_runfile(run_id, f"127.0.0.1:{master.port}", ops=address, token=token)
    return store, ops, address


def test_two_jobs_on_the_host_are_listed_and_never_guessed(job, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Two jobs on one host and no --run-id: every command refuses in one line that lists both
    (a script that took the newest once migrated a rank of an unrelated job); --run-id picks."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    _, other, _ = _second_job("other-job")
    try:
        for args in (["status"], ["migrate", "1"], ["drain", "1"], ["events"]):
            result = CliRunner().invoke(app, args)
            assert result.exit_code == 1, (args, result.output)
            assert "2 tmrun jobs run on this host" in result.output and RUN in result.output, result.output
            assert "other-job" in result.output and "--run-id" in result.output, result.output
            assert len([line for line in result.output.splitlines() if line.strip()]) == 1, result.output
        picked = CliRunner().invoke(app, ["status", "--json", "--run-id", "other-job"])
        assert picked.exit_code == 0 and json.loads(picked.output)["run_id"] == "other-job", picked.output
        moved = CliRunner().invoke(app, ["migrate", "1", "--run-id", RUN])
        assert moved.exit_code == 0 and moved.output.startswith(f"job {RUN}: migration of rank 1"), moved.output
    finally:
        other.stop()


def test_inside_a_slurm_job_its_own_run_is_chosen(job, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """On a node shared with another job, tmrun-ctl inside SLURM job 5150 acts on 5150's run."""
    _, mine, _ = _second_job("slurm-5150")
    try:
        monkeypatch.setenv("SLURM_JOB_ID", "5150")
        result = CliRunner().invoke(app, ["status", "--json"])
        assert result.exit_code == 0 and json.loads(result.output)["run_id"] == "slurm-5150", result.output
        _, step, _ = _second_job("slurm-5150.1")  # two steps of this job: which one must be said
        try:
            result = CliRunner().invoke(app, ["status"])
            assert result.exit_code == 1 and "2 tmrun jobs" in result.output and RUN not in result.output
        finally:
            step.stop()
    finally:
        mine.stop()


def test_the_printed_endpoint_hint_works_as_printed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``tmrun-ctl --endpoint HOST:PORT``, as tmrun prints it, on the job's host with no token in
    the environment: the run file's token file is used (it failed: 'requires its job token')."""
    monkeypatch.setenv("TMRUN_STATE_DIR", str(tmp_path / "state"))
    for name in ("TMRUN_JOB_TOKEN", "TMRUN_JOB_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    _, ops, address = _second_job("tokened", token="s3cret-token-0123456789abcdef")
    try:
        result = CliRunner().invoke(app, ["status", "--json", "--endpoint", address])
        assert result.exit_code == 0 and json.loads(result.output)["run_id"] == "tokened", result.output
        host, port = address.rsplit(":", 1)
        by_name = CliRunner().invoke(app, ["status", "--json", "--endpoint", f"localhost:{port}"])
        assert by_name.exit_code == 0, by_name.output
        (tmp_path / "state").rename(tmp_path / "gone")  # another host: no run file, so no token
        missing = CliRunner().invoke(app, ["status", "--endpoint", address])
        assert missing.exit_code == 1 and "requires its job token" in missing.output
        assert "TMRUN_JOB_TOKEN" in missing.output
    finally:
        ops.stop()
