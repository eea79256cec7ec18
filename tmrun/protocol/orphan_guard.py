"""A worker never outlives its agent by more than a bounded time.

The agent is a node's supervisor: when it dies (SIGKILLed by SLURM after ``KillWait``, by the
OOM killer, by an operator) nobody can replace this node's ranks or collect their result. A
worker notices at its next step boundary and leaves cleanly (``tmrun.worker.loop``), but a
worker that never reaches one (stalled in compute, wedged in a collective or a store call whose
peer is gone, stuck in a user ``finally``) would hold its GPU and its memory until someone kills
it by hand; a scheduler whose process tracking lost it (orphans are reparented away from the step's
process tree) never will.

The guard is a daemon thread that waits on the agent's pidfd (a wake-up when it exits, no polling
delay; ``getppid()`` where pidfds are unavailable), then gives the process ``TMRUN_ORPHAN_GRACE``
seconds (5 by default) to leave on its own, and ends it with ``os._exit`` after that.
"""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Mapping
from typing import Callable

GRACE_ENV = "TMRUN_ORPHAN_GRACE"
DEFAULT_GRACE = 5.0
EXIT_CODE = 75  # EX_TEMPFAIL: the job ended around this process
_POLL_S = 1.0  # the longest a wait on the pidfd blocks before looking again

_started: set[int] = set()  # agent pids guarded in this process (one guard each)
_lock = threading.Lock()


def grace_from_environ(environ: Mapping[str, str] = os.environ) -> float:
    """``TMRUN_ORPHAN_GRACE`` in seconds (unset: 5); ``ValueError`` (one line) for anything but a
    number of seconds >= 0 (the launcher checks it before any worker starts)."""
    raw = environ.get(GRACE_ENV, "").strip()
    if not raw:
        return DEFAULT_GRACE
    try:
        grace = float(raw)
    except ValueError:
        grace = -1.0
    if not grace >= 0 or grace == float("inf"):
        raise ValueError(f"{GRACE_ENV}={raw!r} is not a number of seconds >= 0 (how long a worker whose agent "
                         "died may take to leave before it is ended)")
    return grace


def orphaned(agent_pid: int) -> bool:
    """True once the agent that started this process is no longer its parent (never for a
    process started without one: ``agent_pid`` 0)."""
    return agent_pid > 0 and os.getppid() != agent_pid


def _wait_until_gone(agent_pid: int) -> None:
    """Returns when the agent exited (bounded waits, looked at again every ``_POLL_S``)."""
    try:
        pidfd = os.pidfd_open(agent_pid)
    except (OSError, AttributeError):
        pidfd = -1
    try:
        poller = select.poll()
        if pidfd >= 0:
            poller.register(pidfd, select.POLLIN)
        while not orphaned(agent_pid):
            if pidfd >= 0:
                poller.poll(_POLL_S * 1000)  # readable when the process exits
            else:
                time.sleep(_POLL_S / 4)
    finally:
        if pidfd >= 0:
            os.close(pidfd)


def _guard(agent_pid: int, grace: float, say: Callable[[str], None], exit_now: Callable[[int], None]) -> None:
    _wait_until_gone(agent_pid)
    say(f"the tmrun agent (pid {agent_pid}) is gone; this process leaves at its next step boundary, "
        f"or is ended in {grace:g}s")
    time.sleep(grace)
    say(f"ending this process: its agent (pid {agent_pid}) is gone and it did not leave within {grace:g}s")
    exit_now(EXIT_CODE)


def start(agent_pid: int, say: Callable[[str], None], grace: float | None = None,
          exit_now: Callable[[int], None] = os._exit) -> threading.Thread | None:
    """Guard this process against outliving ``agent_pid`` (0: no agent, nothing to guard);
    once per agent and process. Returns the guard's thread (None when not started)."""
    if agent_pid <= 0:
        return None
    with _lock:
        if agent_pid in _started:
            return None
        _started.add(agent_pid)
    if grace is None:
        try:
            grace = grace_from_environ()
        except ValueError:  # the launcher refuses it; a process started otherwise keeps the default
            grace = DEFAULT_GRACE
    thread = threading.Thread(target=_guard, name="tmrun-orphan-guard", daemon=True,
                              args=(agent_pid, grace, say, exit_now))
    thread.start()
    return thread
