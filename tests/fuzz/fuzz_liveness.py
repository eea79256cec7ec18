"""Fuzz the liveness line protocol (tmrun/rendezvous/liveness.py): whatever a connection to
the leader's liveness listener sends, in whatever pieces, ``read_hello`` says wait, refuse or a
node id (an int >= 0, only for ``TMRUN-LIVE1 <this run id> <digits>``), never raises, and a
connection is settled within MAX_HELLO bytes. An agent's own hello parses to its node id.

    python tests/fuzz/fuzz_liveness.py -atheris_runs=100000
    python tests/fuzz/fuzz_liveness.py -max_total_time=150
"""

from __future__ import annotations

import sys

from _harness import atheris, main

with atheris.instrument_imports(include=["tmrun.rendezvous.liveness"]):
    from tmrun.rendezvous import liveness as lv

RUN = b"run-7f3a"


def test_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    if fdp.ConsumeIntInRange(0, 3) == 0:  # an agent's hello, with any run id and node id
        run = fdp.ConsumeUnicodeNoSurrogates(20).replace(" ", "").replace("\n", "").encode()
        node = fdp.ConsumeIntInRange(0, 10**18 - 1)
        line = lv.HELLO + run + b" " + str(node).encode()
        got = lv.read_hello(line + b"\n" + fdp.ConsumeBytes(8), run)
        assert got == node if len(line) < lv.MAX_HELLO else got is False, (line, got)
        return
    buffer = b""
    settled: object = None
    while fdp.remaining_bytes():
        buffer += fdp.ConsumeBytes(fdp.ConsumeIntInRange(1, 600))
        settled = lv.read_hello(buffer, RUN)
        assert settled is None or settled is False or (type(settled) is int and settled >= 0), settled
        if settled is not None:
            break
    if settled is None:
        assert len(buffer) < lv.MAX_HELLO and b"\n" not in buffer, buffer
    elif settled is not False:
        assert buffer.startswith(lv.HELLO + RUN + b" "), buffer


def seeds() -> list[bytes]:
    return [b"\x00" + lv.HELLO + RUN + b" 3\n", b"\x01" + lv.HELLO + RUN + b" 12\n.",
            b"\x01" + lv.HELLO + RUN + b" " + b"9" * 5000 + b"\n", b"\x02" + b"x" * 300, b"\x03!"]


if __name__ == "__main__":
    main(test_one_input, seeds())
    sys.exit(0)
