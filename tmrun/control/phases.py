"""A recovery's phases, from the controller's instants and the workers' (docs/events.md).

Pure: no store, no torch. One clock, Unix time (``time.time()``): the controller's instants are
its own, the ranks' come from their :class:`~tmrun.protocol.messages.RecoveryTiming` records.
The timeline of one recovery, each instant no earlier than the one before it:

* ``failed``: the first sign of the change: the earliest of a survivor's collective losing its
  peer (its socket closed by the kernel as the process exited), a lost node's last heartbeat,
  the controller seeing the failure, and (a migration) the request's time; a failure's
  downtime (the event's ``seconds``) counts from here;
* ``seen``: the controller saw the failure (or took the migration request);
* ``published``: the plan of the new generation was in the store;
* ``switch`` (a migration only): the first rank stopped at the switch step; training went on
  from ``published`` to here, so a migration's downtime (the event's ``seconds``) counts from
  here, and its ``connect`` phase too (``overlap`` = switch - published: trained meanwhile);
* ``connected``: the last rank's links to the new generation were up;
* ``healed``: the last rank had agreed and received the state (then counted itself recovered);
* ``first_step``: the last rank's first step after the recovery ended (None: not every rank
  completed one: the training ended, a later change came first, or the wait ran out).

Phases are the gaps: ``detect`` = seen - failed, ``plan`` = published - seen, ``connect`` =
connected - published, ``transfer`` = healed - connected, ``first_step`` = first_step - healed.
``recover`` = recovered - published (the controller's view: connect + transfer + its polling)
and ``total`` (the event's ``seconds``: failed -> every rank recovered) are kept as before. Instants of different hosts are
compared as they are (their clocks' skew is in the phases); one read earlier than the instant
before it is clamped to it, so every phase is >= 0.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tmrun.protocol.messages import RecoveryTiming

ORDER = ("failed", "seen", "published", "switch", "connected", "healed", "first_step")
PHASES = (("detect", "failed", "seen"), ("plan", "seen", "published"), ("connect", "published", "connected"),
          ("transfer", "connected", "healed"), ("first_step", "healed", "first_step"))


def _latest(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def marks(timings: list[RecoveryTiming], world_size: int, seen: float, published: float,
          asked: float | None = None, evidence: float | None = None) -> dict[str, float | None]:
    """The recovery's instants (see the module's docstring), ordered; None where unknown.
    ``first_step`` is known only when every one of ``world_size`` ranks reported it.
    ``evidence``: the earliest evidence of a failure the controller's reports carry (a lost
    node's last heartbeat, a worker's exit as its agent saw it)."""
    noticed = [t.noticed for t in timings if t.noticed is not None]
    if asked:  # a migration: a rank's "noticed" is when it stopped at the switch step
        failed, switch = min(seen, asked), (min(noticed) if noticed else None)
    else:
        failed, switch = min([seen, *noticed, *([evidence] if evidence else [])]), None
    firsts = [t.first_step for t in timings if t.first_step is not None]
    raw: dict[str, float | None] = {
        "failed": failed,
        "seen": seen,
        "published": published,
        "switch": switch,
        "connected": _latest(t.connected for t in timings),
        "healed": _latest(t.healed for t in timings),
        "first_step": max(firsts) if firsts and len(firsts) >= world_size else None,
    }
    ordered: dict[str, float | None] = {}
    floor = raw["failed"]
    for name in ORDER:
        value = raw[name]
        if value is not None and floor is not None:
            value = max(value, floor)
        ordered[name] = None if value is None else round(value, 6)
        floor = value if value is not None else floor
    return ordered


def downtime(at: dict[str, float | None], recovered: float, seconds: float, planned: bool = False) -> float:
    """The recovery's downtime: from the earliest evidence of the failure (``failed``: a
    survivor's collective losing the peer, a lost node's last heartbeat, the controller seeing
    it, whichever came first) to every rank recovered; for a migration whose switch is known:
    switch -> every rank recovered (training went on before); else ``seconds`` (from the
    failure seen, or the request)."""
    switch, failed = at.get("switch"), at.get("failed")
    if switch is not None:
        return round(max(0.0, recovered - switch), 6)
    if failed is not None and not planned:
        return round(max(seconds, recovered - failed), 6)
    return seconds


def phases(at: dict[str, float | None], recovered: float, seconds: float) -> dict[str, Any]:
    """The phases in seconds from the instants ``at`` (``marks``), the time the controller saw
    every rank recovered and the recovery's ``seconds``; None where an end is unknown."""
    out: dict[str, Any] = {}
    for name, start, end in PHASES:
        if name == "connect" and at.get("switch") is not None:
            start = "switch"  # a migration's links are committed at the switch, not at the plan
        a, b = at.get(start), at.get(end)
        out[name] = None if a is None or b is None else round(max(0.0, b - a), 6)
    switch, published = at.get("switch"), at.get("published")
    if switch is not None and published is not None:
        out["overlap"] = round(max(0.0, switch - published), 6)
    out["recover"] = None if published is None else round(max(0.0, recovered - published), 6)
    out["total"] = round(seconds, 6)
    return out
