"""Messages of the in-place protocol and drill specs: bad input is a one-line error, never a
traceback deep in training."""

from __future__ import annotations

import pytest

from tmrun.protocol import messages as proto
from tmrun.protocol.drills import Drill, DrillSpecError, parse_all
from tmrun.worker.drills import DrillRunner, InjectedFailure


def test_plan_round_trip() -> None:
    plan = proto.ReplacementPlan(gen=3, world_size=8, replaced={5: 2, 6: 3}, reason="x", planned=True)
    assert proto.ReplacementPlan.decode("k", plan.encode()) == plan
    cancelling = proto.ReplacementPlan(gen=4, world_size=8, replaced={2: 4}, returned=(5,))
    assert proto.ReplacementPlan.decode("k", cancelling.encode()).returned == (5,)
    assert proto.ReplacementPlan.decode("k", '{"gen": 1, "world_size": 2, "replaced": {"1": 0}}').returned == ()


@pytest.mark.parametrize(
    "raw,match",
    [
        (b"\xff\xfe", "not JSON"),
        ("[1, 2]", "JSON object"),
        ('{"gen": 0, "world_size": 2, "replaced": {"1": 0}}', "gen"),
        ('{"gen": 1, "world_size": 2, "replaced": {}}', "non-empty"),
        ('{"gen": 1, "world_size": 2, "replaced": {"x": 0}}', "not an integer"),
        ('{"gen": 1, "world_size": 2, "replaced": {"2": 0}}', "bad replacement"),
        ('{"gen": 1, "world_size": 2, "replaced": {"1": -1}}', "bad replacement"),
        ('{"gen": true, "world_size": 2, "replaced": {"1": 0}}', "gen"),
        ('{"gen": 2, "world_size": 2, "replaced": {"1": 0}, "returned": [1]}', "returned"),  # both moved and kept
        ('{"gen": 2, "world_size": 2, "replaced": {"1": 0}, "returned": [2]}', "returned"),
        ('{"gen": 2, "world_size": 2, "replaced": {"1": 0}, "returned": "0"}', "returned"),
        ('{"gen": 2, "world_size": 2, "replaced": {"1": 0}, "returned": [true]}', "returned"),
    ],
)
def test_bad_plans_are_refused_with_the_key(raw: bytes | str, match: str) -> None:
    with pytest.raises(proto.ProtocolMessageError, match=match) as info:
        proto.ReplacementPlan.decode("plan/1", raw)
    assert str(info.value).startswith("plan/1: ") and "\n" not in str(info.value)


def test_other_messages() -> None:
    assert proto.Assignment.decode("a", proto.Assignment(2, 4, planned=True).encode()) == proto.Assignment(2, 4, False, True)
    assert proto.Assignment.decode("a", '{"stop": true}').stop
    with pytest.raises(proto.ProtocolMessageError):
        proto.Assignment.decode("a", '{"rank": -1, "gen": 1}')
    report = proto.WorkerReport(reporter=0, lost=3, gen=2, detail="d")
    assert proto.WorkerReport.decode("r", report.encode()) == report
    with pytest.raises(proto.ProtocolMessageError):
        proto.WorkerReport.decode("r", '{"reporter": "0", "lost": 1, "gen": 0}')
    with pytest.raises(proto.ProtocolMessageError):
        proto.MigrateRequest.decode("m", "{}")


def test_drill_specs() -> None:
    drill = Drill.parse("rank=1,step=8,at=backward")
    assert (drill.rank, drill.step, drill.at, drill.signal_name) == (1, 8, "backward", "KILL")
    assert Drill.parse(drill.encode()) == drill
    assert parse_all(f"{drill.encode()};rank=0,who=joiner")[1].at == "promotion"
    assert Drill.parse("rank=0,at=transfer").step == -1  # the first donation, whatever the step
    handover = Drill.parse("rank=1,at=handover,signal=RAISE")  # a leaver's handover: any step
    assert Drill.parse(handover.encode()) == handover
    runner = DrillRunner([handover], rank=1, promoted=False)
    runner.fire("step", 5)
    with pytest.raises(InjectedFailure):
        runner.fire("handover", 17)
    for bad, match in [
        ("rank", "key=value"),
        ("step=3", "rank=N"),
        ("rank=1", "step=N or time"),
        ("rank=x,step=1", "integers"),
        ("rank=1,step=1,at=lunch", "at="),
        ("rank=1,step=1,signal=NOPE", "signal"),
        ("rank=1,step=1,colour=red", "unknown key"),
        ("rank=1,rank=2,step=1", "twice"),
        ("rank=-1,step=1", ">= 0"),
        ("rank=1,time=2,signal=RAISE", "RAISE needs step"),
    ]:
        with pytest.raises(DrillSpecError, match=match):
            Drill.parse(bad)


