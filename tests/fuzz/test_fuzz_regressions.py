"""Every input a fuzz harness (or the review around it) found, kept as a regression test: each
now decodes or raises its decoder's documented one-line error (docs/fuzzing.md, "Findings")."""

from __future__ import annotations

import json

import pytest

from tmrun.launcher.runfile import read_runfile
from tmrun.protocol import drills
from tmrun.protocol import environment as env
from tmrun.protocol import messages as m
from tmrun.protocol import ops
from tmrun.protocol.membership import Membership
from tmrun.rendezvous import liveness as lv

DEEP = b"[" * 5000  # json's scanner recurses per level: RecursionError, not ValueError


def _one_line(exc: BaseException) -> None:
    assert str(exc) and "\n" not in str(exc)


@pytest.mark.parametrize("raw", [
    DEEP, b'{"a": ' * 3000,
    json.dumps({"reason": "x", "gen": "running"}),  # AbortNotice: int("running")
    json.dumps({"reason": "x", "gen": [1]}),
    json.dumps({"reason": "x", "gen": 1e400}),  # int(inf): OverflowError
])
def test_abort_notice_and_nested_json(raw: bytes | str) -> None:
    with pytest.raises(m.ProtocolMessageError) as info:
        m.AbortNotice.decode("k", raw)
    _one_line(info.value)


@pytest.mark.parametrize("cls, data", [
    (m.ReplacementPlan, {"gen": 1, "world_size": 2, "replaced": {"0": 1}, "created": "soon"}),  # float("soon")
    (m.ReplacementPlan, {"gen": 1, "world_size": 2, "replaced": {"0": 1}, "created": [1]}),  # float([1])
    (m.ReplacementPlan, {"gen": 1, "world_size": 2, "replaced": {"0": 1}, "created": 10 ** 400}),  # OverflowError
    (m.NodeInfo, {"host": "h", "pid": 1, "time": None}),
    (m.Event, {"kind": "x", "epoch": 0, "time": {}}),
    (m.RecoveryTiming, {"rank": 0, "gen": 1, "connected": 10 ** 400, "healed": 0}),
])
def test_wrong_types_are_protocol_errors(cls: type, data: dict) -> None:
    with pytest.raises(m.ProtocolMessageError) as info:
        cls.decode("k", json.dumps(data))
    _one_line(info.value)


def test_error_messages_stay_short() -> None:
    with pytest.raises(m.ProtocolMessageError) as info:
        m.NodeRanks.decode("k", json.dumps({"node_id": 0, "ranks": ["x"] * 10000}))
    assert len(str(info.value)) < 200


def test_workers_info_group_rank_bool_is_none() -> None:
    info = m.WorkersInfo.decode("k", json.dumps({"epoch": 0, "agent_pid": 1, "group_rank": True}))
    assert info.group_rank is None


@pytest.mark.parametrize("raw", [b"{}", b"[]", DEEP, b"\xff", json.dumps({"epoch": "1", "phase": "running",
                                 "active": [], "standby": [], "dead": []}), json.dumps({"epoch": 1, "phase": "bogus"}),
                                 json.dumps({"epoch": 1, "phase": "running", "active": [None], "standby": [], "dead": []})])
def test_membership_raises_protocol_message_error(raw: bytes | str) -> None:
    with pytest.raises(m.ProtocolMessageError) as info:  # was KeyError, TypeError, JSONDecodeError
        Membership.from_json(raw)
    _one_line(info.value)


def test_ops_nested_request_and_reply() -> None:
    with pytest.raises(ops.OpsRequestError):
        ops.decode_request(b"[" * 4000)
    with pytest.raises(ops.OpsError):
        ops.decode_reply(DEEP, "h:1")


@pytest.mark.parametrize("text", [
    "h:\u00b2", "h:\u0661\u0662",  # str.isdigit() true, int() refuses or differs
    "[\t]:5", "[\x1f[\x1f]:5", "[ ]:80", "a b:1",  # hosts that did not read back as themselves
])
def test_ops_address_unicode_digits(text: str) -> None:
    with pytest.raises(ops.OpsError):
        ops.parse_address(text)


@pytest.mark.parametrize("environ", [
    {env.ENV_SHADOW_STEPS: "nan"},  # int(nan): ValueError
    {env.ENV_SHADOW_STEPS: "inf"},  # int(inf): OverflowError
    {env.ENV_RECOVERY_TIMEOUT: "nan"},
    {env.ENV_STORE: "h:\u00b2"},  # str.isdigit: int() raises ValueError
    {env.ENV_STORE: "h:99999"},
    {env.ENV_ENTRYPOINT: "[" * 5000},
])
def test_launch_env_errors(environ: dict[str, str]) -> None:
    with pytest.raises(env.LaunchEnvError) as info:
        env.LaunchEnv.from_environ(environ)
    _one_line(info.value)


def test_launch_env_empty_torchelastic_run_id_round_trips() -> None:
    read = env.LaunchEnv.from_environ({env.ENV_TORCHELASTIC_RUN_ID: ""})
    assert read.run_id == "none"
    assert env.LaunchEnv.from_environ(read.to_environ()) == read


def test_liveness_hello_with_a_huge_node_id() -> None:
    # int() of more than 4300 digits raises ValueError: that escaped the leader's poll loop
    line = lv.HELLO + b"run " + b"9" * 4400
    assert lv.parse_hello(line, b"run") is None
    assert lv.read_hello(line + b"\n", b"run") is False
    assert lv.read_hello(lv.HELLO + b"run 12\n", b"run") == 12
    assert lv.read_hello(lv.HELLO + b"run 1", b"run") is None


@pytest.mark.parametrize("spec", ["rank=1,time=inf", "rank=1,time=nan", "rank=1,time=1e400"])
def test_drill_time_must_be_finite(spec: str) -> None:
    # inf: the worker's threading.Timer raised OverflowError in its thread; nan: never fired
    with pytest.raises(drills.DrillSpecError) as info:
        drills.parse_all(spec)
    _one_line(info.value)


@pytest.mark.parametrize("text", ["[]", "[" * 5000, '{"pid": "7", "started": 1}', '{"pid": 7, "started": "x"}',
                                  '{"pid": 7}', '{"pid": 99999999999999999999, "started": 1}', '{"pid": 7, "started": 1e999}'])
def test_runfile_that_is_not_one_is_skipped(text: str) -> None:
    # tmrun-ctl's live_runs() raised TypeError, KeyError or RecursionError on such a file
    assert read_runfile(text) is None
