"""Fuzz what tmrun-ctl and the leader's operations endpoint read (tmrun/protocol/ops.py,
tmrun/launcher/runfile.py): a request line either validates or raises a one-line
OpsRequestError; a reply either decodes or raises OpsError; an endpoint address either parses
into (host, port in 1..65535) or raises OpsError; a run file (written by an agent, read by
tmrun-ctl) is either one or None. A request that validates re-validates after a JSON round trip.

    python tests/fuzz/fuzz_ops.py -atheris_runs=100000
    python tests/fuzz/fuzz_ops.py -max_total_time=150

Input: byte 0 picks request (raw line, or an object built over the request fields), reply,
address or run file (raw, or an object over its fields); the rest is the text.
"""

from __future__ import annotations

import json
import sys

from _harness import atheris, expect_error, json_object, main

with atheris.instrument_imports(include=["tmrun"]):
    from tmrun.launcher import runfile
    from tmrun.protocol import ops


def _request(line: bytes) -> None:
    try:
        data = ops.decode_request(line)
    except ops.OpsRequestError as exc:
        expect_error(exc, ops.OpsRequestError)
        return
    except Exception as exc:  # noqa: BLE001
        expect_error(exc, ops.OpsRequestError)
        return
    assert isinstance(data, dict) and data["op"] in ops.OPS, data
    again = json.dumps(data).encode()
    if len(again) <= ops.MAX_REQUEST:
        assert ops.decode_request(again) == data or data != data  # NaN fields compare unequal


def _reply(raw: bytes) -> None:
    try:
        reply = ops.decode_reply(raw, "host:1")
    except Exception as exc:  # noqa: BLE001
        expect_error(exc, ops.OpsError)
        return
    assert isinstance(reply, dict) and "ok" in reply


def _address(text: str) -> None:
    try:
        host, port = ops.parse_address(text)
    except Exception as exc:  # noqa: BLE001
        expect_error(exc, ops.OpsError)
        return
    assert host and 0 < port < 65536, (host, port)
    assert ops.parse_address(f"{host}:{port}") == (host, port) or ":" in host


def _runfile(text: str) -> None:
    data = runfile.read_runfile(text)
    if data is not None:
        assert isinstance(data, dict) and type(data["pid"]) is int and data["pid"] > 0, data
        assert float(data["started"]) == float(data["started"]), data  # finite


def test_one_input(data: bytes) -> None:
    if not data:
        return
    mode, body = data[0] % 6, data[1:]
    if mode == 0:
        _request(body)
    elif mode == 1:
        fdp = atheris.FuzzedDataProvider(body)
        obj = json_object(fdp, ["op", "since", "rank", "node", "reason"])
        if fdp.ConsumeBool():
            obj["op"] = fdp.PickValueInList(list(ops.OPS))
        _request(json.dumps(obj).encode() + b"\n")
    elif mode == 2:
        _reply(body)
    elif mode == 3:
        _address(atheris.FuzzedDataProvider(body).ConsumeUnicodeNoSurrogates(len(body)))
    elif mode == 4:
        _runfile(body.decode("utf-8", "replace"))
    else:
        fdp = atheris.FuzzedDataProvider(body)
        _runfile(json.dumps(json_object(fdp, ["run_id", "endpoint", "ops", "event_log", "pid", "started"])))


def seeds() -> list[bytes]:
    requests = [{"op": "ping"}, {"op": "status"}, {"op": "events", "since": 3},
                {"op": "migrate", "rank": 1, "reason": "slow"}, {"op": "migrate", "node": 0}]
    out = [bytes([0]) + json.dumps(r).encode() + b"\n" for r in requests]
    out += [bytes([2]) + json.dumps({"ok": True, "run_id": "r", "status": {}}).encode() + b"\n",
            bytes([2]) + json.dumps({"ok": False, "error": "no"}).encode(),
            bytes([3]) + b"\x00localhost:29500", bytes([3]) + b"\x00[::1]:80", bytes([0]) + b"[" * 2000,
            bytes([4]) + json.dumps({"run_id": "r", "endpoint": "h:1", "ops": "h:2", "event_log": "", "pid": 7,
                                     "started": 1.5}).encode()]
    return out


if __name__ == "__main__":
    main(test_one_input, seeds())
    sys.exit(0)
