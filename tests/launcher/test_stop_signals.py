"""The agent's stop signals: the first raises torch's SignalException, a second one during the
shutdown it started does not break that shutdown (SLURM's scancel and time limit signal twice)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent(
    """
    import logging, os, signal, sys
    from torch.distributed.elastic.multiprocessing.api import SignalException, _terminate_process_handler
    from tmrun.launcher.stop_signals import handle_stop_signals, reinstall_stop_signals

    handle_stop_signals("SIGTERM,SIGINT")
    if sys.argv[1] == "after-torch":
        signal.signal(signal.SIGTERM, _terminate_process_handler)  # what torch does when it starts workers
        reinstall_stop_signals()
    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        print("not interrupted")
    except SignalException as exc:
        # the shutdown the first signal started: a log call, then the second signal in it
        logging.warning("received %s, shutting down", exc.sigval.name)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        logging.warning("shutdown finished")
        sys.exit(128 + int(exc.sigval))
    """
)


def _run(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, timeout=60)


@pytest.mark.e2e  # starts a process that imports torch: not in the unit subset
def test_second_signal_does_not_break_the_shutdown() -> None:
    done = _run("first")
    assert done.returncode == 128 + 15, done.stderr
    assert "not interrupted" not in done.stdout
    assert "shutdown finished" in done.stdout, done.stderr
    assert "Traceback" not in done.stderr and "Logging error" not in done.stderr, done.stderr
    assert "SIGTERM again while stopping after SIGTERM" in done.stderr
    assert "SIGINT again while stopping after SIGTERM" in done.stderr


@pytest.mark.e2e  # starts a process that imports torch: not in the unit subset
def test_one_shot_again_after_torch_installed_its_handler() -> None:
    done = _run("after-torch")
    assert done.returncode == 128 + 15, done.stderr
    assert "shutdown finished" in done.stdout and "Traceback" not in done.stderr, done.stderr


class _Handler:
    def __init__(self, standing_by: bool) -> None:
        self.standing_by = standing_by

    def is_standing_by(self) -> bool:
        return self.standing_by


def test_the_stop_is_announced_once_with_the_members_role(capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Said when the signal reaches the agent's run (before torch stops the workers: SLURM may
    SIGKILL the task a moment later), and not again when the launch sequence sees it."""
    import signal

    from tmrun.launcher import stop_signals

    monkeypatch.setattr(stop_signals, "_stop_signals", stop_signals.StopSignals("SIGTERM"))
    stop_signals.announce_stop(_Handler(standing_by=True), signal.SIGTERM)
    stop_signals.announce_stop(_Handler(standing_by=True), signal.SIGTERM)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].endswith("received SIGTERM while standing by; this standby leaves")
    monkeypatch.setattr(stop_signals, "_stop_signals", stop_signals.StopSignals("SIGTERM"))
    stop_signals.announce_stop(None, signal.SIGINT)
    assert capsys.readouterr().err.rstrip().endswith("received SIGINT; stopping the workers")
