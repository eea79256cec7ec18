"""Heartbeats on the links of a running operation whose part is over (in-process ranks, loopback)."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.e2e  # waits out heartbeat intervals (seconds): not in the unit subset
import torch

from conftest import buf, close_all, connect_all, dt, run_ranks, tn


@pytest.mark.timeout(60)
def test_a_link_whose_part_is_over_keeps_heartbeating_during_a_long_operation():
    """Broadcast of 16 MiB from rank 0 along the chain 0 -> 1 -> 2 (small socket buffers). Rank 2
    joins 3 s late (idle, heartbeating): rank 1 has received everything from rank 0 at once but
    stays in the broadcast, its forwarding to rank 2 blocked. Rank 0 is done and waits in a recv
    from rank 1 with timeout 1 s. Before the fix rank 1 sent nothing on its link to rank 0 (the
    link's part of the broadcast was over, and idle ticks skip op links), so rank 0 declared
    rank 1 lost after 1 s (PeerLostError(peer=1)); now it heartbeats that link and everything
    completes."""
    n, nbytes = 3, 16 << 20
    small = dict(socket_buffer=64 * 1024, op_timeout=8.0)
    opts = [
        dict(timeout=1.0, **small),
        dict(timeout=4.0, heartbeat_interval=0.1, **small),
        dict(timeout=4.0, **small),
    ]
    comms = [tn.Communicator(r, n, "ophb", 0, tn.Options(**opts[r])) for r in range(n)]
    try:
        connect_all(comms)

        def body(c):
            x = torch.full((nbytes,), 7 if c.rank == 0 else 0, dtype=torch.uint8)
            one = torch.zeros(1, dtype=torch.uint8)
            if c.rank == 2:
                time.sleep(3.0)
            t0 = time.monotonic()
            try:
                c.broadcast(buf(x), dtype=dt(x), root=0)
                if c.rank == 0:
                    c.recv(buf(one), src=1)
                elif c.rank == 1:
                    one.fill_(5)
                    c.send(buf(one), dst=0)
            except tn.PeerLostError as e:
                return ("lost", e.peer, e.reporter, time.monotonic() - t0)
            except tn.CommError as e:
                return (type(e).__name__, str(e), time.monotonic() - t0)
            return ("ok", int(x[0]), int(x[-1]), int(one[0]), time.monotonic() - t0)

        res, _ = run_ranks(comms, body, timeout=40)
        assert res[0][:4] == ("ok", 7, 7, 5), res[0]
        assert res[0][4] > 2.0, res[0]  # rank 0 did wait on rank 1 for longer than its timeout
        assert res[1][:3] == ("ok", 7, 7) and res[2][:3] == ("ok", 7, 7), res
    finally:
        close_all(comms)
