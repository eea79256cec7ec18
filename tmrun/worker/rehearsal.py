"""A standby's rehearsal: the warm standby of a job with subgroups (docs/mesh.md, section 1b).

A standby of a job whose ranks made subgroups (a device mesh: HSDP, TP, PP, 3-D) cannot keep a
model built before it knows its rank: the mesh's coordinates, FSDP's shards and a pipeline's
stages are those of the rank it built them as, and torch cannot re-seat them. Built only after
its promotion, in a fresh process, its first step also pays torch's per-process first-use work
(DTensor's sharding propagation, FSDP's lazy initialisation), several steps' time.

So the standby *rehearses*: it runs the script in its sandbox as rank 0 (every group local, no
byte on the network), builds its mesh, model and optimizer and runs ``--shadow-steps`` steps,
which fills those per-process caches with the job's real shapes; then it reports warm and leaves
the rehearsal (:class:`Rehearsed`, raised from ``steps()``): the runner
(:mod:`tmrun.worker.standby_process`) tears the rehearsal's runtime and process groups down,
collects its objects and runs the script again, whose ``tmrun.init()`` waits for the
assignment, all of it before any failure (the teardown and the script's code before
``tmrun.init()`` used to run after the assignment, on the downtime: 0.06 s of a TP joiner's
0.25 s). Assigned a rank, the script builds as that rank, joins the survivors' groups and is
healed, its caches warm. A standby assigned before its rehearsal is warm leaves it the same way
with its assignment, which the second run's ``tmrun.init()`` takes at once.

A rehearsal that fails (the script raises in the sandbox: a value it needs from a peer) costs
nothing but itself: the standby says so in one line and runs the script again as a cold
standby, which waits in ``tmrun.init()`` (section 1). ``TMRUN_REHEARSAL=0`` (or
``--shadow-steps 0``) gives that cold standby from the start.
"""

from __future__ import annotations

import enum
import gc
import os
from typing import NoReturn

from tmrun.protocol import messages as proto
from tmrun.worker import startup_replay
from tmrun.worker.stale_meshes import StaleMeshes

ENV_REHEARSAL = "TMRUN_REHEARSAL"
OFF = ("0", "off", "false", "no")


class Rehearsed(BaseException):
    """Leaves the script's rehearsal run once the standby is assigned. A ``BaseException`` and
    not a ``SystemExit``: a framework's ``except Exception`` and torch's ``@record`` let it
    through; one that swallows it anyway cannot keep the process in its rehearsal (the runner
    runs the script again when it returns, and every later ``steps()`` raises it again)."""

    def __init__(self, assignment: proto.Assignment | None) -> None:
        super().__init__("rehearsal over: " + (
            "warm, the script runs again and waits for its rank" if assignment is None
            else f"assigned rank {assignment.rank} (generation {assignment.gen})"))
        self.assignment = assignment


class Phase(enum.Enum):
    NONE = "none"  # not run by a runner that can run the script again: no rehearsal
    ALLOWED = "allowed"  # the runner can run the script again: rehearse if the job has subgroups
    REHEARSING = "rehearsing"  # the script runs in the sandbox as rank 0
    WARM = "warm"  # the shadow steps done and reported: the script runs again and waits in tmrun.init()
    ASSIGNED = "assigned"  # assigned during the rehearsal: the script runs again as that rank
    FAILED = "failed"  # the rehearsal raised: the script runs again as a cold standby
    OVER = "over"  # the second run


_phase = Phase.NONE
_assignment: proto.Assignment | None = None
_assigned_at = 0.0  # time.monotonic() when the assignment was read
_left_warm = False  # the rehearsal ended warm, unassigned: the second run waits for the assignment
_stale = StaleMeshes()  # the rehearsal's device meshes that torch's caches still hold


def allow() -> None:
    """The runner of a standby: it can run the script a second time (a rehearsal is possible)."""
    global _phase
    if _phase is Phase.NONE:
        _phase = Phase.ALLOWED


def enabled(shadow_steps: int) -> bool:
    """Whether this standby rehearses its job with subgroups (``tmrun.init()`` asks once)."""
    return (_phase is Phase.ALLOWED and shadow_steps > 0
            and os.environ.get(ENV_REHEARSAL, "1").strip().lower() not in OFF)


