"""Process helpers for tests: free ports, bounded waits, and killing only what we started."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"
EXAMPLES = ROOT / "examples"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def tmrun_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "tmrun.cli.main", *args]


def torchrun_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


TAG_VAR = "TMRUN_TEST_TAG"


def start(cmd: Sequence[str], log: Path | None = None, env: dict[str, str] | None = None,
          cwd: Path | None = None) -> subprocess.Popen[bytes]:
    """Start a command tagged through its environment: every descendant (torch puts workers in
    sessions of their own) inherits the tag, so the test finds and kills exactly what it started."""
    out = open(log, "wb") if log else subprocess.PIPE
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env[TAG_VAR] = uuid.uuid4().hex
    proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=cwd)
    proc.tag = full_env[TAG_VAR]  # type: ignore[attr-defined]
    return proc


def tagged_pids(tag: str) -> list[int]:
    pids = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get(TAG_VAR) == tag and proc.status() != psutil.STATUS_ZOMBIE:
                pids.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return pids


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL every process this test started (found by its tag, by PID), then reap."""
    for pid in tagged_pids(proc.tag):  # type: ignore[attr-defined]
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def leftovers(proc: subprocess.Popen[bytes], grace: float = 5.0) -> list[int]:
    """Processes of this test still alive after ``grace`` seconds (orphans reparent to init)."""
    wait_until(lambda: not tagged_pids(proc.tag), grace)  # type: ignore[attr-defined]
    return tagged_pids(proc.tag)  # type: ignore[attr-defined]


def run_job(cmd: Sequence[str], log: Path, env: dict[str, str], timeout: float,
            cwd: Path | None = None) -> tuple[int, str]:
    """Start a job (its output to ``log``, in ``cwd``), wait up to ``timeout`` for it, kill
    whatever of it is left (asserting nothing survives); returns its exit code and its log."""
    job = start(cmd, log=log, env=env, cwd=cwd)
    try:
        code = job.wait(timeout=timeout)
    finally:
        kill_tree(job)
        assert leftovers(job) == []
    return code, log.read_text()


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def kill_after_steps(steps_log: Path, steps: int, delay: float, timeout: float = 120) -> threading.Thread:
    """Start a thread that SIGKILLs the process of ``steps_log`` (an example's ``--step-log``: one
    "step time pid" line per step) ``delay`` s after it logged ``steps`` steps: a random moment of a
    step, not a drill's fixed point. Join it after the job."""
    return kill_when(steps_log, lambda: steps_log.exists() and len(steps_log.read_text().splitlines()) >= steps,
                     delay, timeout)


def kill_when(steps_log: Path, ready: Callable[[], bool], delay: float = 0.0, timeout: float = 120) -> threading.Thread:
    """Start a thread that SIGKILLs the process of ``steps_log`` (its first line's pid) ``delay`` s
    after ``ready()`` turned true (within ``timeout`` s; never otherwise). Join it after the job."""
    def kill() -> None:
        if wait_until(ready, timeout):
            time.sleep(delay)
            try:
                os.kill(int(steps_log.read_text().splitlines()[0].split()[2]), signal.SIGKILL)
            except ProcessLookupError:
                pass

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    return killer


