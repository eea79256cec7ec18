"""SIGTERM to a standby worker: a waiting standby stops at its next check; a promoted one exits
once, and a second SIGTERM while it exits (SLURM signals every process of a step and the agent
its workers) does nothing (it used to raise again inside atexit handlers: a traceback)."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from tmrun.worker.roles import Lifecycle, Role
from tmrun.worker.standby import Standby


def _standby(role: Role) -> tuple[Standby, SimpleNamespace]:
    ctx = SimpleNamespace(stop_requested=False, life=Lifecycle(role))
    return Standby(ctx, recovery=None, migration=None), ctx  # type: ignore[arg-type]


def test_waiting_standby_stops_at_its_next_check() -> None:
    standby, ctx = _standby(Role.STANDBY)
    standby.on_term(signal.SIGTERM, None)
    assert ctx.stop_requested


def test_promoted_standby_exits_once() -> None:
    standby, ctx = _standby(Role.ACTIVE)
    with pytest.raises(SystemExit) as exited:
        standby.on_term(signal.SIGTERM, None)
    assert exited.value.code == 128 + signal.SIGTERM
    standby.on_term(signal.SIGTERM, None)  # the second one, during the exit: nothing
    assert ctx.stop_requested
