"""Progress records (protocol/progress.py), the NodeProgress message, and the drill specs of
detection (slow=, signal=STALL)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from tmrun.protocol import progress
from tmrun.protocol import messages as proto
from tmrun.protocol.drills import Drill, DrillSpecError, parse_all
from tmrun.protocol.environment import LaunchEnv, Mode


def test_a_record_round_trips_through_its_file(tmp_path: Path) -> None:
    path = progress.path_for(str(tmp_path), 3)
    assert progress.read(path) is None  # no file yet
    writer = progress.ProgressFile(path)
    record = progress.ProgressRecord(step=7, step_end=1.5, step_seconds=0.25, busy_seconds=0.125, comm_since=2.0,
                                     updated=3.0, pid=42, gen=1, role="recovering", resumed=5)
    writer.write(record)
    assert progress.read(path) == record
    writer.write(progress.ProgressRecord(step=8, pid=42))
    assert progress.read(path).step == 8  # type: ignore[union-attr]
    # a second writer (a joiner taking the rank over) continues the sequence
    progress.ProgressFile(path).write(progress.ProgressRecord(step=9, pid=43))
    assert progress.read(path) == progress.ProgressRecord(step=9, pid=43)


def test_a_record_caught_mid_write_is_not_read(tmp_path: Path) -> None:
    path = tmp_path / "rank-0"
    progress.ProgressFile(str(path)).write(progress.ProgressRecord(step=1))
    raw = bytearray(path.read_bytes())
    struct.pack_into("<Q", raw, 0, 5)  # odd: the writer is writing
    path.write_bytes(bytes(raw))
    assert progress.read(str(path)) is None


def test_node_progress_message() -> None:
    msg = proto.NodeProgress(1, 10.0, (proto.RankProgress(2, 5, 0.5, 0.25, 9.5, 77, "active"),))
    assert proto.NodeProgress.decode("k", msg.encode()) == msg
    assert proto.NodeProgress.decode("k", '{"node": 0, "time": 1, "ranks": []}').ranks == ()
    # an epoch and a resume step (a group restart's count, control.restarts); -1 where not said
    said = proto.NodeProgress(1, 10.0, (proto.RankProgress(2, 5, 0.5, 0.25, 9.5, 77, "active", resumed=3),), epoch=4)
    assert proto.NodeProgress.decode("k", said.encode()) == said
    older = proto.NodeProgress.decode("k", '{"node": 0, "time": 1, "ranks": [{"rank": 0, "step": 1, "step_seconds": 0,'
                                           ' "busy_seconds": 0, "time": 0, "pid": 1}]}')
    assert older.epoch == -1 and older.ranks[0].resumed == -1
    with pytest.raises(proto.ProtocolMessageError, match="resumed"):
        proto.NodeProgress.decode("k", '{"node": 0, "time": 1, "ranks": [{"rank": 0, "step": 1, "step_seconds": 0,'
                                       ' "busy_seconds": 0, "time": 0, "pid": 1, "resumed": -5}]}')
    with pytest.raises(proto.ProtocolMessageError, match="ranks"):
        proto.NodeProgress.decode("k", '{"node": 0, "time": 1}')
    with pytest.raises(proto.ProtocolMessageError, match="step_seconds"):
        proto.NodeProgress.decode("k", '{"node": 0, "time": 1, "ranks": [{"rank": 0, "step": 1, "step_seconds": -1,'
                                       ' "busy_seconds": 0, "time": 0, "pid": 1}]}')


def test_launch_env_carries_the_progress_directory() -> None:
    env = LaunchEnv(mode=Mode.ACTIVE, store_host="h", store_port=1, progress_dir="/tmp/p")
    assert LaunchEnv.from_environ(env.to_environ()).progress_dir == "/tmp/p"


def test_slow_and_stall_drills() -> None:
    slow = Drill.parse("rank=1,slow=3x")
    assert slow.slow == 3.0 and slow.step == 0 and parse_all(slow.encode()) == [slow]
    assert Drill.parse("rank=0,slow=2.5,step=4").step == 4
    stall = Drill.parse("rank=1,step=5,at=forward,signal=STALL")
    assert stall.signal_name == "STALL" and parse_all(stall.encode()) == [stall]
    late = Drill.parse("rank=2,step=0,at=forward,delay=3s")
    assert late.delay == 3.0 and late.at == "forward" and parse_all(late.encode()) == [late]


@pytest.mark.parametrize("spec,message", [
    ("rank=1,slow=1x", "factor above 1"),
    ("rank=1,slow=fast", "not a factor"),
    ("rank=1,slow=3x,at=forward", "slow=F takes rank=R"),
    ("node=0,slow=3x", "slow=F takes rank=R"),
    ("rank=1,time=3,signal=STALL", "STALL needs step=N"),
    ("node=0,step=3,signal=STALL", "no signal=RAISE or STALL"),
    ("rank=1,step=0,delay=0", "above 0 and at most 600"),
    ("rank=1,step=0,delay=nan", "above 0 and at most 600"),
    ("rank=1,step=0,delay=soon", "not a number of seconds"),
    ("rank=1,step=0,delay=3,signal=KILL", "delay=S takes rank=R"),
    ("rank=1,time=2,delay=3", "delay=S takes rank=R"),
    ("node=1,step=0,delay=3", "delay=S takes rank=R"),
])
def test_bad_detection_drills_are_one_line_errors(spec: str, message: str) -> None:
    with pytest.raises(DrillSpecError, match=message):
        Drill.parse(spec)
