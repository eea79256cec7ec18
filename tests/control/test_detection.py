"""Detection beyond process exit (control/detection.py, control/gpu_health.py): hangs,
stragglers, unhealthy GPUs, and the node's published progress; with real progress files, a
fake NVML and, for the controller, real processes (killed by PID)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from tmrun.control.detection import Detection, DetectionSettings, HangDetector, StragglerDetector, _Seen
from tmrun.control.gpu_health import FakeNvml, GpuHealth
from tmrun.control.replacement.processes import ProcessReplacement
from tmrun.protocol import keys, progress
from tmrun.protocol import messages as proto
from tmrun.protocol.progress import ProgressRecord as Rec

# -- hang -----------------------------------------------------------------------------------------


def seen(**steps: int) -> dict[int, _Seen]:
    return {int(r[1:]): _Seen(pid=100 + int(r[1:]), step=s, changed=0.0) for r, s in steps.items()}


def test_no_hang_verdict_before_the_timeout_or_before_every_rank_stepped() -> None:
    hang = HangDetector(3.0)
    assert hang.check(2.9, seen(r0=4, r1=4), {}, {}, 0.0) == ([], [])
    assert hang.check(99.0, seen(r0=4, r1=-1), {}, {1: True}, 0.0) == ([], [])  # start-up may be long
    assert HangDetector(0.0).check(99.0, seen(r0=4, r1=4), {}, {1: True}, 0.0) == ([], [])  # off


def test_a_stopped_process_is_blamed() -> None:
    hung, _ = HangDetector(3.0).check(5.0, seen(r0=4, r1=4), {0: Rec(comm_since=1.0)}, {0: False, 1: True}, 10.0)
    assert [r for r, _ in hung] == [1] and "stopped" in hung[0][1]


def test_a_rank_outside_the_collective_the_others_wait_in_is_blamed() -> None:
    records = {0: Rec(step=4, comm_since=100.0), 1: Rec(step=4), 2: Rec(step=4, comm_since=101.0)}
    hung, _ = HangDetector(3.0).check(5.0, seen(r0=4, r1=4, r2=4), records, {}, 105.0)
    assert [r for r, _ in hung] == [1]
    # the others have not waited long enough yet: no verdict
    assert HangDetector(3.0).check(5.0, seen(r0=4, r1=4, r2=4), records, {}, 102.0)[0] == []


def test_a_rank_that_just_left_the_collective_the_others_wait_in_is_not_blamed() -> None:
    """CI (2026-12-07): rank 3 of node 1 stalled; node 1's agent fenced its node; rank 1 on node 0,
    inside the collective with rank 0 until then, noticed the loss first and left it (its record
    updated then), rank 0 still inside: node 0's agent blamed rank 1 as stuck in its compute,
    failed its own node too, and the job took the group restart. A rank outside the collective
    is blamed only once it has been outside for the timeout; then it is."""
    records = {0: Rec(step=4, comm_since=100.0, updated=100.0), 1: Rec(step=4, updated=105.5)}
    hang = HangDetector(3.0)
    assert hang.check(5.0, seen(r0=4, r1=4), records, {}, 105.6) == ([], [])
    hung, _ = hang.check(9.0, seen(r0=4, r1=4), records, {}, 108.6)
    assert [r for r, _ in hung] == [1]


def test_a_rank_behind_is_blamed_and_all_inside_collectives_is_undecided() -> None:
    records = {0: Rec(comm_since=1.0), 1: Rec(comm_since=1.0)}
    hung, _ = HangDetector(3.0).check(5.0, seen(r0=4, r1=3), records, {}, 2.0)
    assert [r for r, _ in hung] == [1]
    hang = HangDetector(3.0)
    hung, notes = hang.check(5.0, seen(r0=4, r1=4), records, {}, 2.0)
    assert hung == [] and len(notes) == 1 and "cannot tell" in notes[0]
    assert hang.check(6.0, seen(r0=4, r1=4), records, {}, 2.0) == ([], [])  # said once per stall
    hung, notes = HangDetector(3.0).check(5.0, seen(r0=4, r1=4), {}, {}, 2.0)
    assert hung == [] and "no rank inside a collective" in notes[0]


def test_only_the_stalled_rank_when_others_progress() -> None:
    ranks = seen(r0=4, r1=9)
    ranks[1].changed = 4.0
    hung, _ = HangDetector(3.0).check(5.0, ranks, {}, {}, 0.0)
    assert [r for r, _ in hung] == [0]


def test_a_rank_seen_later_at_the_same_step_is_not_progress() -> None:
    """CI: rank 3 stalls in its forward, rank 2 waits in the collective; the agent saw rank 2
    complete the same step a moment later (a loaded machine). Rank 2 is not progressing: no verdict
    until both are quiet, then the one outside the collective is blamed, for that reason."""
    ranks = seen(r2=3, r3=3)
    ranks[2].changed = 1.5
    records = {2: Rec(step=3, comm_since=102.0), 3: Rec(step=3)}
    hang = HangDetector(3.0)
    assert hang.check(4.0, ranks, records, {}, 104.0) == ([], [])
    # both quiet now, rank 2 inside its collective for less than the timeout: no verdict, no note
    assert hang.check(4.6, ranks, records, {}, 104.6) == ([], [])
    hung, _ = hang.check(5.5, ranks, records, {}, 105.5)
    assert [r for r, _ in hung] == [3] and "outside any collective while rank(s) 2 wait in one" in hung[0][1]


# -- straggler ------------------------------------------------------------------------------------


def test_a_straggler_is_flagged_after_k_consecutive_slow_steps_once() -> None:
    det = StragglerDetector(2.0, 3, 0.05)
    ranks = seen(r0=0, r1=0, r2=0)
    records = {0: Rec(step=0, busy_seconds=0.1, role="active"), 2: Rec(step=0, busy_seconds=0.12, role="active")}
    verdicts = []
    for step, busy in enumerate([0.5, 0.5, 0.15, 0.5, 0.5, 0.5, 0.5, 0.5]):
        records[1] = Rec(step=step, busy_seconds=busy, role="active")
        verdicts.append(det.on_step(1, ranks, records))
    assert [bool(v) for v in verdicts] == [False, False, False, False, False, True, False, False]
    assert "over 2x the others' median 0.110s for 3 consecutive steps (up to step 5)" in verdicts[5]
    det.retry_later(ranks[1])  # refused: asked again after K more slow steps
    records[1] = Rec(step=9, busy_seconds=0.5, role="active")
    assert [bool(det.on_step(1, ranks, records)) for _ in range(3)] == [False, False, True]


def test_tiny_steps_and_recovering_ranks_are_not_stragglers() -> None:
    det = StragglerDetector(2.0, 1, 0.05)
    ranks = seen(r0=0, r1=0)
    records = {0: Rec(step=0, busy_seconds=0.001, role="active"), 1: Rec(step=0, busy_seconds=0.01, role="active")}
    assert det.on_step(1, ranks, records) == ""  # 10x, but 9 ms: noise on a loaded host
    records[1] = Rec(step=1, busy_seconds=0.5, role="recovering")
    assert det.on_step(1, ranks, records) == ""
    assert StragglerDetector(0.0, 1, 0.0).on_step(1, ranks, {**records, 1: Rec(busy_seconds=9)}) == ""  # off


# -- GPU health ------------------------------------------------------------------------------------


def fake(tmp_path: Path, gpus: dict) -> FakeNvml:
    path = tmp_path / "nvml.json"
    path.write_text(json.dumps({"count": 2, "gpus": gpus}))
    return FakeNvml(str(path))


def test_gpu_health_reports_xid_ecc_and_throttling_once(tmp_path: Path) -> None:
    nvml = fake(tmp_path, {"1": {"ecc_uncorrected": 3}})  # errors before the monitor started do not count
    health = GpuHealth(nvml, interval=1.0)
    assert health.enabled and health.count == 2 and health.poll(0.0) == []
    (tmp_path / "nvml.json").write_text(json.dumps({"count": 2, "gpus": {"1": {"ecc_uncorrected": 4},
                                                                          "0": {"throttle": ["thermal"]}}}))
    assert health.poll(0.5) == []  # bounded rate
    problems = {p.index: p.what for p in health.poll(1.0)}
    assert problems == {0: "clocks throttled: thermal slowdown (hardware)", 1: "1 uncorrected ECC errors"}
    assert health.poll(2.0) == []  # each GPU once


def test_gpu_health_xid_event(tmp_path: Path) -> None:
    health = GpuHealth(fake(tmp_path, {"0": {"xid": 79}}))
    assert [(p.index, p.what) for p in health.poll(0.0)] == [(0, "Xid 79")]


def test_gpu_health_is_off_without_nvml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert not GpuHealth(None).enabled
    assert not GpuHealth(FakeNvml(str(tmp_path / "missing.json"))).enabled  # nvmlInit fails
    out = capsys.readouterr()
    text = out.out + out.err
    assert "GPU health monitor off: pynvml" in text and "GPU health monitor off: NVML could not start" in text
    assert GpuHealth(None).poll(0.0) == []


def test_a_machine_without_the_nvml_library_says_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    """No NVIDIA driver (a CPU machine): nothing to watch, and no line in every CPU job's output
    (the quick start printed 'GPU health monitor off: NVML could not start (NVMLError_LibraryNotFound ...)')."""

    class NVMLError_LibraryNotFound(Exception):  # noqa: N801 - pynvml's name
        pass

    class NoLibrary:
        def nvmlInit(self) -> None:  # noqa: N802 - NVML's name
            raise NVMLError_LibraryNotFound("NVML Shared Library Not Found")

    assert not GpuHealth(NoLibrary()).enabled
    out = capsys.readouterr()
    assert "GPU health" not in out.out + out.err


def test_real_pynvml_starts_or_is_off_in_one_line() -> None:
    pynvml = pytest.importorskip("pynvml")
    health = GpuHealth(pynvml)
    try:
        assert health.enabled == (health.count > 0)
        health.poll(0.0)  # on a GPU host: the real calls answer (nothing to assert about their health)
    finally:
        health.close()


# -- the node's detection over progress files -------------------------------------------------------


def settings(tmp_path: Path, **kw: object) -> DetectionSettings:
    return DetectionSettings(progress_dir=str(tmp_path), read_interval=0.0, publish_interval=0.0,
                             gpu_health=False, **kw)  # type: ignore[arg-type]


def test_detection_reads_records_and_publishes_node_progress(tmp_path: Path) -> None:
    job = dist.HashStore()
    det = Detection(settings(tmp_path), job, node=0, local_ranks={0: 0, 1: 1})
    progress.ProgressFile(progress.path_for(str(tmp_path), 0)).write(
        Rec(step=3, step_end=5.0, step_seconds=0.2, busy_seconds=0.1, pid=11, role="active"))
    progress.ProgressFile(progress.path_for(str(tmp_path), 1)).write(Rec(step=3, pid=999))  # an old process
    det.poll({0: 11, 1: 12}, busy=False, now=1.0)
    published = proto.NodeProgress.decode("k", job.get(keys.node_progress(0)))
    assert published.node == 0 and [r.rank for r in published.ranks] == [0]
    assert published.ranks[0] == proto.RankProgress(rank=0, step=3, step_seconds=0.2, busy_seconds=0.1, time=5.0,
                                                    pid=11, role="active")


def test_the_last_records_are_published_whatever_the_interval(tmp_path: Path) -> None:
    """The workers finished: their last records are published at once, not a second later (the
    leader reads them as the job closes, to tell when a restarted group got back)."""
    job = dist.HashStore()
    det = Detection(DetectionSettings(progress_dir=str(tmp_path), read_interval=0.0, publish_interval=60.0,
                                      gpu_health=False), job, node=0, local_ranks={0: 0})
    record = progress.ProgressFile(progress.path_for(str(tmp_path), 0))
    record.write(Rec(step=3, step_end=5.0, pid=11, role="active"))
    det.publish_progress({0: 11}, now=100.0)
    record.write(Rec(step=9, step_end=8.0, pid=11, role="active"))
    det.publish_progress({0: 11}, now=101.0)  # within the interval: not published
    assert [r.step for r in proto.NodeProgress.decode("k", job.get(keys.node_progress(0))).ranks] == [3]
    det.publish_last({0: 11})
    assert [r.step for r in proto.NodeProgress.decode("k", job.get(keys.node_progress(0))).ranks] == [9]


def test_detection_finds_a_straggler_and_a_bad_gpu(tmp_path: Path) -> None:
    files = {r: progress.ProgressFile(progress.path_for(str(tmp_path), r)) for r in (0, 1)}
    nvml = fake(tmp_path / "..", {})
    det = Detection(settings(tmp_path, straggler_factor=2.0, straggler_steps=2), dist.HashStore(), 0,
                    {0: 0, 1: 1}, nvml=nvml)
    det.gpus = GpuHealth(nvml, interval=0.0)
    found = []
    for step in range(3):
        files[0].write(Rec(step=step, busy_seconds=0.1, pid=10, role="active"))
        files[1].write(Rec(step=step, busy_seconds=0.4, pid=11, role="active"))
        found += det.poll({0: 10, 1: 11}, busy=False, now=float(step)).migrate
    assert [(r, kind) for r, kind, _ in found] == [(1, "straggler")]
    (tmp_path / ".." / "nvml.json").write_text(json.dumps({"count": 2, "gpus": {"0": {"xid": 48}}}))
    found = det.poll({0: 10, 1: 11}, busy=False, now=10.0).migrate
    assert found == [(0, "gpu-unhealthy", "GPU 0 unhealthy: Xid 48")]


def test_a_rank_moved_to_a_standbys_gpu_is_watched_there(tmp_path: Path) -> None:
    """Rank 0's standby (local rank 2, its own GPU) took over: a fault on GPU 0 no longer concerns
    rank 0, one on GPU 2 does."""
    nvml = fake(tmp_path / "..", {})
    (tmp_path / ".." / "nvml.json").write_text(json.dumps({"count": 3, "gpus": {}}))  # 2 ranks and a standby
    det = Detection(settings(tmp_path), dist.HashStore(), 0, {0: 0, 1: 1}, nvml=nvml)
    det.gpus = GpuHealth(nvml, interval=0.0)
    det.moved(0, 2)
    (tmp_path / ".." / "nvml.json").write_text(json.dumps({"count": 3, "gpus": {"0": {"xid": 48}}}))
    assert det.poll({0: 10, 1: 11}, busy=False, now=1.0).migrate == []
    (tmp_path / ".." / "nvml.json").write_text(json.dumps({"count": 3, "gpus": {"2": {"xid": 79}}}))
    assert det.poll({0: 10, 1: 11}, busy=False, now=2.0).migrate == [(0, "gpu-unhealthy", "GPU 2 unhealthy: Xid 79")]


# -- the controller acts on findings ----------------------------------------------------------------


def child() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


class Pool:
    def __init__(self, members: list) -> None:
        self.members = members
        self.failing = ""

    def fill(self) -> None:
        pass

    def take(self, member: object) -> None:
        self.members.remove(member)


class Member:
    def __init__(self, index: int, process: subprocess.Popen[bytes], local_rank: int = 2) -> None:
        self.index, self.process, self.local_rank = index, process, local_rank


def controller(tmp_path: Path, procs: list, **kw: object) -> tuple:
    a, b, standby = child(), child(), child()
    procs += [a, b, standby]
    store, job = dist.HashStore(), dist.HashStore()
    progress_dir = tmp_path / "progress"
    progress_dir.mkdir()
    det = Detection(settings(progress_dir, **kw), job, 0, {0: 0, 1: 1})
    ctl = ProcessReplacement(store, Pool([Member(2, standby)]), 2, 0.0, 3, job, str(tmp_path / "gen"),  # type: ignore[arg-type]
                             detection=det)
    ctl.adopt({0: a, 1: b})
    store.set(keys.API, "1")
    store.add(keys.MEMBERS, 2)
    files = {r: progress.ProgressFile(progress.path_for(str(progress_dir), r)) for r in (0, 1)}
    return ctl, store, (a, b, standby), files


def test_the_controller_fences_a_stopped_rank_and_replaces_it(tmp_path: Path, procs) -> None:  # type: ignore[no-untyped-def]
    ctl, store, (a, b, standby), files = controller(tmp_path, procs, hang_timeout=0.5)
    store.set(keys.standby_ready(2), "{}")
    files[0].write(Rec(step=2, pid=a.pid, comm_since=time.time()))
    files[1].write(Rec(step=2, pid=b.pid))
    ctl.step()
    os.kill(b.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 20
    while b.poll() is None and time.monotonic() < deadline:
        ctl.step()
        time.sleep(0.05)
    assert b.wait(timeout=10) == -signal.SIGKILL and a.poll() is None
    ctl.step()
    assert proto.ReplacementPlan.decode("p", store.get(keys.plan(1))).replaced == {1: 2}
    assert ctl.slots[1].process is standby


def test_the_controller_migrates_a_straggler_once_a_standby_is_warm(tmp_path: Path, procs,  # type: ignore[no-untyped-def]
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    ctl, store, (a, b, standby), files = controller(tmp_path, procs, straggler_factor=2.0, straggler_steps=1)
    for step in range(6):
        if step == 3:
            store.set(keys.standby_ready(2), "{}")
        files[0].write(Rec(step=step, busy_seconds=0.1, pid=a.pid, role="active"))
        files[1].write(Rec(step=step, busy_seconds=0.5, pid=b.pid, role="active"))
        ctl.step()
        if store.check([keys.plan(1)]):
            break
    plan = proto.ReplacementPlan.decode("p", store.get(keys.plan(1)))
    assert plan.planned and plan.replaced == {1: 2} and plan.reason.startswith("straggler")
    text = capsys.readouterr()
    assert (text.out + text.err).count("it moves once a standby is warm") == 1
