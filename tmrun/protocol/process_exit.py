"""How a tmrun process ends once its work is done: without the interpreter's teardown.

Python's teardown of a process that imported torch (its modules, their objects) took 0.4-0.7 s
on the 2-core machine; the launcher pays it after every job, a worker leaving a migration or a
standby told to stop after it. These end the process with ``os._exit`` instead, after what must
still run: the exit handlers (logging's among them) where the process registered some, and the
standard streams flushed."""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn

__all__ = ["exit_after_handlers", "flush_standard_streams"]


def flush_standard_streams() -> None:
    """Flush stdout and stderr; a stream closed or broken (or a signal handler's flush that came
    inside a write to it) has nothing left to save."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, RuntimeError):
            pass


def exit_after_handlers(status: int) -> NoReturn:
    """Run the exit handlers registered so far (newest first), flush the standard streams, then
    end the process with ``status`` without the interpreter's teardown."""
    try:
        atexit._run_exitfuncs()
    finally:
        flush_standard_streams()
        os._exit(status)
