"""SIGTERM to a standby worker: a waiting standby leaves at once (``exit_now``: it holds nothing
to save; it used to finish the module it was importing ahead first); a promoted one exits once,
and a second SIGTERM while it exits (SLURM signals every process of a step and the agent its
workers) does nothing (it used to raise again inside atexit handlers: a traceback)."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from tmrun.worker.roles import Lifecycle, Role
from tmrun.worker.standby import Standby


def _standby(role: Role) -> tuple[Standby, SimpleNamespace]:
    ctx = SimpleNamespace(stop_requested=False, life=Lifecycle(role))
    return Standby(ctx, recovery=None, migration=None), ctx  # type: ignore[arg-type]


def test_waiting_standby_leaves_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    left: list[int] = []

    def exit_now(status: int) -> None:
        left.append(status)
        raise SystemExit(status)  # os._exit in the worker; here it must not end pytest

    monkeypatch.setattr("tmrun.worker.standby.exit_now", exit_now)
    standby, ctx = _standby(Role.STANDBY)
    with pytest.raises(SystemExit):
        standby.on_term(signal.SIGTERM, None)
    assert left == [0] and ctx.stop_requested
    standby.on_term(signal.SIGTERM, None)  # a second one while it leaves: nothing
    assert left == [0]


def test_promoted_standby_exits_once() -> None:
    standby, ctx = _standby(Role.ACTIVE)
    with pytest.raises(SystemExit) as exited:
        standby.on_term(signal.SIGTERM, None)
    assert exited.value.code == 128 + signal.SIGTERM
    standby.on_term(signal.SIGTERM, None)  # the second one, during the exit: nothing
    assert ctx.stop_requested
