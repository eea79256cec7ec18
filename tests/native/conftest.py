"""Helpers for the native communicator tests: in-process groups (one thread per rank) and
subprocess ranks (killed by PID, always reaped)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import pytest

tn = pytest.importorskip("tmrun_native")

from tmrun.comm.native import as_buffer, torch_dtype_to_native  # noqa: E402  (after the importorskip)

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker.py")


def buf(t: Any) -> memoryview:
    """A writable byte view over a contiguous CPU tensor's memory (ctypes, see as_buffer). The view does not
    keep the tensor alive: hold the tensor until the operation using the view is over. Pass the
    element type with ``dtype=dt(t)``."""
    return as_buffer(t)[0]


def dt(t: Any) -> Any:
    """The communicator's DType of a tensor (bfloat16 included)."""
    return torch_dtype_to_native(t.dtype)


def connect_all(comms: list, timeout: float = 30.0) -> None:
    addrs = [c.address for c in comms]
    run_ranks(comms, lambda c: c.connect(addrs), timeout=timeout)


def make_group(n: int, job: str = "test", epoch: int = 0, **opts: Any) -> list:
    opts.setdefault("timeout", 5.0)
    comms = [tn.Communicator(r, n, job, epoch, tn.Options(**opts)) for r in range(n)]
    connect_all(comms)
    return comms


def run_ranks(comms: list, fn: Callable[[Any], Any], timeout: float = 60.0, raise_errors: bool = True):
    """Run fn(comm) on one thread per communicator; return (results, errors)."""
    results: list = [None] * len(comms)
    errors: list = [None] * len(comms)

    def body(i: int) -> None:
        try:
            results[i] = fn(comms[i])
        except BaseException as e:  # noqa: BLE001
            errors[i] = e

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(len(comms))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        raise AssertionError(f"ranks still running after {timeout} s (hang)")
    if raise_errors:
        for e in errors:
            if e is not None:
                raise e
    return results, errors


def close_all(comms: list) -> None:
    for c in comms:
        if c is not None:
            c.close()


@pytest.fixture
def group_factory():
    made: list = []

    def factory(n: int, **kw: Any) -> list:
        g = make_group(n, **kw)
        made.append(g)
        return g

    yield factory
    for g in made:
        close_all(g)


class Proc:
    """A rank in a subprocess speaking JSON lines on stdin/stdout (see _worker.py)."""

    def __init__(self, *args: str) -> None:
        self.p = subprocess.Popen(
            [sys.executable, WORKER, *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        self.lines: list = []
        self._cv = threading.Condition()
        self._t = threading.Thread(target=self._reader, daemon=True)
        self._t.start()

    def _reader(self) -> None:
        for line in self.p.stdout:
            line = line.strip()
            if not line.startswith("{"):
                continue
            with self._cv:
                self.lines.append(json.loads(line))
                self._cv.notify_all()
        with self._cv:
            self.lines.append({"eof": True})
            self._cv.notify_all()

    def send(self, obj: Any) -> None:
        self.p.stdin.write(json.dumps(obj) + "\n")
        self.p.stdin.flush()

    def expect(self, key: str, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for i, msg in enumerate(self.lines):
                    if key in msg:
                        return self.lines.pop(i)
                    if "eof" in msg and key != "eof":
                        err = self.p.stderr.read() if self.p.poll() is not None else ""
                        raise AssertionError(f"worker exited before '{key}': {err[-2000:]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out waiting for '{key}' from worker; got {self.lines}")
                self._cv.wait(left)

    def kill(self, sig: int = 9) -> None:
        if self.p.poll() is None:
            os.kill(self.p.pid, sig)

    def cleanup(self) -> None:
        try:
            if self.p.poll() is None:
                self.p.kill()
            self.p.wait(timeout=10)
        except Exception:  # noqa: BLE001
            pass
        for f in (self.p.stdin, self.p.stdout, self.p.stderr):
            try:
                f.close()
            except Exception:  # noqa: BLE001
                pass


@pytest.fixture
def procs():
    made: list = []

    def start(*args: str) -> Proc:
        p = Proc(*args)
        made.append(p)
        return p

    yield start
    for p in made:
        p.cleanup()


def start_group(start: Callable[..., Proc], n: int, timeout: float = 2.0, epoch: int = 0,
                job: str = "killtest") -> list:
    ps = [start("--rank", str(r), "--world", str(n), "--timeout", str(timeout), "--epoch", str(epoch),
                "--job", job) for r in range(n)]
    addrs = [p.expect("address")["address"] for p in ps]
    for p, a in zip(ps, addrs):
        p.address = a
    for p in ps:
        p.send({"addresses": addrs})
    for p in ps:
        p.expect("connected")
    return ps
