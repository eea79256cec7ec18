"""Fuzz every JSON message of the store (tmrun/protocol/messages.py) and the membership
(tmrun/protocol/membership.py): each decode either returns a value or raises a one-line
ProtocolMessageError, and what decodes re-encodes stably (decode(encode(m)) == m, compared by
encoding so that NaN counts as itself).

    python tests/fuzz/fuzz_messages.py -atheris_runs=100000
    python tests/fuzz/fuzz_messages.py -max_total_time=150

Input: byte 0 picks the message type, byte 1 the mode: raw bytes (libFuzzer's own mutations of
the seeds), or an object built from the rest over the type's field names with values of any JSON
type (finds type confusions fast).
"""

from __future__ import annotations

import dataclasses
import json
import sys

from _harness import atheris, expect_error, json_object, main

with atheris.instrument_imports(include=["tmrun"]):
    from tmrun.protocol import messages as m
    from tmrun.protocol.membership import Membership, Phase

DECODERS = [
    m.ReplacementPlan, m.Assignment, m.MigrateRequest, m.WorkerReport, m.AbortNotice, m.FailureReport,
    m.NodeInfo, m.LeaderInfo, m.WorkersInfo, m.ClosedNotice, m.NodeRanks, m.StandbyNode, m.StandbyReady,
    m.RecoveryTiming, m.Event, m.NodeProgress, Membership,
]

VALID = [
    m.ReplacementPlan(gen=2, world_size=4, replaced={1: 0, 3: 7}, reason="rank 1 exited", planned=True, created=1.5),
    m.Assignment(rank=1, gen=3), m.Assignment(stop=True), m.Assignment(rank=0, gen=1, planned=True),
    m.MigrateRequest(rank=2, reason="slow", time=12.5), m.MigrateRequest(node=1),
    m.WorkerReport(reporter=0, lost=1, gen=0, detail="peer lost"), m.WorkerReport(reporter=1, lost=-1, gen=2),
    m.AbortNotice(reason="no standby", gen=3),
    m.FailureReport(node_id=1, epoch=2, by_signal=True, node_dead=False, detail="SIGKILL"),
    m.NodeInfo(host="h", addr="10.0.0.1", pid=99, node_rank_hint=2, time=3.0),
    m.LeaderInfo(host="h", pid=1, endpoint="h:29500"),
    m.WorkersInfo(epoch=1, group_rank=0, agent_pid=5, workers=[{"rank": 0, "pid": 6}], standby_workers=[]),
    m.ClosedNotice(phase="succeeded", reason="done"),
    m.NodeRanks(node_id=2, ranks=[0, 1, 2, 3]), m.StandbyNode(ids=[4, 5]),
    m.StandbyReady(pid=4, shadow_steps=2, finite=True, local_ops=10, network_ops=0),
    m.RecoveryTiming(rank=1, gen=1, connected=2.0, healed=3.0, noticed=1.0, first_step=None),
    m.Event(time=1.0, kind="replaced", epoch=0, detail="rank 1", fields={"gen": 1, "ranks": [1]}),
    m.NodeProgress(node=0, time=2.0, ranks=(m.RankProgress(rank=0, step=3, step_seconds=0.1, busy_seconds=0.05,
                                                           time=2.0, pid=7, role="active"),)),
    Membership(epoch=3, phase=Phase.RUNNING, active=[0, 2], standby=[1], dead=[3], retired=[], reason="x"),
]


def _encode(value: object) -> str:
    return value.to_json() if isinstance(value, Membership) else value.encode()  # type: ignore[attr-defined]


def _decode(cls: type, raw: bytes | str) -> object:
    if cls is Membership:
        return Membership.from_json(raw, "state")
    return cls.decode("fuzz/key", raw)


def _names(cls: type) -> list[str]:
    names = [f.name for f in dataclasses.fields(cls)]
    if cls is m.NodeProgress:
        names += ["ranks"]
    return names


def test_one_input(data: bytes) -> None:
    if len(data) < 2:
        return
    cls = DECODERS[data[0] % len(DECODERS)]
    if data[1] % 2:
        raw: bytes | str = data[2:]
    else:
        fdp = atheris.FuzzedDataProvider(data[2:])
        obj = json_object(fdp, _names(cls))
        if cls is m.NodeProgress and fdp.ConsumeBool():
            obj["ranks"] = [json_object(fdp, [f.name for f in dataclasses.fields(m.RankProgress)])]
        raw = json.dumps(obj)
    try:
        value = _decode(cls, raw)
    except m.ProtocolMessageError as exc:
        expect_error(exc, m.ProtocolMessageError)
        return
    except Exception as exc:  # noqa: BLE001
        expect_error(exc, m.ProtocolMessageError)  # re-raises: a finding
        return
    assert isinstance(value, cls), value
    once = _encode(value)
    twice = _encode(_decode(cls, once))
    assert once == twice, (once, twice)


def seeds() -> list[bytes]:
    out = []
    for value in VALID:
        index = DECODERS.index(type(value))
        out.append(bytes([index, 1]) + _encode(value).encode())
    out.append(bytes([0, 1]) + b"[" * 3000)
    return out


if __name__ == "__main__":
    main(test_one_input, seeds())
    sys.exit(0)
