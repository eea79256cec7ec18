"""DistributedDataParallel over the "tmrun" backend: the one DDP constructor (``tm.ddp`` uses it).

``wrap(module, **kw)`` is plain ``torch.nn.parallel.DistributedDataParallel`` over a tmrun process
group: DDP's reducer calls the group's ``allreduce`` (through torch's ProcessGroup trampoline) and
chains on the returned future, exactly as with gloo. No comm hook is installed: the default
allreduce hook is the right one (gradients are summed by the native ring and divided by the world
size in DDP), and DDP's construction-time checks (parameter shapes verified with an allgather,
module states broadcast from rank 0) run over the same group. In local (sandbox) mode those
collectives are served locally, so a standby can build its DDP model before it has a peer.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from tmrun.comm.backend import get_group

__all__ = ["wrap"]


def wrap(module: torch.nn.Module, group: Optional[Any] = None, **kwargs: Any) -> torch.nn.parallel.DistributedDataParallel:
    """``DistributedDataParallel(module, process_group=<group>, **kwargs)``.

    ``group``: a process group; default: the default group, which must then be "tmrun". A group
    given explicitly may be another backend's (a worker of a plain job runs over whatever
    ``TMRUN_BACKEND`` or the script chose). For a module on one CUDA device, ``device_ids``
    defaults to that device (over "tmrun", gradients are staged through host memory by the
    backend). Any other DDP keyword argument passes through."""
    pg = get_group() if group is None else group
    if not isinstance(pg, dist.ProcessGroup):
        raise TypeError(f"tmrun.comm.ddp.wrap: not a process group: {pg!r}")
    if "device_ids" not in kwargs:
        devices = {p.device for p in module.parameters()}
        if len(devices) == 1:
            (device,) = devices
            if device.type == "cuda":
                kwargs["device_ids"] = [device.index if device.index is not None else torch.cuda.current_device()]
    return torch.nn.parallel.DistributedDataParallel(module, process_group=pg, **kwargs)

