"""What tmrun tells its user: short, prefixed lines on stderr. The one way tmrun writes log lines.

* ``say(message)``: the launcher, agents, the controller: ``[tmrun HH:MM:SS.mmm] message``;
* ``say(message, worker=True)``: a training process (the worker runtime, the "tmrun" backend):
  ``[tmrun worker PID HH:MM:SS.mmm] message``;
* where the node has a name to show (``TMRUN_NODE_NAME``: under SLURM, the node's SLURM name, so
  that a job log gathered from every node says where each line comes from): ``[tmrun@NAME ...]``;
* ``say(..., error=exc)``: the same line followed by ``exc``'s traceback;
* ``warn(message)``: a setting that will hurt the job: ``tmrun: warning: message``;
* ``fail(message)``: a user mistake or a fatal condition: ``tmrun: error: message``.

Tests and benches parse these lines (bench/inplace_failover.py's ``ENTRY``: the prefix with its optional
``@NAME``, the optional ``worker PID`` and the stamp): keep the formats. Each line is one write to stderr (which
is write-through): ``print()`` writes the newline separately, so lines of processes sharing the
file could be glued together.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

NODE_NAME_VAR = "TMRUN_NODE_NAME"  # the same name as protocol.environment.ENV_NODE_NAME (a leaf imports neither)


def _stamp() -> str:
    now = time.time()  # one reading: seconds and milliseconds of the same instant
    return time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"


def say(message: str, *, worker: bool = False, error: BaseException | None = None) -> None:
    """One line for the operator (see the module docstring)."""
    node = os.environ.get(NODE_NAME_VAR, "")
    tmrun = f"tmrun@{node}" if node else "tmrun"
    who = f"{tmrun} worker {os.getpid()}" if worker else tmrun
    text = f"[{who} {_stamp()}] {message}\n"
    if error is not None:
        text += "".join(traceback.format_exception(type(error), error, error.__traceback__))
    sys.stderr.write(text)
    sys.stderr.flush()


def warn(message: str) -> None:
    """One line for a setting that will hurt the job but does not stop it."""
    print(f"tmrun: warning: {message}", file=sys.stderr, flush=True)


def fail(message: str) -> None:
    """One line for a user mistake or a fatal condition (no traceback)."""
    print(f"tmrun: error: {message}", file=sys.stderr, flush=True)
