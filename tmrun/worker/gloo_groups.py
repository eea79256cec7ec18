"""A script's gloo group in an in-place job: a tmrun *background* group in its place; any other
backend named (nccl, a mix) is said at once, and a failure then takes the group restart.

Scripts make CPU groups beside their main one: torchtitan's asynchronous checkpoint
(``--checkpoint.async_mode async``) saves through ``dist.new_group(backend="gloo")`` from a
thread of its own, so that its collectives do not interleave with the training's. A gloo group
cannot follow an in-place replacement: its membership is fixed at its rendezvous (the survivors'
group still holds the lost rank; a joiner cannot enter it), and a standby's sandbox waits in that
rendezvous for peers that never come.

So :func:`watch` makes ``torch.distributed.new_group(..., backend="gloo")`` (or ``"cpu:gloo"``)
make a tmrun group instead, marked *background*
(:meth:`tmrun.comm.backend.TmrunProcessGroup.set_background`): it follows replacements as every
tmrun group does, torch's asynchronous DCP save accepts it (it says it serves the CPU), and the
operations of the script's own threads on it never get a value no peer made: a membership change
fails those in flight and every later one of a thread that began before it (an asynchronous save
cut by a failure is not finished: DCP writes no ``.metadata``, so nothing loads it). Rank 0 says
so in one line. Any other named backend (nccl is no better than gloo) is said in one line too, and
this job's changes cannot heal in place (``keys.UNHEALABLE``): a failure takes the group restart
at once.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch.distributed as dist

_MARK = "_tmrun_gloo_watch"
GLOO = ("gloo", "cpu:gloo")


def why(asked: str) -> str:
    """The refusal's reason, for a backend the script asked for that no tmrun group stands in for."""
    return f"the script made a {asked} group (dist.new_group(backend={asked!r})), which no standby can join"


def replaced(asked: str) -> str:
    """The line that says a gloo group is a tmrun background group here."""
    return (f"the script made a {asked} group (dist.new_group(backend={asked!r}); torchtitan: "
            "--checkpoint.async_mode async): it is a tmrun group here, which follows replacements; "
            "a change fails what the script's own threads do on it (an asynchronous checkpoint save cut "
            "by a failure is not finished, and said so)")


def watch(on_foreign: Callable[[str], None], own: str, on_gloo: Callable[[str], None] | None = None) -> None:
    """From now on ``dist.new_group(..., backend=B)``: with ``B`` gloo (``"gloo"``,
    ``"cpu:gloo"``) and ``on_gloo`` given, makes a background group of backend ``own`` instead
    (gloo's own options dropped) and calls ``on_gloo(B)`` the first time; with any other named
    backend but ``own`` (nccl, ``"cpu:gloo,cuda:nccl"``, or gloo without ``on_gloo``), calls
    ``on_foreign(B)`` the first time and makes the group as asked. Idempotent."""
    original = dist.new_group
    if getattr(original, _MARK, False):
        return
    signature = inspect.signature(original)
    said: set[str] = set()

    @functools.wraps(original)
    def new_group(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        asked = bound.arguments.get("backend")
        if not isinstance(asked, str) or asked.lower() in (own.lower(), "undefined", ""):
            return original(*args, **kwargs)
        if asked.lower() in GLOO and on_gloo is not None:
            if "gloo" not in said:
                said.add("gloo")
                on_gloo(asked)
            bound.arguments["backend"] = own
            bound.arguments.pop("pg_options", None)  # gloo's options mean nothing to tmrun's group
            made = original(*bound.args, **bound.kwargs)
            from tmrun.comm.backend import TmrunProcessGroup

            if isinstance(made, TmrunProcessGroup):  # (not a member: torch's placeholder)
                made.set_background()
            return made
        if "foreign" not in said:
            said.add("foreign")
            on_foreign(asked)
        return original(*args, **kwargs)

    setattr(new_group, _MARK, True)
    dist.new_group = new_group  # type: ignore[assignment]


def cut_by_a_change(error: BaseException) -> bool:
    """Whether ``error`` comes from an operation of a background group that a change of the
    job's members cut off (:class:`tmrun.comm.backend.BackgroundInterrupted`), found through
    its causes and contexts and inside DCP's ``CheckpointException`` (its ``failures``: each
    rank's exception with its traceback), as an asynchronous save's future raises it."""
    from tmrun.comm.backend import BackgroundInterrupted

    seen: set[int] = set()
    pending: list[Any] = [error]
    while pending:
        item = pending.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, BackgroundInterrupted):
            return True
        if isinstance(item, BaseException):
            pending += [item.__cause__, item.__context__]
            failures = getattr(item, "failures", None)
            if isinstance(failures, dict):  # DCP's CheckpointException: rank -> (exception, traceback)
                pending += list(failures.values())
        elif isinstance(item, tuple) and item:
            pending.append(item[0])
    return False
