"""What tmrun tells its user: short, prefixed lines on stderr. The one way tmrun writes log lines.

* ``say(message)``: the launcher, agents, the controller: ``[tmrun HH:MM:SS.mmm] message``;
* ``say(message, worker=True)``: a training process (the worker runtime, the "tmrun" backend):
  ``[tmrun worker PID HH:MM:SS.mmm] message``;
* ``say(..., error=exc)``: the same line followed by ``exc``'s traceback;
* ``fail(message)``: a user mistake or a fatal condition: ``tmrun: error: message``.

Tests and benches parse these lines (bench/inplace_failover.py's ``ENTRY``: the prefix, the
optional ``worker PID`` and the stamp): keep the formats. Each line is one write to stderr (which
is write-through): ``print()`` writes the newline separately, so lines of processes sharing the
file could be glued together.
"""

from __future__ import annotations

import os
import sys
import time
import traceback


def _stamp() -> str:
    now = time.time()  # one reading: seconds and milliseconds of the same instant
    return time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"


def say(message: str, *, worker: bool = False, error: BaseException | None = None) -> None:
    """One line for the operator (see the module docstring)."""
    who = f"tmrun worker {os.getpid()}" if worker else "tmrun"
    text = f"[{who} {_stamp()}] {message}\n"
    if error is not None:
        text += "".join(traceback.format_exception(type(error), error, error.__traceback__))
    sys.stderr.write(text)
    sys.stderr.flush()


def fail(message: str) -> None:
    """One line for a user mistake or a fatal condition (no traceback)."""
    print(f"tmrun: error: {message}", file=sys.stderr, flush=True)
