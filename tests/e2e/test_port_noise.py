"""A job under attack on every port: while a one-node ``--standby 1`` job trains, a thread of
the test finds every TCP port that the job's processes listen on (the agent and all its
descendants: the store, the liveness and operations listeners, each worker's communicator) and
keeps hitting each with random bytes, truncated valid-looking frames, connections that connect
and stay silent, and connect-and-close.

The job must finish with exit 0 and final parameters bitwise equal to the same job without the
noise, and nobody may lose a peer: exactly the rank the test SIGKILLs is replaced (recovered
in place), no other, before or after. Garbage must only ever fail the handshake of its own
connection (the job token's challenge on every native link).
"""

from __future__ import annotations

import random
import re
import socket
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import EXAMPLES, kill_tree, leftovers, start, tmrun_cmd

STEPS = 24
STEP_TIME = 0.25  # long enough for the noise to find and hit every listener while steps run
JOB_TIMEOUT = 240
SILENT_HOLD = 3.0  # silent connections are kept this long (past the native 2 s handshake bound)
MAX_SILENT_PER_PORT = 4


def _job_cmd(work: Path, *extra: str) -> list[str]:
    return tmrun_cmd(
        "--standalone", "--nproc-per-node", "2", "--standby", "1", *extra,
        str(EXAMPLES / "train_inplace.py"), "--steps", str(STEPS), "--width", "48", "--batch", "16",
        "--step-time", str(STEP_TIME), "--step-log", str(work / "steps-{rank}.log"), "--final", str(work / "final"),
    )  # fmt: skip


def _describe(proc: psutil.Process) -> str:
    try:
        env = proc.environ()
        cmd = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return "gone"
    if "tmrun.cli.main" in cmd:
        return "agent"
    if env.get("TMRUN_ROLE") == "standby":
        return f"standby {env.get('TMRUN_STANDBY_ID', '?')}"
    if "RANK" in env:
        return f"worker rank {env['RANK']}"
    return cmd[:60]


class Noise(threading.Thread):
    """Finds the job's listeners (by PID tree, not by guessing) and hits them until stopped."""

    def __init__(self, root_pid: int, seed: int = 7) -> None:
        super().__init__(name="port-noise", daemon=True)
        self.root_pid = root_pid
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.found: dict[int, str] = {}  # port -> "pid role"
        self.hits: dict[str, int] = {"random": 0, "truncated": 0, "silent": 0, "connect-close": 0, "refused": 0}
        self.job_id = "tmrun/0"
        self.errors: list[str] = []
        try:
            import tmrun_native as tn

            self.tn = tn
        except ImportError:  # pragma: no cover - the native module is part of tmrun
            self.tn = None
        self._silent: list[tuple[float, socket.socket]] = []

    def _scan(self) -> list[int]:
        try:
            root = psutil.Process(self.root_pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        ports = []
        for proc in procs:
            try:
                conns = proc.net_connections(kind="tcp")
                run = proc.environ().get("TMRUN_RUN_ID")
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            if run:
                self.job_id = f"{run}/0"
            for conn in conns:
                if conn.status == psutil.CONN_LISTEN:
                    port = conn.laddr.port
                    ports.append(port)
                    if port not in self.found:
                        self.found[port] = f"pid {proc.pid} {_describe(proc)}"
        return ports

    def _frame_prefix(self) -> bytes:
        rng = self.rng
        if self.tn is None:
            return b"TMRN" + bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 60)))
        kind = rng.choice([1, 2, 4, 6])
        payload = b"\x00" * 12 if kind == 2 else bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 64)))
        frame = self.tn.encode_frame(kind, payload, job_id=self.job_id, epoch=rng.randrange(3), seq=rng.randrange(3))
        return frame[: rng.randrange(1, len(frame))]

    def _hit(self, port: int) -> None:
        rng = self.rng
        mode = rng.choice(["random", "truncated", "silent", "connect-close"])
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=1.0)
        except OSError:
            self.hits["refused"] += 1  # the listener closed meanwhile (a process that ended)
            return
        try:
            if mode == "random":
                sock.sendall(bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 300))))
            elif mode == "truncated":
                sock.sendall(self._frame_prefix())
            elif mode == "silent":
                if sum(1 for _, s in self._silent if s.getpeername()[1] == port) < MAX_SILENT_PER_PORT:
                    self._silent.append((time.monotonic() + SILENT_HOLD, sock))
                    self.hits[mode] += 1
                    return
        except OSError:
            pass  # the peer closed on us: that is an answer to garbage too
        self.hits[mode] += 1
        sock.close()

    def _expire(self, everything: bool = False) -> None:
        now = time.monotonic()
        keep = []
        for until, sock in self._silent:
            if everything or until <= now:
                sock.close()
            else:
                keep.append((until, sock))
        self._silent = keep

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                ports = self._scan()
                for port in ports:
                    self._hit(port)
                self._expire()
                self.stop.wait(0.05)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(repr(exc))
        finally:
            self._expire(everything=True)


