"""Which device (``LOCAL_RANK``) a single-node standby worker gets.

Active workers hold local ranks ``0 .. nproc-1`` (torch's agent numbers them; a script puts
local rank ``i`` on ``cuda:i``). A standby gets a *spare* local rank, ``nproc`` and up, so it
warms up on a GPU of its own (``--nproc-per-node 7 --standby 1`` on an 8-GPU node: the
standby is on GPU 7), and keeps it when it is promoted (its process, environment and CUDA
context stay; ``LOCAL_RANK`` and the device say which GPU the rank now runs on).

The device of a rank that failed is not reused: a promoted standby's local rank stays *held*
(the process that holds it may fail too), and a refill standby takes the lowest spare local rank
that no live standby and no held one has. When the node has no spare GPU left, no standby is
started (one line says why) unless ``TMRUN_STANDBY_SHARE_GPU=1`` lets standbys share the
active ranks' GPUs (they then take local ranks modulo the GPU count). A node without GPUs
(``gpus == 0``) has no such limit: local ranks are labels.
"""

from __future__ import annotations

import os
from typing import Collection, Optional

ENV_SHARE = "TMRUN_STANDBY_SHARE_GPU"


def visible_gpus(environ: Optional[dict] = None) -> int:
    """GPUs this node's workers can use: ``CUDA_VISIBLE_DEVICES`` when set, else NVML's count,
    else 0 (no GPU, or no way to tell)."""
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and not d.strip().startswith("-")])
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001  no driver, no library: a CPU node as far as standbys go
        return 0


def standby_local_rank(nproc: int, gpus: int, live: Collection[int], held: Collection[int],
                       share: bool = False) -> Optional[int]:
    """The local rank for a new standby (see the module docstring), or None when the node has no
    spare GPU left. ``live``: the local ranks of standbys still waiting; ``held``: those of
    standbys that were promoted (their devices are not reused)."""
    taken = set(live) | set(held)
    if gpus <= 0 or share:
        return min(r for r in range(nproc, nproc + len(taken) + 1) if r not in taken)
    free = [r for r in range(nproc, gpus) if r not in taken]
    return free[0] if free else None


def no_spare_gpu(nproc: int, gpus: int, held: Collection[int]) -> str:
    promoted = f"; {len(held)} taken by promoted standbys (their GPUs are not reused)" if held else ""
    return (f"no spare GPU for a standby worker: {gpus} GPUs, {nproc} active ranks{promoted}; the job goes on "
            f"without it ({ENV_SHARE}=1 lets standbys share the active ranks' GPUs)")
