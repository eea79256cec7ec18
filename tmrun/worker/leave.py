"""How a migration's leaver ends once its state is handed over.

The leaver exits with status 0 after the script's exit handlers ran (``atexit``: logging,
multiprocessing's children, the user's own) and the standard streams were flushed, but
without the interpreter's teardown of torch's modules: that costs about 0.5 s of CPU, which
on a shared host would compete with the joiner's first steps right when it matters.
``finally`` blocks and context managers of the script still run (the exit unwinds as a
``SystemExit``); a script that fails while unwinding still exits non-zero.
"""

from __future__ import annotations

import atexit
import os
import sys
from types import TracebackType
from typing import NoReturn

from tmrun.protocol.process_exit import exit_after_handlers, flush_standard_streams

_status = 0


def _on_uncaught(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    global _status
    _status = 1
    sys.__excepthook__(kind, value, tb)


def _finish() -> None:
    atexit.unregister(_finish)  # the handlers below must not call this one again
    exit_after_handlers(_status)  # the handlers registered before the leave, newest first


def leave() -> NoReturn:
    """End this process (status 0) as soon as the script has unwound."""
    sys.excepthook = _on_uncaught
    atexit.register(_finish)  # registered last, so it runs first, then runs the others
    raise SystemExit(0)


def exit_now(status: int) -> NoReturn:
    """End a process that tmrun no longer needs (a standby told to stop, or left without a job)
    so that nothing can swallow it: a ``SystemExit`` raised here would unwind through the
    script, where a framework's ``except SystemExit`` / ``except BaseException`` or torch's
    ``@record`` (which returns on ``SystemExit(0)``) could catch it and run on with a half-built
    trainer. The standard streams are flushed and logging shut down first (its last lines
    reach the log); the script has no state worth unwinding for: a standby holds none yet."""
    flush_standard_streams()
    try:
        import logging

        logging.shutdown()
    except Exception:  # noqa: BLE001 (a broken handler must not keep the process alive)
        pass
    os._exit(status)
