"""The job's recovery totals and the event log's structured fields, from its events alone.

Pure functions over event dicts (the JSON of :class:`~tmrun.protocol.messages.Event` plus
``seq``): no store, no torch. What each number is computed from (docs/events.md):

* ``downtime_s``: the sum of the ``seconds`` of every ``recovered`` event (the controller's
  measure from the failure it saw, or the migration request, until every rank counted itself
  recovered into the new generation) and of every ``restarted`` event (a group restart: from the
  earliest evidence of the failure until the restarted group completed again the first step it
  had not completed before, :mod:`tmrun.control.restarts`). A restart without a measured
  ``restarted`` event (its workers write no progress) is counted in ``restarts`` and flagged.
* ``steps_recomputed``: per in-place recovery that followed a failure, the event's
  ``steps_recomputed`` (1 when a survivor redoes the step it was in, 0 when every survivor's step
  had committed: a rank lost in or after its optimizer step), else one (the runtime resumes at
  the first step not committed everywhere: at most the aborted step); zero per
  planned migration (nothing is recomputed), and a restart's ``steps_recomputed`` (the steps
  completed before the failure and again after it, from the checkpoint the script resumed).
* ``ettr``: (wall - downtime) / wall, wall from the first ``formed`` event (else the first
  event) to the job's end (``closed``) or to now.
"""

from __future__ import annotations

import re
import time
from typing import Any

_GEN = re.compile(r"\bgeneration (\d+)")
_SECONDS = re.compile(r"back in ([0-9]+(?:\.[0-9]+)?)\s*s")
_RANKS = re.compile(r"\branks? (\d+)")
_NODE = re.compile(r"\bnode (\d+)")
_NEW_EPOCH = re.compile(r"^epoch \d+:")


def enrich(event: dict[str, Any]) -> dict[str, Any]:
    """The event with its structured fields filled in from its detail where its writer did not
    give them (the one-node controller writes text only): ``gen`` ("generation N"; on one node
    the event's epoch field is the generation for replace/migrate/recovered), ``seconds``
    ("back in Xs"), ``ranks``, ``nodes``, and ``phases`` (the recovery phases known: ``total``)."""
    out = dict(event)
    detail = str(out.get("detail", ""))
    kind = out.get("kind")
    if "gen" not in out:
        match = _GEN.search(detail)
        if match:
            out["gen"] = int(match.group(1))
        elif kind in ("replace", "migrate", "recovered") and "generation" not in detail and not _NEW_EPOCH.match(detail):
            out["gen"] = out.get("epoch")  # the one-node controller records its generation there
    if kind == "recovered" and "seconds" not in out:
        match = _SECONDS.search(detail)
        if match:
            out["seconds"] = float(match.group(1))
    if "ranks" not in out and kind in ("replace", "migrate", "migrate-refused", "migrate-cancelled", "fallback", "failure"):
        found = re.findall(r"(\d+)\s*->\s*standby", detail) or _RANKS.findall(detail)
        if found:
            out["ranks"] = sorted({int(r) for r in found})
    if "nodes" not in out:
        nodes = sorted({int(n) for n in _NODE.findall(detail)})
        if nodes:
            out["nodes"] = nodes
    if kind == "recovered":
        phases = dict(out.get("phases") or {})
        phases.setdefault("detect", None)
        phases.setdefault("plan", None)
        phases.setdefault("connect", None)
        phases.setdefault("transfer", None)
        phases.setdefault("recover", None)
        phases.setdefault("first_step", None)
        phases.setdefault("total", out.get("seconds"))
        out["phases"] = phases
    return out


def link_phases(event: dict[str, Any], published: dict[int, float]) -> dict[str, Any]:
    """Fill a ``recovered`` event's ``plan`` and ``recover`` phases from the time of the
    ``replace``/``migrate`` event of its generation (recorded once the plan was published):
    ``recover`` = published -> every rank recovered (the links' switch, the state transfer and
    the agreement), ``plan`` = ``seconds`` - ``recover`` (failure seen -> plan published).
    ``published`` (generation -> time) is the caller's state across events, in order."""
    gen = event.get("gen")
    if not isinstance(gen, int):
        return event
    if event.get("kind") in ("replace", "migrate"):
        published[gen] = float(event["time"])
    elif event.get("kind") == "recovered" and gen in published:
        phases = event.setdefault("phases", {})
        recover = max(0.0, float(event["time"]) - published.pop(gen))
        if phases.get("recover") is None:
            phases["recover"] = round(recover, 6)
        seconds = event.get("seconds")
        if phases.get("plan") is None and isinstance(seconds, (int, float)):
            phases["plan"] = round(max(0.0, seconds - recover), 6)
    return event


