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


def write_runfile(run_id: str, endpoint: str) -> Path:
    directory = runs_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{run_id}.json"
    path.write_text(json.dumps({"run_id": run_id, "endpoint": endpoint, "pid": os.getpid(), "started": time.time()}))
    return path


def remove_runfile(path: Path) -> None:
    path.unlink(missing_ok=True)


def live_runs() -> list[dict[str, object]]:
    """Run files whose agent is still alive, newest first."""
    runs = []
    directory = runs_dir()
    if not directory.is_dir():
        return runs
    for path in directory.glob("*.json"):
        try:
            data = json.loads(path.read_text())
            os.kill(int(data["pid"]), 0)
        except (OSError, ValueError, KeyError):
            continue
        runs.append(data)
    return sorted(runs, key=lambda r: float(r["started"]), reverse=True)  # type: ignore[arg-type]
