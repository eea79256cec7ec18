"""What tmrun tells its user: short, prefixed lines on stderr."""

from __future__ import annotations

import sys
import time


def say(message: str) -> None:
    """One line for the operator: ``[tmrun HH:MM:SS.mmm] message``."""
    now = time.time()
    stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"
    sys.stderr.write(f"[tmrun {stamp}] {message}\n")  # one write: no gluing with workers' lines
    sys.stderr.flush()


def fail(message: str) -> None:
    """One line for a user mistake or a fatal condition (no traceback)."""
    print(f"tmrun: error: {message}", file=sys.stderr, flush=True)
