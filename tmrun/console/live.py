"""The live console: a rich ``Live`` view of a running job on the leading agent's terminal.

It only renders: a *feed* (a callable the launcher gives it, see
:mod:`tmrun.launcher.console_feed`) assembles a :class:`ConsoleView` from what the control plane
already publishes, and the console asks it at a bounded rate (``refresh`` seconds) from its own
thread, so it never slows training. When stdout is not a terminal (SLURM logs, pipes), or with
``--console plain``, there is no live view: tmrun's plain timestamped lines, one per event, are
the console (:func:`tmrun.console.say`).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

MODES = ("auto", "live", "plain")
SPARK = "▁▂▃▄▅▆▇█"


@dataclass(frozen=True)
class MemberRow:
    """One rank (or one standby: ``rank`` None) as the console shows it."""

    node: int
    role: str  # active / standby / joining / leaving / failed / exited
    pid: int | None
    rank: int | None = None
    host: str = ""
    step: int | None = None
    step_seconds: float | None = None
    heartbeat_age: float | None = None  # seconds since its last sign of progress
    cpu_percent: float | None = None
    rss_mib: float | None = None
    gpu: str = ""  # "util% mem temp errors" where NVML reads one


@dataclass(frozen=True)
class EventRow:
    time: float
    kind: str
    detail: str


@dataclass(frozen=True)
class ConsoleView:
    run_id: str
    phase: str
    epoch: int
    members: Sequence[MemberRow] = ()
    events: Sequence[EventRow] = ()
    step_history: Sequence[float] = ()  # seconds between consecutive completed steps (rank 0)
    ettr: float | None = None  # share of wall time spent making progress
    elapsed: float = 0.0  # seconds since the job started
    standby_summary: str = ""
    notes: Sequence[str] = field(default_factory=tuple)


def choose_mode(requested: str, stream: object = None) -> str:
    """``auto`` is ``live`` on a terminal, else ``plain``."""
    if requested not in MODES:
        raise ValueError(f"--console must be one of {', '.join(MODES)}, not {requested!r}")
    if requested != "auto":
        return requested
    out = stream if stream is not None else sys.stdout
    return "live" if getattr(out, "isatty", lambda: False)() else "plain"


def sparkline(intervals: Sequence[float], width: int = 48) -> Text:
    """Step intervals as bars; one that is more than twice the median (a recovery, a stall) is
    drawn full and red, so a recovery shows as a gap."""
    recent = list(intervals)[-width:]
    if not recent:
        return Text("(no steps yet)", style="dim")
    ordered = sorted(recent)
    median = ordered[len(ordered) // 2] or 1e-9
    top = max(min(max(recent), 4 * median), 1e-9)
    line = Text()
    for value in recent:
        if value > 2 * median:
            line.append(SPARK[-1], style="bold red")
        else:
            line.append(SPARK[min(len(SPARK) - 1, int(value / top * (len(SPARK) - 1)))], style="green")
    return line


def _number(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


ROLE_STYLE = {"active": "green", "standby": "cyan", "joining": "yellow", "leaving": "magenta",
              "failed": "bold red", "exited": "dim"}


def render(view: ConsoleView) -> Group:
    """The whole screen for one view (a pure function: tested without a terminal)."""
    ettr = "-" if view.ettr is None else f"{100 * view.ettr:.1f}%"
    header = Text.assemble(
        ("tmrun ", "bold"), (view.run_id, "bold cyan"),
        f"  {view.phase}  epoch {view.epoch}  up {view.elapsed:.0f}s  ", ("ETTR ", "bold"), (ettr, "bold green"),
    )
    table = Table(expand=True, pad_edge=False)
    for column in ("node", "rank", "role", "pid", "step", "step s", "hb age s", "cpu %", "mem MiB", "gpu"):
        table.add_column(column, no_wrap=True)
    for row in view.members:
        table.add_row(
            str(row.node), "-" if row.rank is None else str(row.rank),
            Text(row.role, style=ROLE_STYLE.get(row.role, "")), "-" if row.pid is None else str(row.pid),
            "-" if row.step is None else str(row.step), _number(row.step_seconds, ".3f"),
            _number(row.heartbeat_age, ".1f"), _number(row.cpu_percent, ".0f"), _number(row.rss_mib, ".0f"),
            row.gpu or "-",
        )
    feed = Text()
    for event in list(view.events)[-8:]:
        stamp = time.strftime("%H:%M:%S", time.localtime(event.time))
        style = "bold red" if event.kind in ("failure", "lost", "fallback") else ""
        if feed:
            feed.append("\n")
        feed.append(f"{stamp} {event.kind}: {event.detail}", style=style)
    parts: list[object] = [header, table]
    if view.standby_summary:
        parts.append(Text(f"standby pool: {view.standby_summary}"))
    parts.append(Panel(sparkline(view.step_history), title="step intervals (rank 0)", expand=True))
    parts.append(Panel(feed or Text("(no events)", style="dim"), title="events", expand=True))
    parts.extend(Text(note, style="dim") for note in view.notes)
    return Group(*parts)  # type: ignore[arg-type]


class LiveConsole:
    """Renders ``feed()`` every ``refresh`` seconds on a terminal until :meth:`stop`."""

    def __init__(self, feed: Callable[[], ConsoleView], refresh: float = 0.5, console: Console | None = None) -> None:
        self._feed = feed
        self._refresh = refresh
        self._console = console or Console()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tmrun-console", daemon=True)
        self._live: Live | None = None
        self.renders = 0
        self.error: BaseException | None = None

    def start(self) -> None:
        # redirect_stderr: the agent's own lines (console.say) print above the live view
        self._live = Live(console=self._console, refresh_per_second=4, redirect_stdout=True,
                          redirect_stderr=True, transient=False)
        self._live.start()
        self._thread.start()

    def _draw(self) -> None:
        assert self._live is not None
        self._live.update(render(self._feed()), refresh=True)
        self.renders += 1

    def _run(self) -> None:
        while not self._stop.wait(self._refresh):
            try:
                self._draw()
            except Exception as exc:  # noqa: BLE001 - a store gone at the end: keep the last screen
                self.error = exc

    def stop(self) -> None:
        """Draw once more (the final state) and leave the view on the terminal."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self._live is not None:
            try:
                self._draw()
            except Exception as exc:  # noqa: BLE001
                self.error = exc
            self._live.stop()
            self._live = None
