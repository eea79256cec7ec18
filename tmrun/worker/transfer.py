"""Heal members that are behind: agree on the last committed step, then stream the tracked state
from every member that holds it, striped, straight into the receivers' tensors, with CRC-32C.

Runs on the native communicator right after a replacement was committed; every member calls
:func:`heal` with the same arguments' shapes, so the sequence of operations matches everywhere.
"""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass
from typing import Any, Callable

import torch

import tmrun_native
from tmrun.comm.native import as_buffer
from tmrun.worker.tracked import TensorSpec, TrackedState

TAG_META = 0x7E01
TAG_STRIPE = 0x7E02
TAG_CRC = 0x7E03


class TransferError(RuntimeError):
    """State could not be moved intact (checksum mismatch, different layouts)."""


@dataclass(frozen=True)
class HealPlan:
    target_step: int  # last step every member will have committed
    donors: list[int]  # members at target_step (hold the state)
    needy: list[int]  # members behind (joiners, or a survivor that missed the last commit)


def agree(comm: tmrun_native.Communicator, committed_step: int, digest: int, fresh: bool) -> HealPlan:
    """Allgather (committed step, layout digest, fresh) and derive the same plan on every member."""
    mine = torch.tensor([committed_step, digest, 1 if fresh else 0], dtype=torch.int64)
    every = torch.zeros(comm.world_size * 3, dtype=torch.int64)
    out, dtype = as_buffer(every)
    inp, _ = as_buffer(mine)
    comm.allgather(out, inp, dtype=dtype)
    rows = every.view(comm.world_size, 3).tolist()
    holders = [r for r, (step, _, is_fresh) in enumerate(rows) if not is_fresh]
    if not holders:
        raise TransferError("no member holds the training state (every member is new)")
    target = max(rows[r][0] for r in holders)
    donors = [r for r in holders if rows[r][0] == target]
    digests = {rows[r][1] for r in donors}
    if len(digests) != 1:
        raise TransferError("the members that hold the state track different objects or shapes")
    needy = [r for r in range(comm.world_size) if r not in donors]
    return HealPlan(target, donors, needy)


def _byte_views(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().reshape(-1).view(torch.uint8) for t in tensors if t.numel()]


def _stripe(views: list[torch.Tensor], index: int, count: int) -> list[torch.Tensor]:
    """The pieces of stripe ``index`` of ``count`` over the concatenation of ``views``."""
    total = sum(v.numel() for v in views)
    lo, hi = total * index // count, total * (index + 1) // count
    pieces, offset = [], 0
    for view in views:
        start, end = max(lo, offset), min(hi, offset + view.numel())
        if start < end:
            pieces.append(view[start - offset : end - offset])
        offset += view.numel()
    return pieces


def _send_blob(comm: tmrun_native.Communicator, blob: bytes, dst: int) -> None:
    comm.send(struct.pack("<Q", len(blob)), dst, TAG_META)
    comm.send(blob, dst, TAG_META)


def _recv_blob(comm: tmrun_native.Communicator, src: int) -> bytes:
    head = bytearray(8)
    comm.recv(head, src, TAG_META)
    (length,) = struct.unpack("<Q", head)
    blob = bytearray(length)
    comm.recv(blob, src, TAG_META)
    return bytes(blob)


def heal(
    comm: tmrun_native.Communicator,
    state: TrackedState,
    plan: HealPlan,
    step_meta: dict[str, object],
    on_donate: Callable[[], None] | None = None,
) -> tuple[int, dict[str, object]]:
    """Move the state from ``plan.donors`` to ``plan.needy``. Returns (bytes moved here, the
    donor's step metadata as received, or ``step_meta`` on a donor)."""
    me = comm.rank
    moved = 0
    received_meta: dict[str, object] = step_meta
    for needy in plan.needy:
        if me in plan.donors:
            if on_donate is not None:
                on_donate()
            moved += _donate(comm, state, plan, needy, step_meta)
        elif me == needy:
            moved, received_meta = _receive(comm, state, plan)
    return moved, received_meta


def _send_header(comm: tmrun_native.Communicator, state: TrackedState, step_meta: dict[str, object], dst: int) -> None:
    """What the receiver needs before the tensors: their specs, the non-tensor state, the step."""
    _send_blob(comm, pickle.dumps({"specs": state.specs(), "rest": state.rest(), "meta": step_meta}), dst)


def _receive_header(comm: tmrun_native.Communicator, state: TrackedState, src: int) -> dict[str, Any]:
    """The sender's header; allocates optimizer state this member lacks and checks the layouts."""
    header = pickle.loads(_recv_blob(comm, src))
    donor_specs: list[TensorSpec] = header["specs"]
    state.allocate_missing(donor_specs)
    mine = state.specs()
    if mine != donor_specs:
        differing = next((a.name for a, b in zip(mine, donor_specs) if a != b), "(count)")
        raise TransferError(f"this member's tracked state differs from the donor's at {differing}")
    return header


