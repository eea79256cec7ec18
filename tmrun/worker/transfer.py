"""Heal members that are behind: agree on the last committed step, then stream the tracked state
from every member that holds it, striped, straight into the receivers' tensors, with CRC-32C.

Runs on the native communicator right after a replacement was committed; every member calls
:func:`heal` with the same arguments' shapes, so the sequence of operations matches everywhere.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

import tmrun_native
from tmrun.comm.native import as_buffer, crc32c_of
from tmrun.comm.staging import HostBytes
from tmrun.worker import peer_read
from tmrun.worker.tracked import TensorSpec, TrackedState

TAG_META = 0x7E01
TAG_STRIPE = 0x7E02
TAG_CRC = 0x7E03
PATH_SOCKET = "socket"  # how a handover's part reaches the joiner
PATH_MEMORY = "memory"
READ_TIMEOUT = 120.0  # seconds for copying a part out of the leaver's memory (GB/s: never near)


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


def _send_crc(comm: tmrun_native.Communicator, crc: int, dst: int) -> None:
    comm.send(struct.pack("<I", crc), dst, TAG_CRC)


def _recv_crc(comm: tmrun_native.Communicator, src: int) -> int:
    raw = bytearray(4)
    comm.recv(raw, src, TAG_CRC)
    return int(struct.unpack("<I", raw)[0])


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
    donated: HostBytes | None = None  # a donor's bytes, loaded once for every member it heals
    for needy in plan.needy:
        if me in plan.donors:
            if on_donate is not None:
                on_donate()
            if donated is None:
                donated = HostBytes([t for _, t in state.tensors()], load=True)
            moved += _donate(comm, state, donated, plan, needy, step_meta)
        elif me == needy:
            moved, received_meta = _receive(comm, state, plan)
    return moved, received_meta


def _send_header(comm: tmrun_native.Communicator, state: TrackedState, step_meta: dict[str, object], dst: int,
                 peer: dict[str, Any] | None = None) -> None:
    """What the receiver needs before the tensors: their specs, the non-tensor state, the step
    (and, in a handover on one host, where to read the leaver's tensors)."""
    header = {"specs": state.specs(), "rest": state.rest(), "meta": step_meta, "peer": peer}
    _send_blob(comm, pickle.dumps(header), dst)


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
    works = [comm.send_async(as_buffer(view)[0], dst, TAG_STRIPE) for view in views]  # sending starts
    crc = crc32c_of(views)  # computed while the bytes go out (GIL released)
    for work in works:
        work.wait()
    _send_crc(comm, crc, dst)
    return sum(v.numel() for v in views)


class PendingTransfer:
    """A part sent by :func:`_send_part`, arriving in place into ``views`` (the receives are
    posted at once): :meth:`finish` waits for it and checks its CRC-32C."""

    path = PATH_SOCKET

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
        if _recv_crc(self._comm, self._src) != crc:
            raise TransferError(f"checksum mismatch in {self._what} from rank {self._src}")


def _donate(comm: tmrun_native.Communicator, state: TrackedState, host: HostBytes, plan: HealPlan, needy: int,
            step_meta: dict[str, object]) -> int:
    index = plan.donors.index(comm.rank)
    if index == 0:
        _send_header(comm, state, step_meta, needy)
    return _send_part(comm, _stripe(host.views, index, len(plan.donors)), needy)


def _receive(comm: tmrun_native.Communicator, state: TrackedState, plan: HealPlan) -> tuple[int, dict[str, object]]:
    header = _receive_header(comm, state, plan.donors[0])
    host = HostBytes([t for _, t in state.tensors()], load=False)
    moved = 0
    for index, donor in enumerate(plan.donors):
        stripe = PendingTransfer(comm, _stripe(host.views, index, len(plan.donors)), donor, "the stripe")
        stripe.finish()
        moved += stripe.nbytes
    host.store()
    state.apply_rest(header["rest"])
    return moved, dict(header["meta"])


# -- planned migration: the leaver hands over to its joiner in two parts -----------------------
#
# The joiner needs the model's tensors before its first forward, but the optimizer's state only
# when the optimizer steps. The joiner returns from take_over as soon as the header and the
# model arrived intact; the optimizer's state arrives in the background while it computes its
# first forward and backward (finish() before the optimizer steps).
#
# On the wire (the 2-member handoff link): the joiner's hello (its pid and host identity, JSON),
# the leaver's header (tensor specs, the rest, the step, and its tensors' addresses when both
# share a host), the joiner's choice ("memory" or "socket"), then either the two parts over the
# socket with their CRCs, or the two CRCs while the joiner reads the parts out of the leaver's
# memory, and the joiner's "done" when it has both (the leaver must live until then).

class PendingPart(Protocol):
    """A part of a handover still arriving (over the socket, or read from the leaver's memory)."""

    path: str
    nbytes: int

    def finish(self) -> None: ...


def _split(state: TrackedState, load: bool) -> tuple[HostBytes, HostBytes]:
    deferred_objects = state.deferrable()
    now: list[torch.Tensor] = []
    later: list[torch.Tensor] = []
    for name, tensor in state.tensors():
        (later if name.partition(".")[0] in deferred_objects else now).append(tensor)
    return HostBytes(now, load), HostBytes(later, load)


def _send_json(comm: tmrun_native.Communicator, value: dict[str, Any], dst: int) -> None:
    _send_blob(comm, json.dumps(value).encode(), dst)


def _recv_json(comm: tmrun_native.Communicator, src: int, what: str) -> dict[str, Any]:
    try:
        value = json.loads(_recv_blob(comm, src))
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise TransferError(f"malformed {what} from rank {src}")
    return value


def _give_up(comm: tmrun_native.Communicator, leaver: int, error: str) -> TransferError:
    """Tell the leaver that this joiner cannot take the state (so it does not wait); the error to raise."""
    _send_json(comm, {"ok": False, "error": error}, leaver)
    return TransferError(error)


def hand_over(comm: tmrun_native.Communicator, state: TrackedState, step_meta: dict[str, object],
              joiner: int = 1, same_host_reads: bool = True) -> int:
    """The leaver's side. Returns the bytes handed over (sent, or read by the joiner)."""
    hello = _recv_json(comm, joiner, "hello")
    now_host, later_host = _split(state, load=True)
    now, later = now_host.views, later_host.views
    offer = None
    if same_host_reads and hello.get("host") and hello.get("host") == peer_read.host_identity():
        tmrun_native.allow_peer_reader(int(hello.get("pid", 0)))
        offer = {"pid": os.getpid(), "now": peer_read.addresses(now), "later": peer_read.addresses(later)}
    _send_header(comm, state, step_meta, joiner, peer=offer)
    choice = _recv_json(comm, joiner, "choice").get("path")
    if choice != PATH_MEMORY or offer is None:
        return _send_part(comm, now, joiner) + _send_part(comm, later, joiner)
    for part in (now, later):  # the joiner reads meanwhile; the tensors stay as they are
        _send_crc(comm, crc32c_of(part), joiner)
    done = _recv_json(comm, joiner, "receipt")  # the joiner has copied everything (or gave up)
    if done.get("ok") is not True:
        raise TransferError(f"the joiner could not take the state: {done.get('error', '?')}")
    return sum(v.numel() for v in now + later)


class _MemoryPart:
    """The optimizer's state, read from the leaver's memory in the background; :meth:`finish`
    also tells the leaver it may go."""

    path = PATH_MEMORY

    def __init__(self, comm: tmrun_native.Communicator, read: peer_read.BackgroundRead, leaver: int) -> None:
        self._comm, self._read, self._leaver = comm, read, leaver
        self.nbytes = read.nbytes

    def finish(self) -> None:
        try:
            self._read.finish()
        except peer_read.PeerReadError as exc:
            raise _give_up(self._comm, self._leaver, str(exc)) from None
        _send_json(self._comm, {"ok": True}, self._leaver)


class _Stored:
    """A pending part whose bytes, once complete, are stored to their device tensors."""

    def __init__(self, part: PendingPart, host: HostBytes) -> None:
        self._part, self._host = part, host
        self.path, self.nbytes = part.path, part.nbytes

    def finish(self) -> None:
        self._part.finish()
        self._host.store()


def take_over(comm: tmrun_native.Communicator, state: TrackedState, leaver: int = 0,
              same_host_reads: bool = True) -> tuple[dict[str, object], PendingPart, int]:
    """The joiner's side: returns once the header and the model's tensors arrived intact (the
    step metadata, the optimizer state still arriving, bytes received so far)."""
    _send_json(comm, {"pid": os.getpid(), "host": peer_read.host_identity() if same_host_reads else ""}, leaver)
    header = _receive_header(comm, state, leaver)
    now_host, later_host = _split(state, load=False)
    now, later = now_host.views, later_host.views
    offer = header.get("peer")
    pid = int(offer["pid"]) if isinstance(offer, dict) else 0
    use_memory = pid > 0 and peer_read.readable(pid, list(offer["now"]), now)  # type: ignore[index]
    _send_json(comm, {"path": PATH_MEMORY if use_memory else PATH_SOCKET}, leaver)
    if not use_memory:
        model = PendingTransfer(comm, now, leaver, "the model")
        model.finish()
        now_host.store()
        state.apply_rest(header["rest"])
        rest = _Stored(PendingTransfer(comm, later, leaver, "the optimizer state"), later_host)
        return dict(header["meta"]), rest, model.nbytes
    assert isinstance(offer, dict)
    try:
        received = peer_read.read_part(pid, list(offer["now"]), now, "the model")
    except peer_read.PeerReadError as exc:
        raise _give_up(comm, leaver, str(exc)) from None
    expected_model, expected_rest = _recv_crc(comm, leaver), _recv_crc(comm, leaver)
    if crc32c_of(now) != expected_model:
        raise _give_up(comm, leaver, f"checksum mismatch in the model read from rank {leaver}")
    now_host.store()
    state.apply_rest(header["rest"])
    read = peer_read.BackgroundRead(pid, list(offer["later"]), later, expected_rest, "the optimizer state",
                                    timeout=READ_TIMEOUT)
    return dict(header["meta"]), _Stored(_MemoryPart(comm, read, leaver), later_host), received
