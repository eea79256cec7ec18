"""Abort-notice forwarding: a loss that a rank notices itself, on a link outside its running
operation, must end that operation at once (in-process ranks, loopback only)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from conftest import buf, close_all, connect_all, dt, run_ranks, tn


@pytest.mark.timeout(60)

def _recv_from_partner(c):
    """Ranks 0 and 1 wait on each other; what ended the wait, and after how long."""
    x = torch.zeros(1, dtype=torch.uint8)
    t0 = time.monotonic()
    try:
        c.recv(buf(x), src=1 - c.rank)
    except tn.PeerLostError as e:
        return ("lost", e.peer, e.reporter, time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001
        return (type(e).__name__, str(e), time.monotonic() - t0)
    return ("completed",)


def test_loss_noticed_outside_the_running_operation_ends_it():
    """Rank 0 waits in a recv from rank 1 (rank 1 waits in a recv from rank 0) when its other
    neighbour, rank 2, closes. Rank 0's in-operation idle tick (every 0.05 s: short heartbeat
    interval) notices first, records the loss and sends the abort notice to rank 1; rank 1's own
    idle tick only comes 2 s into its operation, so it learns of the loss from rank 0, raises, and
    (the notice came from rank 0) sends nothing back. Rank 0 must raise on its own notice: before
    the fix it kept waiting on rank 1, whose idle heartbeats kept the link alive, until op_timeout
    (CommTimeoutError after 8 s here, 300 s by default)."""
    n, victim = 3, 2
    opts = [
        dict(timeout=4.0, heartbeat_interval=0.05, op_timeout=8.0),  # notices within 0.05 s
        dict(timeout=4.0, heartbeat_interval=2.0, op_timeout=8.0),   # first idle tick at 2 s
        dict(timeout=4.0),
    ]
    comms = [tn.Communicator(r, n, "abortfwd", 0, tn.Options(**opts[r])) for r in range(n)]
    try:
        connect_all(comms)

        def body(c):
            if c.rank == victim:
                time.sleep(0.3)
                c._debug_vanish()  # as a killed process: no goodbye (a goodbye is a clean leave)
                return None
            return _recv_from_partner(c)

        res, _ = run_ranks(comms, body, timeout=30)
        for r in (0, 1):
            assert res[r][0] == "lost", (r, res[r])
            assert res[r][1] == victim, (r, res[r])
            # the interleaving under test: rank 0 noticed, rank 1 learned it from rank 0
            assert res[r][2] == 0, (r, res[r])
            assert res[r][3] < 2.0, (r, res[r])
    finally:
        close_all(comms)


@pytest.mark.e2e  # over half a second: waits out a timeout (the unit subset stays within a minute)
@pytest.mark.timeout(90)
def test_operation_timeout_is_announced_to_the_other_ranks():
    """Ranks 0-2 enter an allreduce that rank 3 (alive, heartbeating, but busy elsewhere) joins
    only after they are done. Rank 0 has a short op_timeout (1 s), the others 8 s. Rank 0 gives
    up at 1 s and must announce it (abort notice, lost rank unknown): rank 1 (waiting on rank 0)
    learns it directly, rank 2 (waiting on rank 3) through rank 3's or rank 1's forwarding, and
    rank 3's next operation raises at once. Before the fix rank 0 told nobody: ranks 1 and 2 kept
    receiving heartbeats and each waited out its own op_timeout (CommTimeoutError after 8 s)."""
    n = 4
    opts = [dict(timeout=4.0, op_timeout=1.0)] + [dict(timeout=4.0, op_timeout=8.0)] * 3
    comms = [tn.Communicator(r, n, "optimeout", 0, tn.Options(**opts[r])) for r in range(n)]
    finished = threading.Semaphore(0)
    try:
        connect_all(comms)

        def body(c):
            x = torch.ones(1, dtype=torch.float32)
            if c.rank == 3:  # busy until the others are done
                for _ in range(3):
                    assert finished.acquire(timeout=30)
            t0 = time.monotonic()
            try:
                c.allreduce(buf(x), dtype=dt(x))
                res = ("completed",)
            except tn.CommTimeoutError as e:
                res = ("timeout", str(e), time.monotonic() - t0)
            except tn.PeerLostError as e:
                res = ("lost", e.peer, e.reporter, str(e), time.monotonic() - t0)
            except Exception as e:  # noqa: BLE001
                res = (type(e).__name__, str(e), time.monotonic() - t0)
            if c.rank != 3:
                finished.release()
            return res

        res, _ = run_ranks(comms, body, timeout=60)
        assert res[0][0] == "timeout", res[0]
        for r in (1, 2):  # promptly, not after their own op_timeout (8 s)
            assert res[r][0] == "lost" and res[r][1] == -1, (r, res[r])
            assert "timed out" in res[r][3], (r, res[r])
            assert res[r][4] < 4.0, (r, res[r])
        assert res[1][2] == 0, res[1]  # rank 1 heard it from rank 0 itself
        assert res[3][0] == "lost" and res[3][1] == -1 and res[3][4] < 1.0, res[3]  # epoch poisoned
    finally:
        close_all(comms)


@pytest.mark.timeout(60)
def test_a_notice_is_echoed_to_the_rank_that_sent_it():
    """Safety net: a rank that receives an abort notice answers with the notice too, also to the
    rank it came from, so a sender that does not itself stop (simulated here: rank 0 writes the
    notice as raw bytes and records nothing) still learns that its peer gave up. Rank 0 then waits
    in a recv from rank 1; rank 1 has given up (its receive raises) but its idle heartbeats keep
    the link alive. Before the fix rank 0 waited until op_timeout (8 s here, unbounded with
    op_timeout=0); with it rank 0 raises at once (PeerLostError, reported by rank 1)."""
    n, lost = 3, 2
    opts = [
        dict(timeout=4.0, heartbeat_interval=30.0, op_timeout=8.0),  # no heartbeat races the raw frame
        dict(timeout=4.0, op_timeout=8.0),
        dict(timeout=4.0),
    ]
    comms = [tn.Communicator(r, n, "echo", 0, tn.Options(**opts[r])) for r in range(n)]
    try:
        connect_all(comms)
        # sequence numbers start at 1 (the hello is 0): the next frame on the link is frames_sent + 1
        seq = next(l["frames_sent"] for l in comms[0].links() if l["peer"] == 1) + 1
        comms[0]._debug_send_raw(1, tn.encode_frame(5, b"", job_id="echo", epoch=0, seq=seq, tag=lost))

        def body(c):
            return None if c.rank == lost else _recv_from_partner(c)

        res, _ = run_ranks(comms, body, timeout=30)
        assert res[1][:3] == ("lost", lost, 0), res[1]
        assert res[0][:3] == ("lost", lost, 1), res[0]
        assert res[0][3] < 4.0, res[0]
        assert comms[0].failure() and comms[1].failure()
    finally:
        close_all(comms)


@pytest.mark.timeout(60)
def test_a_peer_in_a_new_epoch_ends_the_operation_and_is_announced():
    """Rank 1 commits epoch 1 (prepare([]) + commit()) while rank 0 waits in a recv from it and
    rank 2 waits in a recv from rank 0: rank 0 reads rank 1's sync of epoch 1 where it expects
    data. Rank 0 must record the failure of epoch 0 (lost rank unknown: rank 1 is alive, nobody is
    to be fenced) and announce it, so that rank 2 stops at once. Before the fix rank 0 raised a
    plain CommError and recorded nothing (failure() stayed ''), and rank 2, kept alive by rank 0's
    heartbeats, waited out its op_timeout (CommTimeoutError after 5 s here). Afterwards ranks 0 and
    2 commit epoch 1 too (once both receives ended) and the three ranks work on: rank 1's sync
    waited on rank 0's link."""
    n = 3
    opts = dict(timeout=4.0, heartbeat_interval=0.05, op_timeout=5.0)
    comms = [tn.Communicator(r, n, "epochswitch", 0, tn.Options(**opts)) for r in range(n)]
    try:
        connect_all(comms)
        failures = {}
        gate = threading.Barrier(2)  # ranks 0 and 2 commit once both receives ended

        def body(c):
            x = torch.zeros(1, dtype=torch.uint8)
            res = ("none",)
            if c.rank == 1:
                time.sleep(0.5)  # ranks 0 and 2 are in their receives
                c.prepare([], {}, 1)
            else:
                t0 = time.monotonic()
                try:
                    c.recv(buf(x), src=1 if c.rank == 0 else 0)
                    res = ("completed",)
                except tn.PeerLostError as e:
                    res = ("lost", e.peer, e.reporter, str(e), time.monotonic() - t0)
                except Exception as e:  # noqa: BLE001
                    res = (type(e).__name__, str(e), time.monotonic() - t0)
                failures[c.rank] = c.failure()
                gate.wait(timeout=20)
                c.prepare([], {}, 1)
            c.commit()
            y = torch.ones(1, dtype=torch.float32)
            c.allreduce(buf(y), dtype=dt(y))
            return res, c.epoch, float(y[0])

        res, _ = run_ranks(comms, body, timeout=40)
        r0, r2 = res[0][0], res[2][0]
        assert r0[:3] == ("lost", -1, 0), r0
        assert "switched to epoch 1" in r0[3], r0
        assert "switched to epoch 1" in failures[0], failures  # recorded for epoch 0
        assert r2[:3] == ("lost", -1, 0), r2  # rank 0's notice, not its own op_timeout
        assert r2[4] < 3.0, r2
        for r in range(n):  # the new epoch works
            assert res[r][1:] == (1, 3.0), (r, res[r])
    finally:
        close_all(comms)


