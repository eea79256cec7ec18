"""The live console as a person sees it: tmrun in a tmux pane (a real terminal), a failure and
a planned migration injected, the pane captured before, during and after; the test reads the
screen. Set TMRUN_SAVE_CAPTURES=DIR to keep the captures (docs/console-capture.md is made so)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers import EXAMPLES, TAG_VAR, tagged_pids, tmrun_cmd, wait_until

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux)")

STEPS = 70  # the refilled standby was warm by step 21 here (2026-11-25): over 3x that on a loaded machine
FAIL_STEP = 12


class Pane:
    """One tmux server of our own (its own socket), one session, one pane."""

    def __init__(self, command: list[str], env: dict[str, str], width: int = 170, height: int = 48) -> None:
        self.socket = f"tmrun-test-{uuid.uuid4().hex[:8]}"
        self.tag = uuid.uuid4().hex
        # the test runner's COLUMNS/LINES (80x24) would reach the pane through the tmux server
        sized = {**env, TAG_VAR: self.tag, "COLUMNS": str(width), "LINES": str(height)}
        env_args = [arg for name, value in sized.items() for arg in ("-e", f"{name}={value}")]
        # the shell keeps the pane (and its last screen) after tmrun exits
        shell = " ".join(subprocess.list2cmdline([c]) for c in command) + "; echo TMRUN-EXIT=$?; sleep 600"
        self._tmux("new-session", "-d", "-s", "job", "-x", str(width), "-y", str(height), *env_args, shell)

    def _tmux(self, *args: str) -> str:
        result = subprocess.run(["tmux", "-L", self.socket, "-f", os.devnull, *args], capture_output=True, text=True, timeout=30)
        if result.returncode != 0:
            raise RuntimeError(f"tmux {args[0]}: {result.stderr.strip()}")
        return result.stdout

    def size(self) -> str:
        return self._tmux("display", "-p", "-t", "job", "#{window_width}x#{window_height}").strip()

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", "job")

    def wait_for(self, pattern: str, timeout: float) -> str:
        """The first screen on which ``pattern`` (a regex) shows, or fail with the last screen."""
        deadline = time.monotonic() + timeout
        screen = ""
        while time.monotonic() < deadline:
            screen = self.screen()
            if re.search(pattern, screen):
                return screen
            time.sleep(0.2)
        raise AssertionError(f"{pattern!r} never showed within {timeout:g}s; last screen:\n{screen}")

    def close(self) -> list[int]:
        for pid in tagged_pids(self.tag):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        try:
            self._tmux("kill-server")
        except RuntimeError:
            pass
        wait_until(lambda: not tagged_pids(self.tag), 10)
        return tagged_pids(self.tag)


def _save(captures: dict[str, str]) -> None:
    target = os.environ.get("TMRUN_SAVE_CAPTURES")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        for name, screen in captures.items():
            (Path(target) / f"{name}.txt").write_text(screen)


def test_the_live_console_shows_a_failure_and_a_migration(tmp_path: Path) -> None:
    work = tmp_path / "console"
    work.mkdir()
    state = work / "state"
    cmd = tmrun_cmd(
        "--console", "live", "--log-dir", str(work / "logs"), "--standalone", "--nproc-per-node", "2",
        "--standby", "1", "--standby-refill-delay", "0", "--inject-failure", f"rank=1,step={FAIL_STEP}",
        str(EXAMPLES / "train_inplace.py"), "--steps", str(STEPS), "--width", "48", "--batch", "16",
        "--step-time", "0.3", "--step-log", str(work / "steps-{rank}.log"), "--final", str(work / "final"),
    )
    pane = Pane(cmd, {"TMRUN_STATE_DIR": str(state), "PYTHONUNBUFFERED": "1"})
    captures: dict[str, str] = {}
    try:
        assert pane.size() == "170x48"
        captures["1-before"] = pane.wait_for(r"standby\s", 120)
        before = pane.wait_for(r"(?s)ETTR.*│\s*0\s*│\s*0\s*│\s*active.*│\s*0\s*│\s*1\s*│\s*active", 120)
        assert "tmrun" in before and "epoch 1" in before
        captures["2-failure"] = pane.wait_for(r"recovered: .*back in", 120)
        assert "failure" in captures["2-failure"] or "replace" in captures["2-failure"], captures["2-failure"]
        # the refilled standby's warm-up shows (warming, then warm: it finished its shadow steps);
        # then a planned migration
        pane.wait_for(r"standby pool: 1 (warming|ready)", 120)
        pane.wait_for(r"(?m)standby pool: 1 warm\s*$", 120)
        ctl = subprocess.run([*tmrun_cmd()[:2], "tmrun.cli.ctl", "migrate", "0", "--reason", "console-test"],
                             capture_output=True, text=True, timeout=60,
                             env={**os.environ, "TMRUN_STATE_DIR": str(state)})
        assert ctl.returncode == 0, ctl.stdout + ctl.stderr
        captures["3-migration"] = pane.wait_for(r"migrate: .*console-test", 120)
        captures["4-after"] = pane.wait_for(r"TMRUN-EXIT=\d+", 240)
    finally:
        _save(captures)
        left = pane.close()
    after = captures["4-after"]
    assert "TMRUN-EXIT=0" in after, after
    assert "succeeded" in after and re.search(r"ETTR \d+\.\d%", after), after
    assert "\x1b" not in after  # a clean screen, not raw escape codes
    assert not re.search(r"\[rank\d\]|\[tmrun worker", after), after  # workers' output went to the log files
    assert left == []
