"""A small file per running job on the store host, so `tmrun-ctl` finds the job without flags."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path


def runs_dir() -> Path:
    base = os.environ.get("TMRUN_STATE_DIR") or os.path.join(tempfile.gettempdir(), f"tmrun-{os.getuid()}")
    return Path(base) / "runs"


def event_log_path(run_id: str, log_dir: str | None) -> Path:
    """The job's JSON-lines event log: in torchrun's ``--log-dir`` when given, else next to the
    run file."""
    name = f"{run_id}.events.jsonl"
    return Path(log_dir) / name if log_dir else runs_dir() / name


def token_path(run_id: str) -> Path:
    """The job token's file next to the run file (mode 0600): tmrun-ctl on this host reads it."""
    return runs_dir() / f"{run_id}.token"


def write_runfile(run_id: str, endpoint: str, ops: str = "", event_log: str = "", token: str | None = None) -> Path:
    """``endpoint``: the store; ``ops``: the leader's operations endpoint (what tmrun-ctl uses);
    ``token``: the job token, written to :func:`token_path` (0600), never into the run file."""
    from tmrun.protocol.auth import write_token_file

    directory = runs_dir()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / f"{run_id}.json"
    data = {"run_id": run_id, "endpoint": endpoint, "ops": ops, "event_log": event_log, "pid": os.getpid(),
            "started": time.time()}
    if token:
        write_token_file(str(token_path(run_id)), token)
        data["token_file"] = str(token_path(run_id))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)  # a reader never sees half a file
    return path


def remove_runfile(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.with_suffix(".token").unlink(missing_ok=True)


def live_runs() -> list[dict[str, object]]:
    """Run files whose agent is still alive, newest first."""
    runs = []
    directory = runs_dir()
    if not directory.is_dir():
        return runs
    for path in directory.glob("*.json"):
        try:
            data = read_runfile(path.read_text())
            if data is None:
                continue
            os.kill(int(data["pid"]), 0)  # type: ignore[call-overload]
        except (OSError, ValueError):
            continue
        runs.append(data)
    return sorted(runs, key=lambda r: float(r["started"]), reverse=True)  # type: ignore[arg-type]


def read_runfile(text: str) -> dict[str, object] | None:
    """A run file's content, or None when it is not one (another program's file, a damaged one):
    a JSON object with a positive integer ``pid`` and a finite ``started`` time; never raises."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    pid, started = data.get("pid"), data.get("started")
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < 1 << 31:
        return None
    if not isinstance(started, (int, float)) or isinstance(started, bool) or not abs(started) < float("inf"):
        return None
    return data