@pytest.mark.e2e  # slow: waits out a protocol timeout (over a second), not in the unit subset
@pytest.mark.timeout(60)
def test_a_notice_on_a_link_whose_part_is_over_ends_the_operation():
    """Issue 16, bug 2 (a hang under CPU load: a rank's allreduce never completed after a
    neighbour closed). Forced interleaving: four ranks broadcast 32 MB from rank 0 (chain
    0 -> 1 -> 2 and 0 -> 3). Rank 2 is busy elsewhere, so rank 1 is stuck forwarding to it while
    its part on rank 0's link is over. Rank 0, done, then sends rank 1 an abort notice (raw bytes:
    what a rank that learnt of a loss forwards). Before the fix rank 1 never read a link whose part
    was over, so the notice waited behind the operation; its only other link was kept alive by rank
    2's heartbeats: rank 1 hung until rank 2 came (forever, when rank 2 itself waits on rank 1 in
    another operation, as under load). With the fix rank 1 raises within its notice timeout."""
    n = 4
    opts = [dict(timeout=2.0, heartbeat_interval=30.0, op_timeout=0.0)] + [dict(timeout=2.0, op_timeout=0.0)] * 3
    comms = [tn.Communicator(r, n, "overlink", 0, tn.Options(**opts[r])) for r in range(n)]
    root_done = threading.Event()
    injected: list[float] = []
    try:
        connect_all(comms)

        def body(c):
            x = torch.ones(8 * 1024 * 1024, dtype=torch.float32) * (c.rank + 1)
            if c.rank == 2:  # busy until well after the notice
                time.sleep(6.0)
            try:
                c.broadcast(buf(x), root=0, dtype=dt(x))
                res = ("completed", time.monotonic())
            except tn.CommError as e:
                res = ("failed", time.monotonic(), str(e))
            if c.rank == 0:
                root_done.set()
            return res

        def inject():
            assert root_done.wait(30)
            seq = next(l["frames_sent"] for l in comms[0].links() if l["peer"] == 1) + 1
            comms[0]._debug_send_raw(1, tn.encode_frame(5, b"", job_id="overlink", epoch=0, seq=seq, tag=2))
            injected.append(time.monotonic())

        injector = threading.Thread(target=inject, daemon=True)
        injector.start()
        res, _ = run_ranks(comms, body, timeout=40, raise_errors=False)
        injector.join(5)
        assert res[0][0] == "completed" and injected, res
        assert res[1][0] == "failed" and "rank 2 lost" in res[1][2], res[1]
        assert res[1][1] - injected[0] < 4.0, (res[1], injected)  # not after rank 2 came at 6 s
        assert res[2][0] == "failed", res[2]  # rank 2 is told too (never hangs)
    finally:
        close_all(comms)
