"""The live console's screen as a person reads it (rendered to text, no terminal needed)."""

from __future__ import annotations

import io
import time

import pytest
from rich.console import Console

from tmrun.console.live import ConsoleView, EventRow, LiveConsole, MemberRow, choose_mode, render, sparkline


def _text(view: ConsoleView, width: int = 140) -> str:
    console = Console(file=io.StringIO(), width=width, record=True, color_system=None)
    console.print(render(view))
    return console.export_text()


VIEW = ConsoleView(
    run_id="job7", phase="running", epoch=1, elapsed=42.0, ettr=0.987,
    members=[MemberRow(node=0, rank=0, role="active", pid=101, step=17, step_seconds=0.412, heartbeat_age=0.3,
                       cpu_percent=98.0, rss_mib=812.0),
             MemberRow(node=0, rank=1, role="joining", pid=303, step=16),
             MemberRow(node=0, rank=None, role="standby", pid=404, cpu_percent=1.0)],
    events=[EventRow(time.time(), "failure", "rank 1 (pid 202) signal SIGKILL"),
            EventRow(time.time(), "recovered", "generation 1: all 2 ranks back in 0.231s")],
    step_history=[0.4, 0.41, 0.39, 2.5, 0.4], standby_summary="1 warming")


def test_every_member_event_and_the_ettr_are_on_screen() -> None:
    screen = _text(VIEW)
    assert "job7" in screen and "epoch 1" in screen and "ETTR 98.7%" in screen
    for expected in ("101", "joining", "303", "standby", "404", "0.412", "812"):
        assert expected in screen
    assert "failure: rank 1 (pid 202) signal SIGKILL" in screen and "all 2 ranks back in 0.231s" in screen
    assert "standby pool: 1 warming" in screen


def test_a_recovery_shows_as_a_gap_in_the_step_history() -> None:
    line = sparkline([0.4, 0.41, 0.39, 2.5, 0.4])
    assert line.plain[3] == "█" and any(span.style == "bold red" for span in line.spans)
    assert sparkline([]).plain == "(no steps yet)"


def test_unknown_values_are_dashes_not_errors() -> None:
    screen = _text(ConsoleView(run_id="r", phase="forming", epoch=0, members=[MemberRow(node=2, role="standby", pid=None)]))
    assert "forming" in screen and "(no events)" in screen and "(no steps yet)" in screen


def test_mode_auto_follows_the_terminal() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert choose_mode("auto", Tty()) == "live" and choose_mode("auto", io.StringIO()) == "plain"
    assert choose_mode("plain", Tty()) == "plain" and choose_mode("live", io.StringIO()) == "live"
    with pytest.raises(ValueError, match="--console must be one of"):
        choose_mode("fancy")


def test_the_console_asks_its_feed_at_a_bounded_rate_and_draws_the_final_state() -> None:
    calls: list[float] = []

    def feed() -> ConsoleView:
        calls.append(time.monotonic())
        return VIEW

    out = io.StringIO()
    live = LiveConsole(feed, refresh=0.1, console=Console(file=out, width=120, force_terminal=True))
    live.start()
    time.sleep(0.55)
    live.stop()
    assert 3 <= len(calls) <= 8  # about every 0.1 s, plus the final draw
    assert live.error is None and "job7" in out.getvalue()


def test_a_failing_feed_keeps_the_console_alive() -> None:
    def feed() -> ConsoleView:
        raise ConnectionError("store gone")

    live = LiveConsole(feed, refresh=0.05, console=Console(file=io.StringIO(), force_terminal=True))
    live.start()
    time.sleep(0.2)
    live.stop()
    assert isinstance(live.error, ConnectionError)
