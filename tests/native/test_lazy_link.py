"""Opening a lazy point-to-point link must not silence a rank: while it dials (retrying until
connect_timeout, or waiting for the handshake reply) it keeps heartbeating on its other links, so
neighbours waiting on it do not declare it lost (in-process ranks, loopback only)."""

from __future__ import annotations

import socket
import time

import pytest

pytestmark = pytest.mark.e2e  # waits out heartbeat intervals (seconds): not in the unit subset
import torch

from conftest import buf, close_all, run_ranks, tn


@pytest.mark.timeout(60)
@pytest.mark.parametrize("target", ["refused", "silent"])
def test_heartbeats_flow_while_a_lazy_link_is_dialled(target):
    """World 4: rank 2 is not a ring neighbour of rank 0, so send(dst=2) opens a lazy link. Rank 0
    is given an address for rank 2 where nobody answers: "refused" (a bound, non-listening port:
    connection refused, retried every 50 ms) or "silent" (a listening port nobody accepts on: the
    connection opens but the handshake reply never comes). The dial fails after connect_timeout
    (3 s); then rank 0 sends to rank 1, which waits in a recv from rank 0 with a 1.5 s liveness
    timeout all along. Before the fix the dial held the operation lock without servicing any link,
    rank 0 sent no heartbeat for 3 s and rank 1 raised PeerLostError (rank 0 stopped answering)
    after 1.5 s; with it rank 1 receives the message."""
    n = 4
    opts = [
        dict(timeout=4.0, heartbeat_interval=0.1, connect_timeout=3.0),
        dict(timeout=1.5, op_timeout=20.0),
        dict(timeout=4.0),
        dict(timeout=4.0),
    ]
    sink = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    comms = []
    try:
        sink.bind(("127.0.0.1", 0))
        if target == "silent":
            sink.listen(8)
        bogus = "127.0.0.1:%d" % sink.getsockname()[1]
        comms = [tn.Communicator(r, n, "lazydial", 0, tn.Options(**opts[r])) for r in range(n)]
        addrs = [c.address for c in comms]
        seen = {r: list(addrs) for r in range(n)}
        seen[0][2] = bogus  # only rank 0's view; ring links (1, 3) are unaffected
        run_ranks(comms, lambda c: c.connect(seen[c.rank]), timeout=30)

        def body(c):
            x = torch.full((4,), 7, dtype=torch.uint8)
            t0 = time.monotonic()
            if c.rank == 0:
                try:
                    c.send(buf(x), dst=2)
                    dial = ("connected",)
                except tn.CommError as e:
                    dial = (type(e).__name__, str(e), time.monotonic() - t0)
                c.send(buf(x), dst=1)
                return dial
            if c.rank == 1:
                y = torch.zeros(4, dtype=torch.uint8)
                try:
                    c.recv(buf(y), src=0)
                except Exception as e:  # noqa: BLE001
                    return (type(e).__name__, str(e), time.monotonic() - t0)
                return ("received", y.tolist(), time.monotonic() - t0)
            return None

        res, _ = run_ranks(comms, body, timeout=30)
        assert res[0][0] == "CommError" and "cannot connect to rank 2" in res[0][1], res[0]
        assert res[0][2] >= 2.5, res[0]  # the dial really lasted about connect_timeout
        assert res[1][0] == "received" and res[1][1] == [7] * 4, res[1]
        assert comms[0].failure() == "" and comms[1].failure() == ""
    finally:
        close_all(comms)
        sink.close()