def run_agents(work: Path, agents: int, command: Callable[[int], list[str]], env: dict[str, str], timeout: float,
               during: Callable[[list[subprocess.Popen[bytes]]], None] | None = None) -> tuple[list[int], list[str]]:
    """One job's ``agents`` tmrun agents on loopback, started in order (node ids follow the order
    in which they join: each waits until the first agent's log names it), ``command(port)`` each
    (``port``: the rendezvous endpoint's, free), logging to ``work/agent{n}.log``; ``during(agents)``
    runs in a thread once every agent started. Returns their exit codes and logs; every process
    they started is killed, and none may be left."""
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for node in range(agents):
            procs.append(start(command(port), log=work / f"agent{node}.log", env=env))
            assert wait_until(lambda n=node: f"node {n} " in (work / "agent0.log").read_text(), 60), (
                (work / "agent0.log").read_text())
        if during is not None:
            threading.Thread(target=during, args=(procs,), daemon=True).start()
        codes = [proc.wait(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            kill_tree(proc)
        for proc in procs:
            assert leftovers(proc) == []
    return codes, [(work / f"agent{n}.log").read_text() for n in range(agents)]


def run(cmd: Sequence[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run to completion (bounded); on timeout kill the whole session and fail."""
    proc = start(cmd, env=env)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        raise AssertionError(f"command did not finish within {timeout} s: {' '.join(cmd)}") from None
    left = leftovers(proc)
    if left:
        kill_tree(proc)
        raise AssertionError(f"processes left behind: {left}")
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out.decode(errors="replace"), "")


def ctl_when_logged(log: Path, needles: Sequence[str], ctl_args: Sequence[str], state_dir: Path,
                    out: list[str], timeout: float = 120) -> None:
    """Once every one of ``needles`` is in ``log``, run ``tmrun-ctl *ctl_args`` against the job
    (found through ``state_dir``) and append its output to ``out`` (for a thread: bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        if all(needle in text for needle in needles):
            result = subprocess.run(
                [*tmrun_cmd()[:2], "tmrun.cli.ctl", *ctl_args], capture_output=True, text=True, timeout=60,
                env={**os.environ, "TMRUN_STATE_DIR": str(state_dir)},
            )
            out.append(result.stdout + result.stderr)
            return
        time.sleep(0.05)


def load_script(path: str | Path, name: str) -> ModuleType:
    """Import a script that is not in a package (a bench, a build helper) as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def assert_one_line_usage_error(parse: Callable[[list[str]], object], flags: list[str], prog: str, message: str,
                                capsys: Any) -> None:
    """A script's bad flags: exit status 2 and one line on stderr, ``PROG: error: ...`` naming ``message``."""
    import pytest

    with pytest.raises(SystemExit) as exc:
        parse(flags)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"{prog}: error: ") and message in err


def drain_when_warm(work: Path, out: list[str], status: list[str] | None = None, workers: int = 2) -> None:
    """Once the standby node (``work/agent2.log``, standby workers 2000 ...) is warm,
    ``tmrun-ctl drain 1`` (bounded; its output, even cut short, goes to ``out``); before it,
    ``tmrun-ctl status --json`` to ``status`` when given."""
    deadline = time.monotonic() + 150
    log = work / "agent2.log"
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        if all(f"standby {2000 + worker} warm" in text for worker in range(workers)):
            cmd = [*tmrun_cmd()[:2], "tmrun.cli.ctl", "drain", "1", "--reason", "drain", "--wait", "120"]
            env = {**os.environ, "TMRUN_STATE_DIR": str(work / "state")}
            if status is not None:
                shown = subprocess.run([*tmrun_cmd()[:2], "tmrun.cli.ctl", "status", "--json"], capture_output=True,
                                       text=True, timeout=60, env=env)
                status.append(shown.stdout + shown.stderr)
            try:
                result = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)
                out.append(result.stdout + result.stderr)
            except subprocess.TimeoutExpired as exc:
                out.append(f"timed out: {exc.stdout!r} {exc.stderr!r}")
            return
        time.sleep(0.05)


def drained_on_three_agents(work: Path, nproc: int, rdzv_id: str, job_args: Sequence[str], env: dict[str, str],
                            timeout: float) -> tuple[list[int], list[str], list[str]]:
    """A job over three agents on loopback (``--nnodes 2 --standby 1 --nproc-per-node nproc``:
    two active nodes and a standby node) whose node 1 is drained (``tmrun-ctl drain 1``) once the
    standby node's workers are warm; the agents' exit codes and logs, and what the drain said."""
    requested: list[str] = []
    drainer = threading.Thread(target=drain_when_warm, args=(work, requested, None, nproc), daemon=True)
    drainer.start()
    codes, logs = run_agents(work, 3, lambda port: tmrun_cmd(
        "--nnodes", "2", "--standby", "1", "--nproc-per-node", str(nproc),
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id, "--rdzv-conf", "heartbeat_interval=0.5",
        *job_args,
    ), env, timeout)  # fmt: skip
    drainer.join(timeout=150)
    return codes, logs, requested