def totals(events: list[dict[str, Any]], now: float | None = None) -> dict[str, Any]:
    """The job's recovery totals so far (see the module's docstring for each number)."""
    now = time.time() if now is None else now
    events = [enrich(e) for e in events]
    formed = [e["time"] for e in events if e.get("kind") == "formed"]
    start = formed[0] if formed else (events[0]["time"] if events else now)
    closing = [e for e in events if e.get("kind") == "closed"]
    closed = [e["time"] for e in closing]
    end = closed[-1] if closed else now
    # "failed: ..." (the leader's closed event): the job's work since its last checkpoint is
    # lost, which no event measures: such a job has no ETTR (never a 100% for a failed job)
    failed = bool(closing) and str(closing[-1].get("detail", "")).startswith("failed")
    downtime = 0.0
    recoveries = migrations = failures = restarts = recomputed = measured_restarts = 0
    planned_pending = False
    fallback_pending = False  # a fallback's group restart shows as a new epoch next
    for event in events:
        kind = event.get("kind")
        if kind == "migrate":
            migrations += 1
            planned_pending = True
        elif kind == "replace":
            if _NEW_EPOCH.match(str(event.get("detail", ""))):
                restarts += 0 if fallback_pending else 1  # a fallback's own restart is counted once
                fallback_pending = False
            planned_pending = False
        elif kind == "fallback":
            restarts += 1
            fallback_pending = True
        elif kind == "failure":
            failures += 1
        elif kind == "restarted" and isinstance(event.get("seconds"), (int, float)):
            measured_restarts += 1
            downtime += float(event["seconds"])
            recomputed += int(event.get("steps_recomputed") or 0)
        elif kind == "recovered":
            recoveries += 1
            downtime += float(event.get("seconds") or 0.0)
            if not planned_pending:  # what the survivors said, else the step in flight
                said = event.get("steps_recomputed")
                recomputed += said if isinstance(said, int) and not isinstance(said, bool) and said >= 0 else 1
            planned_pending = False
    wall = max(end - start, 0.0)
    ettr = (wall - downtime) / wall if wall > 0 else 1.0
    return {
        "wall_s": round(wall, 3),
        "downtime_s": round(downtime, 3),
        "ettr": None if failed else round(max(ettr, 0.0), 6),
        "failed": failed,
        "recoveries": recoveries,
        "migrations": migrations,
        "failures": failures,
        "restarts": restarts,
        "steps_recomputed": recomputed,
        "restarts_measured": min(measured_restarts, restarts),
        "restarts_excluded": restarts > measured_restarts,  # a restart's downtime is not in downtime_s / ettr
        "finished": bool(closed),
    }


def describe(t: dict[str, Any]) -> str:
    """One line for the job's end and for tmrun-ctl status."""
    ettr = "none (the job failed)" if t.get("ettr") is None else f"{t['ettr'] * 100:.2f}%"
    line = (f"downtime {t['downtime_s']:.3f}s over {t['wall_s']:.1f}s, ETTR {ettr}, "
            f"{t['recoveries']} in-place recoveries ({t['migrations']} planned), "
            f"{t['steps_recomputed']} steps recomputed")
    if t["restarts"]:
        plural = "s" if t["restarts"] != 1 else ""
        measured = t.get("restarts_measured", 0)
        if measured == t["restarts"]:
            line += f", {t['restarts']} group restart{plural} (counted above)"
        elif measured:
            line += f", {t['restarts']} group restarts ({t['restarts'] - measured} not measured: not in the downtime)"
        else:
            line += f", {t['restarts']} group restart{plural} (not in the downtime)"
    return line