def test_drill_fires_once_and_only_where_it_should() -> None:
    claimed: list[int] = []
    runner = DrillRunner([Drill.parse("rank=1,step=2,signal=RAISE")], rank=1, promoted=False)
    runner.claim = lambda index: (claimed.append(index), len(claimed) == 1)[1]
    runner.fire("step", 1)  # other step
    runner.fire("forward", 2)  # other point
    with pytest.raises(InjectedFailure):
        runner.fire("step", 2)
    runner.fire("step", 2)  # fired already
    joiner = DrillRunner([Drill.parse("rank=1,step=2,signal=RAISE")], rank=1, promoted=True)
    joiner.fire("step", 2)  # an original-rank drill never fires in a joiner
    other = DrillRunner([Drill.parse("rank=1,step=2,signal=RAISE")], rank=0, promoted=False)
    other.fire("step", 2)
    assert claimed == [0]


def test_node_drill_specs() -> None:
    drill = Drill.parse("node=1,step=6")
    assert (drill.node, drill.rank, drill.step) == (1, -1, 6)
    assert Drill.parse(drill.encode()) == drill
    for bad, message in [("rank=1,node=1,step=2", "rank=N or node=G"), ("node=-1,step=2", "node must be"),
                         ("node=1,step=2,signal=RAISE", "no signal=RAISE"), ("node=1,who=joiner", "no who=joiner")]:
        with pytest.raises(DrillSpecError, match=message):
            Drill.parse(bad)


def test_node_drill_fires_on_local_rank_0_of_that_node_only() -> None:
    drill = Drill.parse("node=1,step=3")
    assert DrillRunner([drill], rank=2, promoted=False, group_rank=1, local_rank=0)._matches(drill, "step", 3)
    assert not DrillRunner([drill], rank=3, promoted=False, group_rank=1, local_rank=1)._matches(drill, "step", 3)
    assert not DrillRunner([drill], rank=0, promoted=False, group_rank=0, local_rank=0)._matches(drill, "step", 3)
    assert not DrillRunner([drill], rank=2, promoted=True, group_rank=1, local_rank=0)._matches(drill, "step", 3)


@pytest.mark.parametrize("message", [
    proto.FailureReport(node_id=2, epoch=5, by_signal=True, node_dead=False, detail="rank 3 signal SIGKILL"),
    proto.FailureReport(node_id=0, epoch=1, by_signal=False, detail="rank 1 exit code 1", node_fallback="no live replica"),
    proto.NodeInfo(host="n1", addr="10.0.0.2", pid=99, node_rank_hint=1, time=12.5),
    proto.LeaderInfo(host="n0", pid=7, endpoint="n0:29400"),
    proto.WorkersInfo(epoch=1, group_rank=0, agent_pid=7, workers=[{"local_rank": 0, "rank": 0, "pid": 8}],
                      standby_workers=[{"index": 1, "pid": 9, "state": "ready", "local_rank": 0}]),
    proto.ClosedNotice(phase="failed", reason="why"),
    proto.NodeRanks(node_id=2, ranks=[2, 3]),
    proto.StandbyNode(ids=[2000, 2001]),
    proto.StandbyReady(pid=5, shadow_steps=2, finite=True, local_ops=7, network_ops=0, bytes_sent=0, bytes_recv=0),
])
def test_every_message_round_trips(message: object) -> None:
    assert type(message).decode("k", message.encode()) == message  # type: ignore[attr-defined]


def test_event_round_trip_keeps_its_number_outside_the_value() -> None:
    event = proto.Event(time=1.5, kind="replace", epoch=2, detail="x")
    assert proto.Event.decode("event/4", event.encode(), seq=4) == proto.Event(1.5, "replace", 2, "x", seq=4)


