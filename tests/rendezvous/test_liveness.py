"""Liveness: an agent that says goodbye has departed (the leader logs it as "left"), one that
vanishes is lost."""

from __future__ import annotations

import time

from tmrun.rendezvous.liveness import LivenessBeacon, LivenessMonitor


def _poll_until(monitor: LivenessMonitor, lost: list, done, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not done():
        monitor.poll(0.05, lambda node, why, _silent: lost.append((node, why)))


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


def test_silent_and_foreign_connections_are_dropped_and_the_agent_stays(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A port scanner's connections (silent, garbage, a huge node id) never become peers, never
    hold a file descriptor past the hello timeout, and never cost the real agent anything."""
    import socket

    from tmrun.rendezvous import liveness

    monkeypatch.setattr(liveness, "HELLO_TIMEOUT", 0.3)
    monitor = LivenessMonitor("run", heartbeat_timeout=30)
    agent = LivenessBeacon("127.0.0.1", monitor.port, "run", 3, interval=0.05)
    noise = [socket.create_connection(("127.0.0.1", monitor.port)) for _ in range(3)]
    try:
        noise[1].sendall(b"\x00garbage\n")
        noise[2].sendall(liveness.HELLO + b"run " + b"9" * 4400 + b"\n")  # int() would raise ValueError
        lost: list = []
        _poll_until(monitor, lost, lambda: [p.node_id for p in monitor._peers.values()] == [3],  # noqa: SLF001
                    timeout=5.0)
        assert [p.node_id for p in monitor._peers.values()] == [3]  # noqa: SLF001
        assert lost == []
    finally:
        for sock in noise:
            sock.close()
        agent.close()
        monitor.close()


def test_a_lost_node_says_how_long_it_was_silent() -> None:
    """The leader dates a lost node's failure from its last heartbeat: a closed connection is
    silent for 0 s, a heartbeat timeout for at least the timeout (measured, not the reason's text)."""
    monitor = LivenessMonitor("run", heartbeat_timeout=0.5)
    try:
        closed = LivenessBeacon("127.0.0.1", monitor.port, "run", 6, interval=0.05)
        quiet = LivenessBeacon("127.0.0.1", monitor.port, "run", 7, interval=0.05)
        silences: dict[int, float] = {}

        def poll_until(done) -> None:  # type: ignore[no-untyped-def]
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline and not done():
                monitor.poll(0.05, lambda node, why, silent: silences.__setitem__(node, silent))

        poll_until(lambda: sum(p.node_id is not None for p in monitor._peers.values()) == 2)  # noqa: SLF001
        closed._stop.set()  # noqa: SLF001 - dies without a goodbye
        closed._sock.close()  # noqa: SLF001
        quiet._stop.set()  # noqa: SLF001 - stops its heartbeats, its connection stays open
        poll_until(lambda: len(silences) == 2)
        assert silences[6] == 0.0
        assert 0.5 < silences[7] < 3.0, silences
    finally:
        quiet._sock.close()  # noqa: SLF001
        monitor.close()