def _run(tmp: Path, name: str, *extra: str, noise: bool) -> tuple[int, str, str, dict[int, set[int]], Noise | None]:
    work = tmp / name
    work.mkdir()
    job = start(_job_cmd(work, *extra), log=work / "agent.log", env={"TMRUN_STATE_DIR": str(work / "state")})
    thread = Noise(job.pid) if noise else None
    try:
        if thread:
            thread.start()
        code = job.wait(timeout=JOB_TIMEOUT)
    finally:
        if thread:
            thread.stop.set()
            thread.join(timeout=10)
        kill_tree(job)
        assert leftovers(job) == []
    log = (work / "agent.log").read_text()
    final = (work / "final").read_text().strip() if (work / "final").exists() else ""
    pids: dict[int, set[int]] = {}
    for rank in range(2):
        path = work / f"steps-{rank}.log"
        rows = [line.split() for line in path.read_text().splitlines()] if path.exists() else []
        pids[rank] = {int(r[2]) for r in rows}
        assert sorted({int(r[0]) for r in rows}) == list(range(STEPS)), (rank, log)
    return code, log, final, pids, thread


@pytest.fixture(scope="module")
def reference(one_node_migration_reference: str) -> str:
    # the same training (24 steps, width 48, batch 16; the step time changes no bit) with no
    # failure and no noise: tests/e2e/conftest.py runs it once per session
    return one_node_migration_reference


def _report(thread: Noise, log: str) -> str:
    """Which listener is which: the agent logs its store's and its operations endpoint's ports;
    its third listener is the leader's liveness listener; a worker's is its communicator's."""
    names = {}
    for what, pattern in (("store", r"rendezvous store at \S+:(\d+)"), ("ops", r"operations endpoint at \S+:(\d+)")):
        found = re.search(pattern, log)
        if found:
            names[int(found.group(1))] = what
    rows = []
    for port, who in sorted(thread.found.items()):
        what = names.get(port, "liveness" if who.endswith("agent") else "communicator")
        rows.append(f"{port}: {who} ({what})")
    return f"listeners {{{', '.join(rows)}}}; hits {thread.hits}"


def _check_log(log: str, killed: bool = False) -> None:
    # a port scanner does not flood the log: the liveness refusal is said at most every 10 s
    # (it was one line per connection: hundreds in a 30 s job; 12 allows a job twice as slow)
    assert log.count("liveness: refused a connection") <= 12, log
    assert killed or "Traceback" not in log, log


def test_noise_on_every_port_and_a_killed_rank(tmp_path: Path, reference: str) -> None:
    """Noise on every listener of the job from its start to its end, and rank 1 SIGKILLed at step
    8: the only replacement is the killed rank's (the noise made nobody lose a peer, before or
    after), recovered in place once, bitwise equal to the run with neither."""
    code, log, final, pids, thread = _run(tmp_path, "noise-kill", "--inject-failure", "rank=1,step=8", noise=True)
    assert thread is not None
    print(_report(thread, log))
    assert not thread.errors, thread.errors
    assert code == 0, log
    _check_log(log, killed=True)
    assert final == reference, "final state differs from the run without noise\n" + log
    assert len(pids[0]) == 1, f"the survivor changed process: {pids}\n{log}"
    assert len(pids[1]) == 2, f"rank 1 should have been played by two processes: {pids}\n{log}"
    assert log.count("in-place replacement, generation") == 1 and "signal SIGKILL" in log, log
    assert "generation 1: all 2 ranks recovered" in log, log
    assert "generation 2" not in log, "a second replacement: the noise cost someone a peer\n" + log
    roles = " ".join(thread.found.values())
    assert "agent" in roles and "worker rank 0" in roles and "worker rank 1" in roles, _report(thread, log)
    assert sum(v for k, v in thread.hits.items() if k != "refused") > 20 * len(thread.found), _report(thread, log)
