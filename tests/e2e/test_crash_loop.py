"""A script that fails at start on every start is not restarted again and again (issue 31): the
job ends after two starts with one line that says so, however many restarts it allows."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import SCRIPTS, run_job, tmrun_cmd


@pytest.mark.parametrize("output", ["terminal", "redirected"])
def test_a_script_that_fails_at_every_start_ends_after_two_starts(tmp_path: Path, output: str) -> None:
    """Its workers' stderr on the terminal (their error is right above the line), or redirected
    to files (the live console's way; --redirects 3): the line then carries the error itself."""
    starts = tmp_path / "starts"
    redirect = ("--redirects", "3", "--log-dir", str(tmp_path / "logs")) if output == "redirected" else ()
    cmd = tmrun_cmd("--standalone", "--nproc-per-node", "2", "--standby", "1", "--max-restarts", "10", *redirect,
                    str(SCRIPTS / "fails_at_start.py"))
    code, log = run_job(cmd, tmp_path / "log", env={"STARTS_FILE": str(starts), "TMRUN_STATE_DIR": str(tmp_path / "s")},
                        timeout=120)
    assert code == 1, log
    started = starts.read_text().splitlines()  # a rank stopped by its peer's failure may not get to write
    assert 2 <= len(started) <= 4, (started, log)  # two starts of the two ranks, not eleven
    assert "epoch 2" in log and "epoch 3" not in log, log
    lines = [line for line in log.splitlines() if "the script fails at start" in line]
    assert lines and lines[-1].startswith("tmrun: error: job failed: the script fails at start: 2 starts in a row"), log
    assert "before any rank reached tmrun.init()" in lines[-1] and "exit code 2" in lines[-1], log
    if output == "redirected":
        assert "exit code 2: fails_at_start.py: error: the following arguments are required: --lr" in lines[-1], log
        assert "its own error is in the workers' output" not in lines[-1], log
    else:
        assert lines[-1].endswith("its own error is in the workers' output); not restarted again"), log
    assert "the group restart was not measured (no progress records" in log, log  # no claim about the API
    assert "Setting OMP_NUM_THREADS" not in log, log  # tmrun chose torch's default without its banner
    assert "ETTR none (the job failed)" in log and "Traceback" not in log.replace("usage:", ""), log
