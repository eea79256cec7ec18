"""The communicator's goodbye (issue 31): a rank that closes its communicator right after an
operation is not a lost rank to a peer still finishing that operation; one that is needed later
is (in-process ranks, loopback only)."""

from __future__ import annotations

import time

import pytest
import torch

from conftest import buf, close_all, dt, make_group, run_ranks, tn


@pytest.mark.parametrize("delay", [0.0, 0.005, 0.02])
def test_a_root_that_closes_right_after_its_broadcast_does_not_fail_the_others(delay: float) -> None:
    """Before the goodbye, closing reset connections with unread heartbeats: an idle peer saw
    'Connection reset by peer', announced rank 0 lost, and a peer still receiving the broadcast
    (it had every byte it needed) failed (12 runs in 20)."""
    for attempt in range(5):
        comms = make_group(4, job=f"goodbye-bcast-{attempt}", timeout=5.0, heartbeat_interval=0.01)
        try:
            def body(c):  # type: ignore[no-untyped-def]
                if c.rank >= 2:
                    time.sleep(delay * (1 + attempt % 3))  # the late ranks are still in it
                t = torch.full((1 << 18,), float(c.rank))
                c.broadcast(buf(t), 0, dtype=dt(t))
                if c.rank == 0:
                    c.close()
                return float(t[0]), float(t[-1])

            results, _ = run_ranks(comms, body)
            assert results == [(0.0, 0.0)] * 4
        finally:
            close_all(comms)


def test_a_peer_that_left_fails_only_the_operations_that_need_it() -> None:
    """Rank 0 closes: an operation among the others goes on; one that needs rank 0 fails at once
    with the peer named (not a hang until the timeout); wait_failure names it meanwhile."""
    comms = make_group(3, job="goodbye-needed", timeout=30.0, heartbeat_interval=0.01)
    try:
        comms[0].close()
        found = comms[1].wait_failure(10.0)
        assert found is not None and found[1] == 0 and "closed its communicator" in found[3], found
        x = torch.ones(8)
        comms[1].send(buf(x), 2, 7)
        y = torch.zeros(8)
        comms[2].recv(buf(y), 1, 7)
        assert torch.equal(y, x)  # ranks 1 and 2 go on between themselves
        started = time.monotonic()
        with pytest.raises(tn.PeerLostError, match="rank 0 lost: it closed its communicator"):
            t = torch.ones(4)
            comms[1].send(buf(t), 0, 1)
        assert time.monotonic() - started < 5
    finally:
        close_all(comms[1:])


def test_close_is_bounded_when_a_peer_never_reads() -> None:
    """The goodbye waits for the peers' ends for half a second at most."""
    comms = make_group(2, job="goodbye-bounded", timeout=30.0)
    try:
        started = time.monotonic()
        comms[0].close()
        assert time.monotonic() - started < 3
    finally:
        close_all(comms[1:])
