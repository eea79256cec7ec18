"""The agent's stop signals: the first one raises torch's SignalException, the next are noted.

torch's agent handles ``--signals-to-handle`` by raising ``SignalException`` in the main thread,
every time one arrives, but installs that handler only once it starts workers. A standby node
waiting in the rendezvous, or a node serving the store, must stop the same way, so the agent
installs its handler from the start. And under SLURM a stop often comes twice (``scancel`` or
the time limit signals the step, and srun forwards it again): a second exception raised in the
middle of the shutdown the first one started would break that shutdown wherever it happens to
be (a log call, a worker's close) and print a traceback. So only the first signal raises; a
later one is noted in one line and the shutdown, which is bounded, goes on.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from typing import Protocol

from torch.distributed.elastic.multiprocessing.api import SignalException

from tmrun.console import say
from tmrun.control.events import record_event

_DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


class _Membership(Protocol):
    def is_standing_by(self) -> bool: ...


class StopSignals:
    """The stop signals of this process and whether one has arrived yet."""

    def __init__(self, names: str = _DEFAULT_SIGNALS) -> None:
        parsed = (getattr(signal, part.strip(), None) for part in names.split(","))
        self.signals: tuple[signal.Signals, ...] = tuple(s for s in parsed if isinstance(s, signal.Signals))
        self.received: signal.Signals | None = None
        self.announced = False  # the stop's line was said

    def install(self) -> None:
        """Handle the signals here (again: torch replaces the handlers when it starts workers).
        Only from the main thread, where Python runs signal handlers."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.signals:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        sigval = signal.Signals(signum)
        if self.received is not None:
            # os.write: a signal handler may run inside a logging call, whose lock it holds
            os.write(2, f"tmrun: {sigval.name} again while stopping after {self.received.name}; "
                        "the shutdown goes on (SIGKILL stops at once)\n".encode())
            return
        self.received = sigval
        raise SignalException(f"process {os.getpid()} got signal {sigval.name}", sigval=sigval)


_stop_signals = StopSignals()


def handle_stop_signals(names: str = _DEFAULT_SIGNALS) -> StopSignals:
    """Install this process's stop-signal handler from now on; return it."""
    global _stop_signals
    _stop_signals = StopSignals(names)
    _stop_signals.install()
    return _stop_signals


def reinstall_stop_signals() -> None:
    """After torch started workers (it installs its own, raise-every-time handler)."""
    _stop_signals.install()


def announce_stop(handler: _Membership | None, sigval: signal.Signals) -> None:
    """Say once why this agent stops, before it stops anything: under SLURM a cancelled step's
    srun kills every task a moment after its SIGTERM (``srun: forcing job termination``), so a
    line said after the shutdown may never be written."""
    if _stop_signals.announced:
        return
    _stop_signals.announced = True
    if handler is not None and handler.is_standing_by():
        # (no claim that the job goes on: a scancel or the time limit signals every node at once)
        line = f"received {sigval.name} while standing by; this standby leaves"
    else:
        line = f"received {sigval.name}; stopping the workers"
    say(line)
    if handler is not None:
        record_stop(handler, line)  # the event log gets it too (bounded)


STOP_EVENT_WAIT = 1.0  # s: the longest an agent's stop waits for its event to reach the store


def record_stop(handler: object, line: str) -> None:
    """Put this agent's stop line in the job's event log too (a ``stop`` event): under SLURM a
    step's output may lose an agent's last lines. Bounded: the store's host may be stopping too
    (a scancel signals every node), so the stop never waits more than STOP_EVENT_WAIT for it."""
    store, node = getattr(handler, "store", None), getattr(handler, "node_id", None)
    if store is None or node is None or getattr(handler, "store_lost", False):
        return
    epoch = int(getattr(handler, "epoch", 0))
    detail = f"node {node} ({socket.gethostname()}): {line}"

    def record() -> None:
        try:
            record_event(store, "stop", epoch, detail, nodes=[node])
        except Exception:  # noqa: BLE001 - the store is gone: the line is in the output only
            pass

    writer = threading.Thread(target=record, name="tmrun-stop-event", daemon=True)
    writer.start()
    writer.join(STOP_EVENT_WAIT)