def begin() -> None:
    """The rehearsal starts (``tmrun.init()``, torch imported). What the process holds now is
    kept for its life (modules, mostly): frozen out of the collector's view, so that collecting
    the rehearsal's garbage between the two runs scans only what the rehearsal made (a full
    collection with torch imported takes 0.14 s on the development machine, on the downtime)."""
    global _phase
    _phase = Phase.REHEARSING
    gc.freeze()


def rehearsing() -> bool:
    return _phase is Phase.REHEARSING


def end(assignment: proto.Assignment, assigned_at: float) -> NoReturn:
    """Assigned during the rehearsal: leave it (raises :class:`Rehearsed`)."""
    global _phase, _assignment, _assigned_at
    if _phase is Phase.REHEARSING:
        _phase, _assignment, _assigned_at = Phase.ASSIGNED, assignment, assigned_at
    raise Rehearsed(assignment)


def leave_warm() -> NoReturn:
    """The rehearsal's shadow steps are done and reported: leave it unassigned (raises
    :class:`Rehearsed`); the runner collects it and runs the script again, whose
    ``tmrun.init()`` waits for the assignment."""
    global _phase
    if _phase is Phase.REHEARSING:
        _phase = Phase.WARM
    raise Rehearsed(_assignment)


def left() -> bool:
    """In the rehearsal's run, once it ended (warm or assigned): every ``steps()`` of a script
    that swallowed the end leaves again (:func:`leave_again`)."""
    return _phase in (Phase.WARM, Phase.ASSIGNED)


def leave_again() -> None:
    """Raise the rehearsal's end again if it ended (a script swallowed it and came back)."""
    if left():
        raise Rehearsed(_assignment)


def failed(why: BaseException) -> bool:
    """The script raised during its rehearsal (before an assignment): True when the runner is to
    run it again as a cold standby (False: not a rehearsal's failure, the runner lets it go)."""
    global _phase
    if _phase is not Phase.REHEARSING:
        return False
    _phase = Phase.FAILED
    return True


def must_run_again() -> bool:
    """After the script's run: whether it was a rehearsal (warm, assigned or failed)."""
    return _phase in (Phase.ASSIGNED, Phase.WARM, Phase.FAILED)


def carried() -> tuple[proto.Assignment | None, float, bool]:
    """For ``tmrun.init()`` of the second run: the assignment taken in the rehearsal (None after
    one that ended warm, :func:`waits_warm`, or failed: a cold standby), when it was read
    (``time.monotonic()``), and whether this run follows a rehearsal at all."""
    return (_assignment, _assigned_at, True) if _phase is Phase.OVER else (None, 0.0, False)


def waits_warm() -> bool:
    """The second run of a rehearsal that ended warm and unassigned: its ``tmrun.init()`` waits
    for the assignment (the standby reported warm in the rehearsal)."""
    return _phase is Phase.OVER and _left_warm


def tear_down() -> None:
    """Between the two runs: the rehearsal's runtime and process groups are dropped and its
    objects collected (a GPU's memory given back); the next ``tmrun.init()`` reads
    :func:`carried`."""
    global _phase, _assignment, _left_warm
    from tmrun.worker import runtime  # the runtime imports this module

    if _phase is Phase.FAILED:  # it never got to remember_meshes(): the caches may hold its meshes all the same
        _stale.remember()
    runtime.drop_for_second_run()
    startup_replay.replay(None)  # local receives get zeros again (a planned joiner builds in local mode)
    if _phase is not Phase.ASSIGNED:
        _assignment = None
    _left_warm = _phase is Phase.WARM
    _phase = Phase.OVER
    gc.collect()
    _stale.collect_holders()  # the rehearsal's meshes torch's caches hold, and where
    _stale.watch()  # each mesh the second run makes takes their place at once
    gc.freeze()  # what survived is long-lived (modules, torch's caches): later collections skip it
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 (a CPU-only torch, or no driver: nothing to give back)
        pass


def remember_meshes() -> None:
    """The rehearsal is warm (its shadow steps done): the device meshes alive now, its own and
    any held by torch's caches (those still alive after its objects are collected are the ones
    to replace). Scanned here, once warm, not after the assignment."""
    _stale.remember()


def finish_meshes() -> tuple[int, int]:
    """Before the second run's first step: (the rehearsal meshes a mesh of this run replaced,
    those no mesh of this run matched, now retired: :mod:`tmrun.worker.stale_meshes`)."""
    if _phase is not Phase.OVER:
        return 0, 0
    retired = _stale.finish()
    return _stale.replaced, retired
