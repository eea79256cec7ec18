"""The leader's operations endpoint: requests and replies on loopback, bad input, the event log."""

from __future__ import annotations

import json
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import PrefixStore, TCPStore

from tmrun.control.events import record_event
from tmrun.control.ops import OpsServer
from tmrun.protocol import keys
from tmrun.protocol import ops as wire
from tmrun.protocol.membership import Membership
from tmrun.protocol.messages import MigrateRequest

RUN = "ops-test"


@pytest.fixture()
def server(tmp_path: Path):  # type: ignore[no-untyped-def]
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    store = PrefixStore(keys.job_prefix(RUN), master)
    store.set(keys.STATE, Membership().to_json())
    ops = OpsServer(store, RUN, event_log=str(tmp_path / "logs" / "events.jsonl"), request_timeout=0.2,
                    store_endpoint=f"127.0.0.1:{master.port}")
    address = ops.start("127.0.0.1")
    yield ops, store, wire.parse_address(address)
    ops.stop()


def _raw(address: tuple[str, int], payload: bytes, timeout: float = 5.0) -> dict:
    with socket.create_connection(address, timeout=timeout) as sock:
        if payload:
            sock.sendall(payload)
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    assert data.count(b"\n") == 1  # one line
    return json.loads(data)


def test_address_is_in_the_store(server) -> None:  # type: ignore[no-untyped-def]
    ops, store, address = server
    assert store.get(keys.OPS_ADDR).decode() == f"127.0.0.1:{address[1]}"


def test_status_events_migrate(server) -> None:  # type: ignore[no-untyped-def]
    ops, store, address = server
    record_event(store, "formed", 1, "formed with 1 active, 0 standby")
    record_event(store, "replace", 1, "rank 1 (pid 5, killed by SIGKILL) -> standby 0 (pid 7)")
    record_event(store, "recovered", 1, "2 ranks back in 1.500s")
    status = wire.ask(address, {"op": "status"})
    assert status["ok"] and status["run_id"] == RUN and status["membership"]["phase"] == "forming"
    assert status["totals"]["recoveries"] == 1 and status["totals"]["downtime_s"] == 1.5
    assert status["next_event"] == 3
    events = wire.ask(address, {"op": "events", "since": 1})
    assert [e["kind"] for e in events["events"]] == ["replace", "recovered"] and events["next"] == 3
    assert events["events"][0]["ranks"] == [1] and events["events"][0]["gen"] == 1
    assert events["events"][1]["phases"]["total"] == 1.5
    reply = wire.ask(address, {"op": "migrate", "node": 1, "reason": "maintenance"})
    assert reply == {"ok": True, "request": 0, "run_id": RUN}
    request = MigrateRequest.decode("m", store.get(keys.migrate_request(0)))
    assert request.node == 1 and request.reason == "maintenance"


def test_event_log_is_one_json_line_per_event(server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ops, store, address = server
    for i in range(5):
        record_event(store, "join", 0, f"node {i} (h) joined", nodes=[i])
    wire.ask(address, {"op": "events", "since": 0})
    wire.ask(address, {"op": "events", "since": 0})  # asking twice writes nothing twice
    lines = (tmp_path / "logs" / "events.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["seq"] for r in rows] == list(range(5))
    assert all({"seq", "time", "kind", "epoch", "detail"} <= set(r) for r in rows)
    assert rows[3]["nodes"] == [3] and isinstance(rows[3]["time"], float)


@pytest.mark.parametrize(
    "payload,expected",
    [
        (b"not json\n", "not JSON"),
        (b"[1, 2]\n", "JSON object"),
        (b'{"op": "reboot"}\n', "unknown op"),
        (b'{"op": "events", "since": -4}\n', "since"),
        (b'{"op": "migrate", "rank": 1, "node": 1}\n', "exactly one"),
        (b'{"op": "migrate", "rank": "x"}\n', "rank"),
        (b"\xff\xfe\n", "not JSON"),
        (b"x" * (wire.MAX_REQUEST + 10), "longer than"),
        (b"", "no complete request"),  # says nothing: bounded by request_timeout
        (b'{"op": "status"', "no complete request"),  # never ends its line
    ],
)
def test_bad_requests_get_one_line_and_the_endpoint_lives_on(server, payload: bytes, expected: str) -> None:  # type: ignore[no-untyped-def]
    ops, store, address = server
    reply = _raw(address, payload)
    assert reply["ok"] is False and expected in reply["error"] and "\n" not in reply["error"]
    assert wire.ask(address, {"op": "ping"})["ok"]


def test_many_idle_connections_do_not_block_others(server) -> None:  # type: ignore[no-untyped-def]
    ops, store, address = server
    idle = [socket.create_connection(address, timeout=5) for _ in range(20)]
    try:
        started = time.monotonic()
        assert wire.ask(address, {"op": "ping"}, timeout=2)["ok"]
        assert time.monotonic() - started < 1.0
    finally:
        for sock in idle:
            sock.close()


def test_client_errors_are_one_line() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(wire.OpsError, match="no tmrun job answers"):
        wire.ask(("127.0.0.1", port), {"op": "ping"}, timeout=1)
    for bad in ("nohost", "host:", "host:abc", ":80", "h:70000"):
        with pytest.raises(wire.OpsError, match="malformed"):
            wire.parse_address(bad)
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        started = time.monotonic()
        with pytest.raises(wire.OpsError, match="no answer"):
            wire.ask(("127.0.0.1", silent.getsockname()[1]), {"op": "ping"}, timeout=0.2)
        assert time.monotonic() - started < 3
    finally:
        silent.close()


def test_a_damaged_event_does_not_stop_the_log(server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ops, store, address = server
    record_event(store, "join", 0, "node 0 (h) joined")
    seq = store.add(keys.EVENT_SEQ, 1) - 1
    store.set(keys.event(seq), "{not json")
    record_event(store, "formed", 1, "formed with 1 active, 0 standby")
    kinds = [e["kind"] for e in wire.ask(address, {"op": "events", "since": 0})["events"]]
    assert kinds == ["join", "formed"]
    # a number taken but not written yet: the log waits for it, then goes on
    store.add(keys.EVENT_SEQ, 1)
    assert wire.ask(address, {"op": "events", "since": 3})["events"] == []


def test_new_events_are_read_once_and_an_unwritten_one_is_waited_for() -> None:
    import torch.distributed as dist

    from tmrun.control.events import read_new_events, record_event
    from tmrun.protocol import keys as job_keys

    store = dist.HashStore()
    record_event(store, "formed", 1, "a")
    store.add(job_keys.EVENT_SEQ, 1)  # a writer took number 1 but has not written it yet
    record_event(store, "replace", 1, "c")
    events, next_seq = read_new_events(store, 0)
    assert [e.kind for e in events] == ["formed"] and next_seq == 1
    store.set(job_keys.event(1), "not json")  # written at last, but damaged: skipped for good
    events, next_seq = read_new_events(store, next_seq)
    assert [(e.seq, e.kind) for e in events] == [(2, "replace")] and next_seq == 3
    assert read_new_events(store, next_seq) == ([], 3)
