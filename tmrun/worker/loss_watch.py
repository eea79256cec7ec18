"""The loss watcher: a daemon thread that learns of a lost peer the moment the communicator does.

The native communicator's own threads see a peer's end at once (its sockets hang up; see the
service loop in tmrun_native/src/tcp/acceptor.cpp) and record the loss, but the training thread
would learn of it only at its next collective, after the compute of the step in flight. This
thread waits inside the communicator (``wait_failure``: a condition variable, the GIL released,
no polling) and hands each recorded loss to ``on_loss`` at once, which dooms the step
(:mod:`tmrun.worker.interrupt` stops its compute) and reports the loss to the controller.

Stopped (and joined) at exit, before the interpreter finalizes. It follows the group's communicator as it changes (a promoted standby attaches a new one) and
sees each epoch's failure once. A communicator without ``wait_failure`` (a group in local mode,
another transport) is simply not watched: its losses surface at the next collective, as before.
"""

from __future__ import annotations

import atexit
import threading
from typing import Any, Callable

WAIT = 0.1  # seconds per wait: how soon the thread notices a new communicator or stop()

OnLoss = Callable[[int, int, bool, str], None]  # (epoch, lost rank or -1, protocol error, message)


class LossWatcher:
    def __init__(self, comm_of: Callable[[], Any], on_loss: OnLoss) -> None:
        self._comm_of = comm_of
        self._on_loss = on_loss
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tmrun-loss-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()
        atexit.register(self.stop)

    def stop(self) -> None:
        """Stop and join the thread. Also at exit: a thread still waiting in the communicator when
        the interpreter finalizes would be ended inside it (pthread_exit when it takes the GIL
        back), which aborts the process."""
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * WAIT + 1.0)

    def _run(self) -> None:
        seen: dict[int, int] = {}  # id(communicator) -> the epoch whose failure was handed on
        while not self._stopped.is_set():
            try:
                comm = self._comm_of()
            except Exception:
                comm = None
            wait = getattr(comm, "wait_failure", None)
            if wait is None:
                self._stopped.wait(WAIT)
                continue
            try:
                found = wait(WAIT, seen.get(id(comm), -1))
            except Exception:  # closed under us: the next communicator, or the end
                self._stopped.wait(WAIT)
                continue
            if found is None or self._stopped.is_set():
                continue
            epoch, lost, protocol, message = found
            seen = {id(comm): int(epoch)}
            try:
                self._on_loss(int(epoch), int(lost), bool(protocol), str(message))
            except Exception:
                pass  # the store is gone, or the like: the training thread's next collective reports it
