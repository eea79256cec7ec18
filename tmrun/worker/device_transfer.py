"""Healing on the device plane: tracked device tensors move device to device, not through host memory.

When the default group's device plane takes a tracked tensor (a CUDA tensor on NCCL; a CPU
tensor in the plane's gloo test mode), healing sends it over the plane (torch's send/recv on the
new generation's inner group: NCCL, GPU to GPU) instead of staging it through pinned host copies
and the TCP communicator. The integrity check runs where the bytes are: each side computes a
position-weighted checksum of its stripe on the device (:func:`checksum`), the donor sends its
value over the TCP communicator, the receiver compares. The rest of the state (CPU tensors
beside CUDA ones: an optimizer's step counters) keeps the host path of tmrun.worker.transfer.

Which tensors go this way is the *donor's* decision, sent in the header (every donor holds the
same layout on the same devices): a receiver whose tensor is elsewhere (optimizer state it had
to allocate) receives into a scratch tensor on the plane's device and copies it over.
"""

from __future__ import annotations

from typing import Any

import torch

from tmrun.comm.staging import byte_view

TAG_DEVICE = 0x7E04  # the device plane's send/recv tag of a healing stripe
CHUNK = 1 << 24  # bytes per step of the checksum (bounded scratch on the device)
MODULUS = 65521
MASK = (1 << 32) - 1  # the TCP side carries 32-bit checksums (transfer's CRC frames)


class PlaneLink:
    """The default group's device plane, as healing uses it."""

    def __init__(self, pg: Any) -> None:
        self._pg = pg

    def takes(self, tensor: torch.Tensor) -> bool:
        return bool(tensor.numel()) and self._pg.plane_takes(tensor)

    def ready(self) -> None:
        """Every member, before any stripe moves: the generation's inner group exists everywhere
        (a gloo group bootstraps with every member at once; NCCL's is created lazily)."""
        self._pg.ensure_device_plane()

    def device(self) -> torch.device:
        return self._pg.plane_device()

    def send(self, views: list[torch.Tensor], dst: int) -> None:
        works = [self._pg.send([view], dst, TAG_DEVICE) for view in views]
        for work in works:
            work.wait()

    def recv(self, views: list[torch.Tensor], src: int) -> list[Any]:
        """Post the receives (they complete as the donor sends); wait on the returned works."""
        return [self._pg.recv([view], src, TAG_DEVICE) for view in views]


def device_link(pg: Any, tensors: list[tuple[str, torch.Tensor]]) -> PlaneLink | None:
    """A link when the plane takes any of ``tensors`` (else healing keeps the host path)."""
    link = PlaneLink(pg)
    return link if any(link.takes(t) for _, t in tensors) else None


def views_of(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [byte_view(t.detach()) for t in tensors if t.numel()]


def checksum(views: list[torch.Tensor]) -> int:
    """A position-weighted checksum (Fletcher-like, folded to 32 bits) of the bytes of ``views``,
    computed on their device in bounded chunks: it changes when a byte changes or bytes trade
    places."""
    if not views:
        return 0
    device = views[0].device
    plain = torch.zeros((), dtype=torch.int64, device=device)
    weighted = torch.zeros((), dtype=torch.int64, device=device)
    offset = 0
    for view in views:
        for chunk in view.reshape(-1).split(CHUNK):
            wide = chunk.to(torch.int64)
            weights = (torch.arange(offset, offset + wide.numel(), dtype=torch.int64, device=device) % MODULUS) + 1
            plain += wide.sum()
            weighted += (wide * weights).sum()
            offset += wide.numel()
    wide = (int(plain.item()) * 1_000_003 + int(weighted.item())) & ((1 << 64) - 1)
    return (wide ^ (wide >> 32)) & MASK
