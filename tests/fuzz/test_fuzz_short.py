"""The short run of every fuzz harness in CI (docs/fuzzing.md has the long one): each harness
runs as its own process for a bounded number of inputs from its seed corpus, and any finding
(an exception other than the decoder's documented error, a hang past 5 s, a crash) fails."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris")

HERE = Path(__file__).resolve().parent
RUNS = {  # inputs per harness: about 1-6 s each on a 2-core machine
    "frames": 5000,
    "messages": 20000,
    "ops": 20000,
    "environment": 15000,
    "progress": 4000,
    "liveness": 20000,
    "transfer": 15000,
}


@pytest.mark.parametrize("harness", sorted(RUNS))
def test_harness_finds_nothing(harness: str, tmp_path: Path) -> None:
    cmd = [sys.executable, str(HERE / f"fuzz_{harness}.py"), f"-atheris_runs={RUNS[harness]}", "-seed=1",
           f"-artifact_prefix={tmp_path}/", "-print_final_stats=1"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    findings = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("crash-", "timeout-", "oom-")))
    done = f"Done {RUNS[harness]}" in result.stderr
    # libFuzzer's -timeout alarm can go off while the process exits after "Done" (slow teardown,
    # torch loaded): SIGALRM then kills it after every input ran; that is not a finding
    clean = result.returncode == 0 or (result.returncode == -signal.SIGALRM and done)
    assert clean and not findings, f"{findings}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    assert done, result.stderr[-3000:]
