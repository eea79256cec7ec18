"""State a step changes that the script did not give to ``tm.track``: LR schedulers and gradient
scalers, tracked for it where that is unambiguous.

Left out, either one parts the replicas silently after a failure: a joiner's scheduler starts
at epoch 0 (its learning rates are the first steps' while the survivors' are further on), its
gradient scaler at the initial scale (under DDP the ranks then average gradients scaled
differently), and a step that a failure aborts advances the survivors' copies twice.

So when ``steps()`` starts, every process (survivor, standby, joiner) looks for them once:

* **an LR scheduler** (``torch.optim.lr_scheduler.LRScheduler``, ``ReduceLROnPlateau``) whose
  optimizer is a tracked one that no tracked object already schedules: the one outermost such
  scheduler (a ``SequentialLR``, not the schedulers it holds) is tracked as
  ``"<optimizer's name>/lr_scheduler"``;
* **a gradient scaler** (``torch.amp.GradScaler``, CUDA's too), enabled and not tracked: the
  only one in the process is tracked as ``"tmrun/grad_scaler"``.

The names come from the script's own names (and "/" is not in a keyword's), so every rank that
runs the same script tracks the same objects under the same names; healing moves their state
like any tracked object's (a rank that found something another did not fails the healing with
:class:`~tmrun.worker.tracked.TrackError`: never a silent mismatch). Where the choice is not
unambiguous (two schedulers of one optimizer, two scalers), nothing is guessed: the caller
warns, naming what to give to ``tm.track``. One scan of the garbage collector's objects:
once per process, never per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tmrun.worker.live_objects import instances_of
from tmrun.worker.optimizer import scheduled, unwrap as unwrap_optimizer
from tmrun.worker.tracked import TrackedState

SCHEDULER_KINDS: tuple[type, ...] = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
SCALER_NAME = "tmrun/grad_scaler"


def scheduler_name(optimizer_name: str) -> str:
    return f"{optimizer_name}/lr_scheduler"


@dataclass
class Adopted:
    """What :func:`adopt` found: tracked for the script, and left to it."""

    tracked: dict[str, str] = field(default_factory=dict)  # name -> type's name
    unsure_schedules: list[str] = field(default_factory=list)  # optimizers with several schedulers
    unsure_scalers: int = 0  # untracked enabled scalers left (several: none tracked)


def _held_schedulers(obj: Any) -> list[Any]:
    """The schedulers a container holds (SequentialLR's and ChainedScheduler's ``_schedulers``,
    torchtitan's container's ``schedulers``)."""
    return [*(getattr(obj, "schedulers", None) or []), *(getattr(obj, "_schedulers", None) or [])]


def adopt(state: TrackedState) -> Adopted:
    """Track the unambiguous untracked LR schedulers and gradient scaler (see the module's
    docstring); return what was tracked and what was left."""
    out = Adopted()
    tracked_objects = state.objects()
    followed: set[int] = set()  # the optimizers a tracked scheduler (or container of some) steps
    for obj in tracked_objects.values():
        for candidate in [obj, *_held_schedulers(obj)]:
            if isinstance(candidate, SCHEDULER_KINDS):
                followed.add(id(unwrap_optimizer(getattr(candidate, "optimizer", None))))
    live = instances_of(*SCHEDULER_KINDS, torch.amp.GradScaler)  # one scan of the collector's objects
    schedulers = list({id(obj): obj for kind in SCHEDULER_KINDS for obj in live[kind]}.values())
    held = {id(inner) for outer in schedulers for inner in _held_schedulers(outer)}
    tracked_ids = {id(obj) for obj in tracked_objects.values()}
    for name, optimizer in state.optimizers().items():
        if id(optimizer) in followed:
            continue
        mine = [s for s in schedulers if id(s) not in held and id(s) not in tracked_ids
                and unwrap_optimizer(getattr(s, "optimizer", None)) is optimizer]
        if len(mine) == 1:
            state.track(**{scheduler_name(name): mine[0]})
            out.tracked[scheduler_name(name)] = type(mine[0]).__name__
        elif mine or scheduled(optimizer):
            # several (which one is which on another rank cannot be told), or one the scan
            # cannot reach (the optimizer's step is wrapped by a scheduler it does not find)
            out.unsure_schedules.append(name)
    scalers = [s for s in live[torch.amp.GradScaler] if id(s) not in tracked_ids and s.is_enabled()]
    if len(scalers) == 1 and SCALER_NAME not in state.names:
        state.track(**{SCALER_NAME: scalers[0]})
        out.tracked[SCALER_NAME] = type(scalers[0]).__name__
    else:
        out.unsure_scalers = len(scalers)
    return out


def describe(adopted: Adopted) -> list[str]:
    """The lines rank 0 logs: what was tracked for the script, and a warning per thing left."""
    lines: list[str] = []
    if adopted.tracked:
        what = ", ".join(f"{name!r} ({kind})" for name, kind in adopted.tracked.items())
        lines.append(f"tracked for the script: {what}: a joiner receives their state and a step that a failure "
                     "aborts is undone in them (give them to tm.track to name them yourself)")
    for name in adopted.unsure_schedules:
        lines.append(f"warning: an LR scheduler steps the tracked optimizer {name!r} but is not tracked, and tmrun "
                     "cannot tell which one to track: a step that a failure aborts would advance it twice, and a "
                     "joiner's learning rates would be the first steps'; give it to tm.track")
    if adopted.unsure_scalers:
        lines.append(f"warning: {adopted.unsure_scalers} gradient scalers (torch.amp.GradScaler) not tracked, and "
                     "tmrun tracks one only when it is the only one: a joiner would start from the initial scale "
                     "and a step that a failure aborts would update the scale twice, so the ranks' scales could "
                     "part; give them to tm.track (e.g. tm.track(scaler=scaler))")
    return lines
