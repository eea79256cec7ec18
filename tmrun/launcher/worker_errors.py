"""A failed worker's own error, in one line, where the agent can read it.

Two places hold it: the worker's error file (torch's ``@record`` writes the exception there) and
its stderr when torch redirected it to a file (``--redirects``; the live console always does).
A worker whose stderr goes to the terminal printed its error there itself: nothing is read then.
"""

from __future__ import annotations

import os

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

TAIL_BYTES = 8192  # how much of a stderr file's end is read
MAX_CHARS = 200  # the line is cut to this
_NO_REPLY = "To enable traceback see"  # torch's message when the worker wrote no error file


def error_line(failure: ProcessFailure, stderr_path: str | None) -> str:
    """The worker's error (``ValueError: ...``, ``script.py: error: ...``), or "" if unknown.
    A worker killed by a signal has none of its own."""
    if failure.exitcode is None or failure.exitcode < 0:
        return ""
    message = failure.message
    if isinstance(message, dict):  # @record's error file: {"message": "<traceback>", "extraInfo": {...}}
        message = message.get("message", "")
    message = message if isinstance(message, str) else ""
    if message and not message.startswith(_NO_REPLY):
        return _cut(_last_line(message))
    if stderr_path:
        return _cut(_last_line(_tail(stderr_path)))
    return ""


def _tail(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - TAIL_BYTES))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return ""
    line = lines[-1]
    if line.startswith("[rank") and "]:" in line:  # torch's per-rank prefix on errors it prints
        line = line.split("]:", 1)[1].strip()
    return line


def _cut(line: str) -> str:
    return line if len(line) <= MAX_CHARS else line[: MAX_CHARS - 3] + "..."
