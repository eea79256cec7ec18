"""Fuzz what a worker decodes from a peer during a handover or a heal (tmrun/worker/transfer.py):
the JSON messages on the link (the joiner's hello, a donor's offer, a choice, a receipt). Every
input decodes or raises a one-line TransferError; a decoded hello has a pid in 0..2**31-1 and a
string host, an offer's addresses are integers in 0..2**64-1.

(The leaver's header is a pickle from a process of the same job: trusted like torch's own
object collectives, and not fuzzed.)

    python tests/fuzz/fuzz_transfer.py -atheris_runs=100000
    python tests/fuzz/fuzz_transfer.py -max_total_time=150
"""

from __future__ import annotations

import json
import sys

from _harness import atheris, expect_error, json_object, main

with atheris.instrument_imports(include=["tmrun.worker.transfer"]):
    from tmrun.worker import transfer as t


def _decode(mode: int, raw: bytes) -> None:
    try:
        if mode == 0:
            pid, host = t.decode_hello(raw, 1)
            assert type(pid) is int and 0 <= pid < 1 << 31 and isinstance(host, str), (pid, host)
            return
        message = t.decode_json(raw, "offer", 1)
        assert isinstance(message, dict)
        if mode == 1:
            pid = t.peer_pid(message, "offer", 1)
            assert type(pid) is int and 0 <= pid < 1 << 31
            for name in ("stripe", "later", "now"):
                addresses = t.peer_addresses(message, name, "offer", 1)
                assert all(type(a) is int and 0 <= a < 1 << 64 for a in addresses), addresses
    except Exception as exc:  # noqa: BLE001
        expect_error(exc, t.TransferError)


def test_one_input(data: bytes) -> None:
    if len(data) < 2:
        return
    mode = data[0] % 3
    if data[1] % 2:
        raw = data[2:]
    else:
        fdp = atheris.FuzzedDataProvider(data[2:])
        raw = json.dumps(json_object(fdp, ["pid", "host", "stripe", "later", "now", "path", "ok", "error"])).encode()
    _decode(mode, raw)


def seeds() -> list[bytes]:
    return [b"\x00\x01" + json.dumps({"pid": 123, "host": "boot:ns"}).encode(),
            b"\x01\x01" + json.dumps({"pid": 9, "stripe": [140000000, 4096], "later": []}).encode(),
            b"\x02\x01" + json.dumps({"path": "memory"}).encode(),
            b"\x02\x01" + json.dumps({"ok": False, "error": "damaged"}).encode(), b"\x00\x01" + b"[" * 3000]


if __name__ == "__main__":
    main(test_one_input, seeds())
    sys.exit(0)