def _send_part(comm: tmrun_native.Communicator, views: list[torch.Tensor], dst: int) -> int:
    """Send ``views`` straight from memory, then their CRC-32C. Returns the bytes sent."""
    buffers = [as_buffer(view)[0] for view in views]
    works = [comm.send_async(buffer, dst, TAG_STRIPE) for buffer in buffers]  # sending starts
    crc = 0
    for buffer in buffers:  # the checksum is computed while the bytes go out (GIL released)
        crc = tmrun_native.crc32c(buffer, crc)
    for work in works:
        work.wait()
    comm.send(struct.pack("<I", crc), dst, TAG_CRC)
    return sum(v.numel() for v in views)


class PendingTransfer:
    """A part sent by :func:`_send_part`, arriving in place into ``views`` (the receives are
    posted at once): :meth:`finish` waits for it and checks its CRC-32C."""

    def __init__(self, comm: tmrun_native.Communicator, views: list[torch.Tensor], src: int, what: str) -> None:
        self._buffers = [as_buffer(view)[0] for view in views]
        self._views = views  # keeps the tensors' memory alive while the receives run
        self._works = [comm.recv_async(buffer, src, TAG_STRIPE) for buffer in self._buffers]
        self._comm = comm
        self._src = src
        self._what = what
        self.nbytes = sum(v.numel() for v in views)

    def finish(self) -> None:
        crc = 0
        for work, buffer in zip(self._works, self._buffers):
            work.wait()
            crc = tmrun_native.crc32c(buffer, crc)
        expected = bytearray(4)
        self._comm.recv(expected, self._src, TAG_CRC)
        if struct.unpack("<I", expected)[0] != crc:
            raise TransferError(f"checksum mismatch in {self._what} from rank {self._src}")


def _donate(comm: tmrun_native.Communicator, state: TrackedState, plan: HealPlan, needy: int, step_meta: dict[str, object]) -> int:
    index = plan.donors.index(comm.rank)
    if index == 0:
        _send_header(comm, state, step_meta, needy)
    return _send_part(comm, _stripe(_byte_views([t for _, t in state.tensors()]), index, len(plan.donors)), needy)


def _receive(comm: tmrun_native.Communicator, state: TrackedState, plan: HealPlan) -> tuple[int, dict[str, object]]:
    header = _receive_header(comm, state, plan.donors[0])
    views = _byte_views([t for _, t in state.tensors()])
    moved = 0
    for index, donor in enumerate(plan.donors):
        stripe = PendingTransfer(comm, _stripe(views, index, len(plan.donors)), donor, "the stripe")
        stripe.finish()
        moved += stripe.nbytes
    state.apply_rest(header["rest"])
    return moved, dict(header["meta"])


# -- planned migration: the leaver hands over to its joiner in two parts -----------------------
#
# The joiner needs the model's tensors before its first forward, but the optimizer's state only
# when the optimizer steps. The leaver sends the header and the model first; the joiner returns
# as soon as those arrived intact and receives the optimizer's state in the background while it
# computes its first forward and backward (:class:`PendingTransfer`).


def _split(state: TrackedState) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    deferred_objects = state.deferrable()
    now: list[torch.Tensor] = []
    later: list[torch.Tensor] = []
    for name, tensor in state.tensors():
        (later if name.partition(".")[0] in deferred_objects else now).append(tensor)
    return _byte_views(now), _byte_views(later)


def hand_over(comm: tmrun_native.Communicator, state: TrackedState, step_meta: dict[str, object],
              joiner: int = 1) -> int:
    """The leaver's side: header, model tensors, then the optimizer's state. Returns bytes sent."""
    _send_header(comm, state, step_meta, joiner)
    now, later = _split(state)
    return _send_part(comm, now, joiner) + _send_part(comm, later, joiner)


def take_over(comm: tmrun_native.Communicator, state: TrackedState,
              leaver: int = 0) -> tuple[dict[str, object], PendingTransfer, int]:
    """The joiner's side: returns once the header and the model's tensors arrived intact (the
    step metadata, the optimizer state's :class:`PendingTransfer`, bytes received so far)."""
    header = _receive_header(comm, state, leaver)
    now, later = _split(state)
    model = PendingTransfer(comm, now, leaver, "the model")
    model.finish()
    state.apply_rest(header["rest"])
    meta = dict(header["meta"])
    return meta, PendingTransfer(comm, later, leaver, "the optimizer state"), model.nbytes
