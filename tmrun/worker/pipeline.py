"""Pipeline schedules (``torch.distributed.pipelining``) given to ``tm.track``: a joiner runs
torch's one-time start-up of its pipeline (the neighbours' P2P warm-up and the stages' shape
inference) at its first step, and the survivors of its pipeline must run it with it, or their
next messages meet the joiner's handshake ("ranks called different collectives"). Only the
pipelines with a joiner in a stage's group start again; the other replicas' pipelines go on.

Where the stages hold DTensor parameters (PP x TP x DP, FSDP2 or torchtitan's ``replicate``
within a stage), the start-up's shape inference runs a stage's forward, whose collectives (TP's,
FSDP's gathers) need the joiner's peers in those groups in their start-up too, and then their
pipelines, and so on: there every pipeline starts again (a joiner's own pipeline alone hung in
the first step of PP x TP x DP)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

# the schedule's "already started" flags: single-stage schedules, multi-stage schedules
_STARTED_FLAGS = (("_stage_forward_initialized", "_stage_backward_initialized"),
                  ("_stages_forward_initialized", "_stages_backward_initialized"))
# torch 2.15 keeps the P2P set-up's flag apart (its lifetime spans eval/train switches): a
# survivor that kept it skipped the set-up its joiner ran ("ranks called different collectives")
_P2P_FLAGS = ("_p2p_initialized",)
# the methods that run that start-up: single- and multi-stage schedules (torch 2.14, 2.15)
INIT_METHODS = ("_initialize_stage", "_initialize_stages")


def is_schedule(obj: Any) -> bool:
    try:
        from torch.distributed.pipelining.schedules import _PipelineSchedule
    except ImportError:  # a torch without pipelining
        return False
    return isinstance(obj, _PipelineSchedule)


def stages_of(schedule: Any) -> list:
    stages = getattr(schedule, "_stages", None)
    return list(stages) if stages is not None else [schedule._stage]


def ranks_of(schedule: Any) -> set[int]:
    """The global ranks of every stage group of ``schedule`` (its pipeline)."""
    ranks: set[int] = set()
    for stage in stages_of(schedule):
        ranks.update(dist.get_process_group_ranks(stage.group))
    return ranks


def check_supported(schedule: Any) -> None:
    """A schedule whose start-up flags this torch names otherwise cannot be started again: said
    when it is tracked, not at a recovery."""
    if not any(all(hasattr(schedule, flag) for flag in flags) for flags in _STARTED_FLAGS) or not any(
            callable(getattr(schedule, name, None)) for name in INIT_METHODS):
        raise TypeError(f"tmrun: {type(schedule).__name__} keeps its start-up state in attributes this tmrun does not "
                        f"know ({', '.join(f for flags in _STARTED_FLAGS for f in flags)}, _initialize_stage(s) are "
                        "missing): a rank "
                        "replaced in place could not run the pipeline's start-up with its neighbours")
    for stage in stages_of(schedule):
        if not isinstance(getattr(stage, "submod", None), torch.nn.Module) or not hasattr(stage, "group"):
            raise TypeError(f"tmrun: {type(schedule).__name__}'s stage {type(stage).__name__} holds its module or its "
                            "process group in attributes this tmrun does not know (submod, group): its failure "
                            "drills and its pipeline's restart after a replacement could not find them")


def _start_flags(schedule: Any) -> tuple[str, str] | None:
    """The names of ``schedule``'s "forward / backward started" flags (single- or multi-stage),
    or None where it has neither pair."""
    for forward, backward in _STARTED_FLAGS:
        if hasattr(schedule, forward) and hasattr(schedule, backward):
            return forward, backward
    return None


def started(schedule: Any) -> bool:
    """Whether ``schedule`` ran its start-up (forward and backward) already."""
    flags = _start_flags(schedule)
    return flags is not None and all(getattr(schedule, flag) for flag in flags)


def needs_startup(schedule: Any) -> bool:
    """Whether torch's next ``_initialize_stage(s)`` of ``schedule`` runs a start-up: the first,
    or a switch between ``eval()`` and ``step()`` (torch 2.14 starts the stages again then)."""
    flags = _start_flags(schedule)
    if flags is None:
        return True
    forward, backward = (bool(getattr(schedule, flag)) for flag in flags)
    return not forward or bool(getattr(schedule, "_has_backward", False)) != backward


def p2p_done(schedule: Any) -> bool:
    """Whether ``schedule`` ran its P2P warm-up (its first start-up) already."""
    for flag in _P2P_FLAGS:
        if hasattr(schedule, flag):
            return bool(getattr(schedule, flag))
    flags = _start_flags(schedule)
    return flags is not None and bool(getattr(schedule, flags[0]))


def tensor_parallel(schedule: Any) -> bool:
    """Whether a stage of ``schedule`` holds DTensor parameters (TP, FSDP2: its forward issues
    collectives outside the pipeline)."""
    from torch.distributed.tensor import DTensor

    for stage in stages_of(schedule):
        module = getattr(stage, "submod", None)
        if isinstance(module, torch.nn.Module) and any(isinstance(p, DTensor) for p in module.parameters()):
            return True
    return False


def restart_where_joined(schedules: list, joined: set[int], everywhere: bool = False) -> int:
    """Mark every schedule whose pipeline has a rank in ``joined`` as not started (every schedule
    with ``everywhere``: the caller found stages holding DTensor parameters, :func:`tensor_parallel`),
    so that its next step runs torch's start-up again, together with the joiner's first. Returns
    how many."""
    restarted = 0
    for schedule in schedules:
        if not everywhere and not ranks_of(schedule) & joined:
            continue
        for flags in (*_STARTED_FLAGS, _P2P_FLAGS):
            for flag in flags:
                if hasattr(schedule, flag):
                    setattr(schedule, flag, False)
        restarted += 1
    return restarted
