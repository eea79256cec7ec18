"""A gloo (or any other non-tmrun) group in an in-place job: said at once, and a failure then
takes the group restart.

Scripts make CPU groups beside their main one: torchtitan's asynchronous checkpoint
(``--checkpoint.async_mode async``) saves through ``dist.new_group(backend="gloo")`` so that its
background collectives do not interleave with the training's. A gloo group cannot follow an
in-place replacement: its membership is fixed at its rendezvous (the survivors' group still holds
the lost rank; a joiner cannot enter it), and a standby's sandbox waits in that rendezvous for
peers that never come. Before, such a job's standby never got warm and every failure waited out
``--standby-wait`` before the group restart, with nothing saying why. (A "tmrun" group in its
place does not do either: torch's asynchronous DCP save requires a group with a registered CPU
backend, which a Python process group has not.)

:func:`watch` makes ``torch.distributed.new_group`` say so in one line when the script asks for
gloo (or another named backend than tmrun's: nccl is no better), and tells the controller that
this job's changes cannot heal in place (``keys.UNHEALABLE``): a failure then takes the group
restart at once.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch.distributed as dist

_MARK = "_tmrun_gloo_watch"


def why(asked: str) -> str:
    """The line's reason, for the backend the script asked for."""
    hint = "; torchtitan: --checkpoint.async_mode async" if "gloo" in asked.lower() else ""
    return f"the script made a {asked} group (dist.new_group(backend={asked!r}){hint}), which no standby can join"


def watch(on_foreign: Callable[[str], None], own: str) -> None:
    """From now on ``dist.new_group(..., backend=B)`` with any named backend ``B`` but ``own``
    (gloo, ``"cpu:gloo"``, nccl, ...) calls ``on_foreign(B)`` (the first time only), then makes
    the group as asked. Idempotent."""
    original = dist.new_group
    if getattr(original, _MARK, False):
        return
    signature = inspect.signature(original)
    seen: list[bool] = []

    @functools.wraps(original)
    def new_group(*args: Any, **kwargs: Any) -> Any:
        asked = signature.bind(*args, **kwargs).arguments.get("backend")
        if isinstance(asked, str) and asked.lower() not in (own.lower(), "undefined", "") and not seen:
            seen.append(True)
            on_foreign(str(asked))
        return original(*args, **kwargs)

    setattr(new_group, _MARK, True)
    dist.new_group = new_group  # type: ignore[assignment]