@pytest.mark.parametrize("cls,raw,match", [
    (proto.FailureReport, b'{"node_id": -1, "epoch": 0}', "node_id"),
    (proto.NodeInfo, b'{"host": 3, "pid": 1}', "host"),
    (proto.NodeRanks, b'{"node_id": 0, "ranks": [1, "x"]}', "ranks"),
    (proto.StandbyNode, b'[1, 2]', "expected a JSON object"),
    (proto.WorkersInfo, b'{"epoch": 1, "agent_pid": 2, "workers": {}}', "must be lists"),
    (proto.ClosedNotice, b"\xff", "not JSON"),
])
def test_bad_messages_of_agents_are_one_line_errors(cls: type, raw: bytes, match: str) -> None:
    with pytest.raises(proto.ProtocolMessageError, match=match) as caught:
        cls.decode("some/key", raw)  # type: ignore[attr-defined]
    assert str(caught.value).startswith("some/key: ") and "\n" not in str(caught.value)


def test_recovery_timing_round_trip_and_bad_input() -> None:
    timing = proto.RecoveryTiming(rank=1, gen=2, connected=10.5, healed=10.75, noticed=10.0)
    assert proto.RecoveryTiming.decode("t", timing.encode()) == timing
    later = proto.RecoveryTiming(rank=1, gen=2, connected=10.5, healed=10.75, first_step=11.5)
    assert proto.RecoveryTiming.decode("t", later.encode()).first_step == 11.5
    survivor = proto.RecoveryTiming(rank=1, gen=2, connected=10.5, healed=10.75, redone=False)
    assert proto.RecoveryTiming.decode("t", survivor.encode()).redone is False
    assert proto.RecoveryTiming.decode("t", '{"rank": 1, "gen": 1, "connected": 1, "healed": 1}').redone is None
    for raw, match in [('{"rank": 1, "gen": 0, "connected": 1, "healed": 1}', "gen"),
                       ('{"rank": 1, "gen": 1, "connected": -1, "healed": 1}', "connected"),
                       ('{"rank": 1, "gen": 1, "connected": 1, "healed": "x"}', "healed"),
                       ('{"rank": 1, "gen": 1, "connected": 1, "healed": 1, "first_step": true}', "first_step"),
                       ('{"rank": 1, "gen": 1, "connected": 1, "healed": 1, "noticed": NaN}', "noticed"),
                       ('{"rank": 1, "gen": 1, "connected": 1, "healed": 1, "redone": 1}', "redone")]:
        with pytest.raises(proto.ProtocolMessageError, match=match) as info:
            proto.RecoveryTiming.decode("timing/1/1", raw)
        assert str(info.value).startswith("timing/1/1: ") and "\n" not in str(info.value)


def test_a_migration_request_carries_when_it_was_asked() -> None:
    asked = proto.MigrateRequest.decode("m", proto.MigrateRequest(1, "slow", time=12.5).encode())
    assert asked.time == 12.5 and asked == proto.MigrateRequest(1, "slow")  # the time is not its identity
    assert proto.MigrateRequest.decode("m", '{"rank": 1}').time == 0.0  # an older writer
    with pytest.raises(proto.ProtocolMessageError, match="time"):
        proto.MigrateRequest.decode("m", '{"rank": 1, "time": -3}')


def test_a_forward_drill_whose_step_passed_without_a_hook_says_so_once(capsys: pytest.CaptureFixture[str]) -> None:
    """A model without tmrun's hooks never fires "forward": the drill's step passing says so
    (before, the run went on without its failure, silently)."""
    runner = DrillRunner([Drill.parse("rank=1,step=2,at=forward")], rank=1, promoted=False)
    runner.fire("step", 2)
    assert capsys.readouterr().err == ""  # its step is under way: the hook may still fire
    runner.fire("step", 3)
    err = capsys.readouterr().err
    assert "rank 1: --inject-failure rank=1,at=forward" in err and "never fired" in err and err.count("\n") == 1
    runner.fire("step", 4)
    assert capsys.readouterr().err == ""  # once
    joiner = DrillRunner([Drill.parse("rank=1,step=2,at=forward")], rank=1, promoted=True)
    joiner.fire("step", 3)  # an original's drill: not the joiner's to miss
    assert capsys.readouterr().err == ""
