"""Single-node standby members: warm worker processes kept beside the active workers.

A standby process imports torch ahead of time (the bulk of a cold start) and then waits.
Scripts that use the tmrun worker API are promoted in place; for a plain torchrun script the
standby only stands ready. The pool starts them, reports them, and stops them cleanly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from tmrun.console import say
from tmrun.control.replacement.core import terminate
from tmrun.launcher import standby_devices
from tmrun.protocol import environment


@dataclass
class StandbyMember:
    index: int
    process: subprocess.Popen[bytes]
    ready_file: str
    local_rank: int = 0

    @property
    def ready(self) -> bool:
        return os.path.exists(self.ready_file)

    def describe(self) -> dict[str, object]:
        state = "exited" if self.process.poll() is not None else ("ready" if self.ready else "warming")
        return {"index": self.index, "pid": self.process.pid, "state": state, "local_rank": self.local_rank}


class StandbyPool:
    """``size`` standby worker processes. On a single node they are interchangeable, each on a
    spare device of its own (``nproc`` active ranks: local ranks from ``nproc`` on, see
    tmrun.launcher.standby_devices); a standby node's pool (``by_local_rank``) holds one per
    local rank of a node, so that each takes over the rank with the same local rank (and the
    same device)."""

    def __init__(self, size: int, run_id: str, first_index: int = 0, by_local_rank: bool = False,
                 log_dir: str = "", nproc: int = 0, gpus: int = 0) -> None:
        self._size = size
        self._run_id = run_id
        self._members: list[StandbyMember] = []
        self._next_index = first_index
        self._by_local_rank = by_local_rank
        self._closed = False
        self._early_exits = 0  # standbys that died before they were ever taken, in a row
        self._last_start = 0.0
        self.worker_env: dict[str, str] = {}  # what a standby needs to run the job's script
        self._dir = tempfile.mkdtemp(prefix="tmrun-standby-")
        self._last_states: list[str] = []
        self._log_dir = log_dir  # standby-<index>.log there (the live console owns the terminal), else inherited
        self.nproc = nproc  # the active local ranks (single node): a standby's device is a spare one
        self._gpus = gpus
        self._share = os.environ.get(standby_devices.ENV_SHARE, "") == "1"
        self._held: set[int] = set()  # local ranks of promoted standbys: their devices are not reused
        self._no_device_said = False

    @property
    def directory(self) -> str:
        """The pool's private directory (ready files; the controller's generation file)."""
        return self._dir

    @property
    def members(self) -> list[StandbyMember]:
        return list(self._members)

    def changed(self) -> bool:
        """True once after any member changed state (warming, ready, exited)."""
        states = [str(m.describe()["state"]) for m in self._members]
        if states == self._last_states:
            return False
        self._last_states = states
        return True

    MAX_EARLY_EXITS = 3
    RESTART_BACKOFF = 2.0

    @property
    def failing(self) -> str:
        """Non-empty when standbys keep dying on their own (the pool stopped starting them)."""
        if self._early_exits >= self.MAX_EARLY_EXITS:
            return f"{self._early_exits} standby workers in a row exited on their own"
        return ""

    def fill(self) -> None:
        """Start standby processes until the pool holds ``size`` live members. A standby that
        died on its own is restarted after a back-off; after a few in a row, no more."""
        if self._closed:
            return
        dead = [m for m in self._members if m.process.poll() is not None]
        for member in dead:
            say(f"standby worker {member.index} (pid {member.process.pid}) exited with code {member.process.returncode}")
            self._early_exits += 1
        self._members = [m for m in self._members if m.process.poll() is None]
        if self.failing or (dead and time.monotonic() - self._last_start < self.RESTART_BACKOFF):
            return
        while len(self._members) < self._size:
            self._last_start = time.monotonic()
            taken = {m.local_rank for m in self._members}
            if self._by_local_rank:
                local_rank: int | None = min(set(range(self._size)) - taken)
            else:
                local_rank = standby_devices.standby_local_rank(self.nproc, self._gpus, taken, self._held, self._share)
            if local_rank is None:
                if not self._no_device_said:
                    say(standby_devices.no_spare_gpu(self.nproc, self._gpus, self._held))
                    self._no_device_said = True
                return
            self._members.append(self._start(self._next_index, local_rank))
            self._next_index += 1

    def take(self, member: StandbyMember) -> None:
        """Remove a promoted member from the pool (it is a worker now; the caller owns it)."""
        self._members.remove(member)
        self._early_exits = 0
        self._held.add(member.local_rank)

    def _start(self, index: int, local_rank: int) -> StandbyMember:
        ready_file = os.path.join(self._dir, f"standby-{index}.ready")
        env = dict(os.environ)
        # a standby waits on the job's store: if its host is lost, the standby says so in one line
        # and exits, without torch's C++ warning (stack frames) first; the user's level wins
        env.setdefault(environment.ENV_TORCH_CPP_LOG_LEVEL, "ERROR")
        env.update(self.worker_env)
        env.update(
            {
                environment.ENV_ROLE: "standby",
                environment.ENV_STANDBY_ID: str(index),
                environment.ENV_READY_FILE: ready_file,
                environment.ENV_RUN_ID: self._run_id,
                environment.ENV_AGENT_PID: str(os.getpid()),
            }
        )
        env[environment.ENV_LOCAL_RANK] = str(local_rank)
        if self._log_dir:
            with open(os.path.join(self._log_dir, f"standby-{index}.log"), "ab") as log:
                process = subprocess.Popen([sys.executable, "-m", "tmrun.worker.standby_process"], env=env,
                                           stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        else:
            process = subprocess.Popen([sys.executable, "-m", "tmrun.worker.standby_process"], env=env,
                                       stdin=subprocess.DEVNULL)
        say(f"standby worker {index} started (pid {process.pid})")
        return StandbyMember(index, process, ready_file, local_rank)

    def stop(self, timeout: float = 5.0, final: bool = True) -> None:
        """Stop every member (SIGTERM, then SIGKILL after ``timeout``); ``final`` also removes
        the pool's directory (no later ``fill``)."""
        if self._closed:
            return
        terminate([member.process for member in self._members], timeout)
        self._members = []
        self._held = set()  # a new worker group: every device is the group's or spare again
        self._no_device_said = False
        if not final:
            return
        self._closed = True
        for name in os.listdir(self._dir):
            os.unlink(os.path.join(self._dir, name))
        os.rmdir(self._dir)
