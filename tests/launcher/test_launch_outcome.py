"""The launch sequence's outcome when the job's store is gone by the time this node closes the job:
the node's own outcome (a stop signal's exit code, its workers' failure, their success) stands, in
one line at most, with no traceback. Seen under SLURM: the store's host lost, then SLURM's SIGTERM
to every other node of the job."""

from __future__ import annotations

import signal
from typing import Any

import pytest
from torch.distributed import DistNetworkError
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from tmrun.launcher import launch, stop_signals
from tmrun.protocol.membership import Phase


class _GoneStoreHandler:
    """A rendezvous handler whose store's host is gone: every store call fails."""

    is_host = False
    node_id = 1
    epoch = 1
    store = None

    def __init__(self, store_up: bool = False) -> None:
        self.store_up = store_up
        self.store_lost = False
        self.closed: list[tuple[Phase, str]] = []

    def close(self, phase: Phase, reason: str) -> None:
        if not self.store_up:
            raise DistNetworkError("Broken pipe")
        self.closed.append((phase, reason))

    def is_standing_by(self) -> bool:
        return False


class _Agent:
    def __init__(self, outcome: Any) -> None:
        self.outcome = outcome

    def run(self) -> RunResult:
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


@pytest.fixture(autouse=True)
def _fresh_stop_signals(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stop_signals, "_stop_signals", stop_signals.StopSignals("SIGTERM"))


def test_a_stop_signal_after_the_store_was_lost_exits_with_the_signals_code(capsys: pytest.CaptureFixture[str]) -> None:
    handler = _GoneStoreHandler()
    agent = _Agent(SignalException("got SIGTERM", sigval=signal.SIGTERM))
    assert launch._run(agent, handler) == 128 + signal.SIGTERM  # type: ignore[arg-type]
    assert handler.store_lost
    err = capsys.readouterr().err
    assert err.count("received SIGTERM; stopping the workers") == 1, err


def test_workers_failed_after_the_store_was_lost_is_the_one_line_error() -> None:
    failure = ProcessFailure(local_rank=0, pid=1234, exitcode=1, error_file="")
    agent = _Agent(RunResult(state=WorkerState.FAILED, failures={1: failure}))
    with pytest.raises(launch.LaunchError, match="workers failed and no restarts are left: rank 1 exit code 1"):
        launch._run(agent, _GoneStoreHandler())  # type: ignore[arg-type]


def test_workers_finished_after_the_store_was_lost_is_this_nodes_success() -> None:
    handler = _GoneStoreHandler()
    assert launch._run(_Agent(RunResult(state=WorkerState.SUCCEEDED)), handler) == 0  # type: ignore[arg-type]
    assert handler.store_lost


def test_with_the_store_up_the_job_is_closed_for_every_node() -> None:
    handler = _GoneStoreHandler(store_up=True)
    agent = _Agent(SignalException("got SIGTERM", sigval=signal.SIGTERM))
    assert launch._run(agent, handler) == 128 + signal.SIGTERM  # type: ignore[arg-type]
    assert handler.closed == [(Phase.FAILED, "an agent received SIGTERM")] and not handler.store_lost
