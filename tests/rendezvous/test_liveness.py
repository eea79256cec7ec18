"""Liveness: an agent that says goodbye has departed (the leader logs it as "left"), one that
vanishes is lost."""

from __future__ import annotations

import time

from tmrun.rendezvous.liveness import LivenessBeacon, LivenessMonitor


def _poll_until(monitor: LivenessMonitor, lost: list, done, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not done():
        monitor.poll(0.05, lambda node, why: lost.append((node, why)))


def test_goodbye_is_a_departure_not_a_loss() -> None:
    monitor = LivenessMonitor("run", heartbeat_timeout=30)
    try:
        polite = LivenessBeacon("127.0.0.1", monitor.port, "run", 4, interval=0.05)
        rude = LivenessBeacon("127.0.0.1", monitor.port, "run", 5, interval=0.05)
        lost: list = []
        departed: list[int] = []
        _poll_until(monitor, lost, lambda: len(monitor._peers) == 2 and all(  # noqa: SLF001
            p.node_id is not None for p in monitor._peers.values()))  # noqa: SLF001
        polite.close()
        rude._stop.set()  # noqa: SLF001 - dies without a goodbye
        rude._sock.close()  # noqa: SLF001

        def both_seen() -> bool:
            departed.extend(monitor.take_departed())
            return bool(departed) and bool(lost)

        _poll_until(monitor, lost, both_seen)
        assert departed == [4] and [node for node, _ in lost] == [5]
        assert monitor.take_departed() == []
    finally:
        monitor.close()
