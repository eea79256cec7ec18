"""``Communicator.wait_failure``: a thread learns of a loss the moment the communicator records
it, while no operation runs (in-process ranks, loopback only).

The heartbeat interval is long (a 600 s timeout: an idle tick every 75 s), so only the service
loop's watch on the links' hang-ups can record the loss within the tests' bounds."""

from __future__ import annotations

import threading

import pytest

from conftest import close_all, make_group
from tmrun.worker.loss_watch import LossWatcher

BOUND = 10.0  # seconds; far below the 75 s to the next idle tick


def test_a_peer_that_closes_is_reported_to_a_waiting_thread_while_idle():
    comms = make_group(2, job="waitfail", timeout=600.0)
    try:
        found: list = []
        waiter = threading.Thread(target=lambda: found.append(comms[0].wait_failure(BOUND)))
        waiter.start()
        comms[1].close()  # the peer's sockets hang up, as when its process dies
        waiter.join(BOUND + 5)
        assert not waiter.is_alive()
        assert found and found[0] is not None, "the loss was not recorded while idle"
        epoch, peer, protocol, message = found[0]
        assert (epoch, peer, protocol) == (0, 1, False)
        assert "rank 1 lost: it closed its communicator" in message
        # a clean leave (its goodbye) is named here, but is not the epoch's sticky failure: an
        # operation that does not need rank 1 would go on (tests/native/test_goodbye.py)
        assert comms[0].failure() == ""
        # the same epoch's failure is not handed out twice
        assert comms[0].wait_failure(0.2, ignore_epoch=0) is None
    finally:
        close_all(comms)


def test_wait_failure_times_out_when_healthy_and_returns_at_close():
    comms = make_group(2, job="waitquiet", timeout=600.0)
    try:
        assert comms[0].wait_failure(0.1) is None
        found: list = []
        waiter = threading.Thread(target=lambda: found.append(comms[0].wait_failure(BOUND)))
        waiter.start()
        closer = threading.Timer(0.2, comms[0].close)
        closer.start()
        waiter.join(BOUND + 5)
        closer.join(BOUND + 5)  # before close_all closes it again: no two close() at once
        assert not waiter.is_alive() and not closer.is_alive() and found == [None]
    finally:
        close_all(comms)


def test_wait_failure_rejects_a_bad_timeout():
    comms = make_group(1, job="waitbad")
    try:
        for bad in (-1.0, float("nan"), 1e9):
            with pytest.raises(ValueError, match="timeout"):
                comms[0].wait_failure(bad)
    finally:
        close_all(comms)


def test_loss_watcher_hands_each_loss_on_once():
    comms = make_group(2, job="watcher", timeout=600.0)
    seen: list[tuple[int, int, bool, str]] = []
    got = threading.Event()

    def on_loss(epoch: int, lost: int, protocol: bool, message: str) -> None:
        seen.append((epoch, lost, protocol, message))
        got.set()

    watcher = LossWatcher(lambda: comms[0], on_loss)
    watcher.start()
    try:
        comms[1].close()
        assert got.wait(BOUND), "the watcher did not hand the loss on"
        watcher.stop()
        assert [(e, lost, p) for e, lost, p, _ in seen] == [(0, 1, False)]
    finally:
        watcher.stop()
        close_all(comms)


def test_loss_watcher_skips_a_group_without_communicator():
    calls: list = []
    watcher = LossWatcher(lambda: None, lambda *a: calls.append(a))
    watcher.start()
    watcher.stop()
    assert calls == []
