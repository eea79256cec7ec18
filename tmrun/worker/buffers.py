"""Module buffers as a step found them, put back when a failure aborts the step.

A forward changes some buffers in place: batch norm's running statistics and its batch counter,
an exponential moving average kept as a buffer. A survivor whose step is aborted ran part or all
of that forward; its redo runs it again, so without this the statistics moved twice and the job
ended with other numbers than torchrun's (silently: the replica check leaves buffers out, since
they may differ by rank). Optimizer state needs no such copy (an aborted step never applies its
update); parameters are never changed by a forward.

The copy is of the *persistent* buffers of the tracked modules (what ``state_dict`` saves: the
model's own state), into tensors kept from step to step (no allocation after the first step).
Native batch norm updates its statistics without bumping the tensor's version counter, so a
buffer cannot be skipped as unchanged: each is copied at every step's start. Non-persistent
buffers (rotary tables, causal masks: caches the module can rebuild) are not copied.

Buffers that no collective keeps alike (DDP with ``broadcast_buffers=False``, FSDP2, a module the
script synchronises itself) are per-rank state: the lost rank's own are gone with its process,
and its joiner continues from a donor's copy. :func:`unsynchronised_buffers` names them, so that
the joiner says so in one line instead of ending with other numbers unflagged.
"""

from __future__ import annotations

import torch

from tmrun.worker.tracked import local_shard


def _persistent(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, buffer)`` of every persistent buffer ``module`` holds, each tensor once."""
    found: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for sub_name, sub in module.named_modules():
        skip = getattr(sub, "_non_persistent_buffers_set", set())
        for name, buffer in sub._buffers.items():
            if isinstance(buffer, torch.Tensor) and name not in skip and id(buffer) not in seen:
                seen.add(id(buffer))
                found.append((f"{sub_name}.{name}".lstrip("."), buffer))
    return found


def persistent_buffers(module: torch.nn.Module) -> list[torch.Tensor]:
    """The persistent buffers ``module`` holds (each once), as local tensors."""
    return [local_shard(buffer) for _, buffer in _persistent(module)]


class BufferSnapshot:
    """:meth:`take` at a step's start, :meth:`restore` when that step is aborted."""

    def __init__(self) -> None:
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (live buffer, its copy)

    def take(self, buffers: list[torch.Tensor]) -> None:
        kept = {id(live): copy for live, copy in self._pairs}
        pairs = []
        with torch.no_grad():
            for live in buffers:
                copy = kept.get(id(live))
                if copy is None or copy.shape != live.shape or copy.dtype != live.dtype \
                        or copy.device != live.device:
                    copy = torch.empty_like(live)
                copy.copy_(live)
                pairs.append((live, copy))
        self._pairs = pairs

    def restore(self) -> int:
        """Put every copied buffer back (in place: the module keeps its tensors); how many."""
        with torch.no_grad():
            for live, copy in self._pairs:
                live.copy_(copy)
        return len(self._pairs)

    @property
    def nbytes(self) -> int:
        return sum(copy.numel() * copy.element_size() for _, copy in self._pairs)


def unsynchronised_buffers(modules: list[torch.nn.Module]) -> list[str]:
    """Names of the persistent buffers of ``modules`` (those no DDP broadcast keeps alike:
    ``TrackedState.modules_with_own_buffers``)."""
    return [name for module in modules for name, _ in _persistent(module)]
