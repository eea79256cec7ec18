"""Compiled code a standby traced before it had its rank is dropped when it takes one.

Dynamo folds ``dist.get_rank()``, ``dist.get_world_size()`` and ``get_process_group_ranks()``
into the graphs it traces, as constants, with no guard: torch assumes a process keeps its rank.
A standby does not: its sandbox (and its rehearsal, whose second run reuses the same code
objects and so dynamo's caches) runs the script as another rank, and a function compiled there
would go on computing with that rank's values once the standby is a member. torchtitan's
vocabulary-parallel loss, compiled, reads its tensor-parallel rank so: a joiner that reused its
rehearsal's graph took its peer's vocabulary shard, and the job trained on with wrong values on
every rank alike (tmrun's tests, 2026-12-07: the redone step's loss 12.15 against torchrun's
8.08). Taking a rank therefore resets dynamo's caches: the joiner's first step compiles again,
for its rank (inductor's on-disk cache can serve the graphs that did not change; how much that
saves was not measured).
"""

from __future__ import annotations

import sys
from typing import Callable


def traced_graphs() -> int:
    """How many graphs dynamo has traced in this process (0 when it was never loaded)."""
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(dynamo_utils, "counters", None)
    if counters is None:
        return 0
    return int(counters["stats"].get("unique_graphs", 0))


def forget_for_new_rank(rank: int, log: Callable[[str], None]) -> bool:
    """Reset dynamo's caches if it compiled anything in this process; True when it did. Never
    imports dynamo (1 s) when the script compiled nothing."""
    graphs = traced_graphs()
    if graphs == 0:
        return False
    import torch

    torch.compiler.reset()
    log(f"rank {rank}: {graphs} graph(s) compiled before this process had its rank dropped "
        "(dynamo folds the rank into them); they compile again for this rank")
    return True
