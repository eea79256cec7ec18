"""Heal members that are behind: agree on the last committed step, then move the tracked state
from every member that holds it, striped, straight into the receivers' tensors, with CRC-32C.

Runs on the native communicator right after a replacement was committed; every member calls
:func:`heal` with the same arguments' shapes, so the sequence of operations matches everywhere.

Each donor's stripe takes one of two paths to a needy member. Over the socket (the
communicator), or, when both run on one host (:func:`tmrun.worker.peer_read.host_key` equal,
from :func:`agree`'s allgather, so every member knows which pairs share a host), read by the
needy member straight out of the donor's memory: the donor offers its stripe (its pid, the
addresses of the stripe's host views) and its CRC-32C, the needy member reads the stripes of all
its same-host donors at once (a thread each, checksummed as they arrive) while the other donors'
stripes arrive over the socket, checks each CRC and answers each same-host donor: done
(the donor may touch its tensors again), "socket" (the reads failed: the donor sends the stripe
over the socket instead), or an error (a copy that does not match its CRC fails on both sides).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

import tmrun_native
from tmrun.comm.native import as_buffer, crc32c_of
from tmrun.comm.staging import HostBytes
from tmrun.worker import device_transfer, peer_read
from tmrun.worker.device_transfer import PlaneLink
from tmrun.worker.tracked import TensorSpec, TrackedState

TAG_META = 0x7E01
TAG_STRIPE = 0x7E02
TAG_CRC = 0x7E03
PATH_SOCKET = "socket"  # how a part reaches the member that needs it
PATH_MEMORY = "memory"
PATH_DEVICE = "device"  # over the device plane (tmrun.worker.device_transfer)
READ_TIMEOUT = 120.0  # seconds for copying a part out of a peer's memory (GB/s: never near)
AGREED = 10  # values per member in agree()'s allgather


class TransferError(RuntimeError):
    """State could not be moved intact (checksum mismatch, different layouts)."""


class NoReplicaError(TransferError):
    """A member that must be healed holds a shard no live member holds (docs/mesh.md): the
    in-place recovery cannot restore it; the job falls back to its group restart."""


@dataclass(frozen=True)
class HealPlan:
    target_step: int  # last step every member will have committed
    donors: list[int]  # members at target_step (hold the state)
    needy: list[int]  # members behind (joiners, or a survivor that missed the last commit)
    hosts: list[int] = field(default_factory=list)  # per member: its host key, 0 where it reads no peer
    pids: list[int] = field(default_factory=list)  # per member: its process id
    defer: bool = False  # the optimizer state is read after heal returns (see DeferredRead)
    # it could have been, but a member has no core to spare for that read (tmrun.worker.cpu_budget):
    # the healed members read everything before heal returns
    read_first: bool = False
    keys: list[int] = field(default_factory=list)  # per member: its shard key (TrackedState.shard_key)
    # a member's DDP reducers must be reset (tmrun.worker.interrupt): every member resets its own,
    # so that all rebuild their buckets, with a broadcast, in the same step
    reset_models: bool = False
    fresh: list[int] = field(default_factory=list)  # members that hold nothing yet (joiners)
    # a member's tail of target_step (after its update) was void (tm.voided_step): every member
    # redoes it in the next step, joiners included
    void_tail: bool = False
    # members whose DDP models must take their donors' gradient buckets (tmrun.worker.ddp_buckets:
    # a joiner that built them after its promotion)
    adopt_buckets: list[int] = field(default_factory=list)

    def donors_of(self, member: int) -> list[int]:
        """The donors that hold ``member``'s shard (every donor when nothing is sharded)."""
        if not self.keys:
            return self.donors
        return [d for d in self.donors if self.keys[d] == self.keys[member]]

    def same_host(self, donor: int, needy: int) -> bool:
        """Whether ``needy`` reads ``donor``'s stripe out of its memory (both allow it, one host)."""
        return bool(self.hosts) and self.hosts[donor] != 0 and self.hosts[donor] == self.hosts[needy]


@dataclass
class Healed:
    """What :func:`heal` moved on this member: the step metadata (the donor's as received, or
    this member's own), and per path the bytes of each peer's stripe."""

    meta: dict[str, object]
    received: bool = False  # this member was healed (else it donated, or took no part)
    paths: dict[str, list[int]] = field(default_factory=dict)
    fallbacks: list[str] = field(default_factory=list)  # why a same-host stripe took the socket
    deferred: "DeferredRead | None" = None  # a healed member: the optimizer state still arriving
    served: list[int] = field(default_factory=list)  # a donor of a deferred plan: who still reads it

    def add(self, path: str, nbytes: int) -> None:
        self.paths.setdefault(path, []).append(nbytes)

    @property
    def nbytes(self) -> int:
        return sum(sum(sizes) for sizes in self.paths.values())

    def describe(self) -> str:
        """E.g. "memory 302 MB from 1 donor", "socket 151 MB to 1 member" (for the log)."""
        if not self.paths:
            return "nothing moved here"
        direction, peer = ("from", "donor") if self.received else ("to", "member")
        parts = [f"{path} {_megabytes(sum(sizes))} {direction} {len(sizes)} {peer}{'' if len(sizes) == 1 else 's'}"
                 for path, sizes in sorted(self.paths.items())]
        return ", ".join(parts) + "".join(f" ({reason})" for reason in self.fallbacks)


def _megabytes(nbytes: int) -> str:
    return f"{nbytes / 1e6:.0f} MB" if nbytes >= 10e6 else f"{nbytes / 1e6:.2f} MB"


def agree(comm: tmrun_native.Communicator, committed_step: int, digest: int, fresh: bool,
          same_host_reads: bool = True, state_tensors: list[tuple[str, torch.Tensor]] | None = None,
          shard_key: int = 0, overlap: bool = True, reset_models: bool = False, void_tail: int = -1,
          adopt_buckets: bool = False) -> HealPlan:
    """Allgather (committed step, layout digest, fresh, host key, pid, host memory, shard key,
    reset models, void tail, adopt buckets) and derive the same plan on every member.
    ``same_host_reads=False``: no member reads this one's memory, nor it theirs. ``shard_key``:
    which shard this member holds (0: nothing is sharded); a member is healed only by donors
    with its key (:func:`replica_donors`).
    ``overlap=False``: this member has no CPU core to spare for a background read
    (:mod:`tmrun.worker.cpu_budget`), so nothing is deferred. ``reset_models``: this member's
    DDP reducers need a reset (:meth:`StepInterrupter.reducers_need_reset`). ``void_tail``: the
    committed step whose tail was void here (-1: none); the plan's ``void_tail`` is whether any
    member's is the agreed step. ``adopt_buckets``: this member's DDP models must take their
    donors' gradient buckets (:mod:`tmrun.worker.ddp_buckets`)."""
    host = peer_read.host_key() if same_host_reads else 0
    host_memory = all(t.device.type == "cpu" for _, t in state_tensors) if state_tensors is not None else False
    # host memory: 0 no (device tensors, or not said), 1 yes, 2 yes but read it before resuming
    memory = (1 if overlap else 2) if host_memory else 0
    mine = torch.tensor([committed_step, digest, 1 if fresh else 0, host, os.getpid(), memory, shard_key,
                         1 if reset_models else 0, void_tail, 1 if adopt_buckets else 0], dtype=torch.int64)
    every = torch.zeros(comm.world_size * AGREED, dtype=torch.int64)
    out, dtype = as_buffer(every)
    inp, _ = as_buffer(mine)
    comm.allgather(out, inp, dtype=dtype)
    rows = every.view(comm.world_size, AGREED).tolist()
    holders = [r for r, row in enumerate(rows) if not row[2]]
    if not holders:
        raise TransferError("no member holds the training state (every member is new)")
    target = max(rows[r][0] for r in holders)
    donors = [r for r in holders if rows[r][0] == target]
    keys = [row[6] for row in rows]
    needy = [r for r in range(comm.world_size) if r not in donors]
    replica_donors(keys, donors, needy)  # raises NoReplicaError on every member alike
    for key in {keys[r] for r in donors}:  # replicas of one shard must track the same layout
        if len({rows[r][1] for r in donors if keys[r] == key}) != 1:
            raise TransferError("the members that hold the state track different objects or shapes")
    plan = HealPlan(target, donors, needy, hosts=[row[3] for row in rows], pids=[row[4] for row in rows],
                    keys=keys if any(keys) else [], reset_models=any(row[7] for row in rows),
                    fresh=[r for r, row in enumerate(rows) if row[2]],
                    void_tail=target >= 0 and any(row[8] == target for row in rows),
                    adopt_buckets=[r for r, row in enumerate(rows) if row[9]])
    # Deferred healing: every pair on one host, every member's state in host memory (given
    # ``state_tensors``): the healed member returns once the model arrived and reads the
    # optimizer state meanwhile, unless a member has no core to spare for that read.
    deferrable = bool(needy) and all(row[5] for row in rows) and all(
        plan.same_host(donor, member) for donor in donors for member in needy)
    read_first = deferrable and any(row[5] == 2 for row in rows)
    return dataclasses.replace(plan, defer=deferrable and not read_first, read_first=read_first)


MISPLACED = -1  # the shard key of a joiner whose sharded state was built for other coordinates


def replica_donors(keys: list[int], donors: list[int], needy: list[int]) -> dict[int, list[int]]:
    """For every needy member, the donors holding its shard (equal shard keys). Raises
    :class:`NoReplicaError` naming every shard that no live donor holds: pure FSDP (a shard has
    one holder) or every replica of a shard lost."""
    misplaced = [m for m in needy if keys[m] == MISPLACED]
    if misplaced:
        raise NoReplicaError(
            f"rank{'s' if len(misplaced) > 1 else ''} {', '.join(map(str, misplaced))} joined with sharded state "
            "built in a standby's sandbox (at rank 0's mesh coordinates; a job without subgroups, e.g. 1-D FSDP, "
            "whose shards have no replica anyway: docs/mesh.md); falling back to the group restart")
    found = {m: [d for d in donors if keys[d] == keys[m]] for m in needy}
    orphans = [m for m, held_by in found.items() if not held_by]
    if orphans:
        raise NoReplicaError(
            f"no live replica holds the shard of rank{'s' if len(orphans) > 1 else ''} "
            f"{', '.join(map(str, orphans))} (shard keys {sorted({keys[m] for m in orphans})}; live holders of "
            f"other shards: {donors}); in-place healing is impossible, falling back to the group restart")
    return found


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


def _send_json(comm: tmrun_native.Communicator, value: dict[str, Any], dst: int) -> None:
    _send_blob(comm, json.dumps(value).encode(), dst)


def decode_json(raw: bytes, what: str, src: int) -> dict[str, Any]:
    """A JSON object a peer sent (hello, offer, choice, receipt); :class:`TransferError` (one
    line) on anything else."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        value = None
    if not isinstance(value, dict):
        raise TransferError(f"malformed {what} from rank {src}")
    return value


def _recv_json(comm: tmrun_native.Communicator, src: int, what: str) -> dict[str, Any]:
    return decode_json(_recv_blob(comm, src), what, src)


def peer_pid(message: dict[str, Any], what: str, src: int) -> int:
    """The ``pid`` field of a peer's hello or offer (0: none given)."""
    pid = message.get("pid", 0)
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 <= pid < 1 << 31:
        raise TransferError(f"malformed {what} from rank {src}: bad pid")
    return pid


def peer_addresses(message: dict[str, Any], name: str, what: str, src: int) -> list[int]:
    """A list of addresses in a peer's offer (empty: none given)."""
    value = message.get(name) or []
    if not isinstance(value, list) or not all(
            isinstance(a, int) and not isinstance(a, bool) and 0 <= a < 1 << 64 for a in value):
        raise TransferError(f"malformed {what} from rank {src}: bad {name!r}")
    return value


def decode_hello(raw: bytes, src: int) -> tuple[int, str]:
    """A joiner's hello on the handoff link: (its pid, its host identity; "" for none)."""
    hello = decode_json(raw, "hello", src)
    host = hello.get("host") or ""
    if not isinstance(host, str):
        raise TransferError(f"malformed hello from rank {src}: bad host")
    return peer_pid(hello, "hello", src), host


def _give_up(comm: tmrun_native.Communicator, owner: int, error: str) -> TransferError:
    """Tell the member whose memory this one reads that it cannot take the state (so it does not
    wait, and fails too); the error to raise."""
    _send_json(comm, {"ok": False, "error": error}, owner)
    return TransferError(error)


def _receipt(comm: tmrun_native.Communicator, reader: int) -> dict[str, Any]:
    """The reader's answer once it copied what this member offered (it may touch those tensors
    again): ``{"ok": true, ...}``; an error (a damaged copy) raises here as well."""
    done = _recv_json(comm, reader, "receipt")
    if done.get("ok") is not True:
        raise TransferError(f"rank {reader} could not take the state: {done.get('error', '?')}")
    return done


def heal(
    comm: tmrun_native.Communicator,
    state: TrackedState,
    plan: HealPlan,
    step_meta: dict[str, object],
    on_donate: Callable[[], None] | None = None,
    board: CrcBoard | None = None,
    device: PlaneLink | None = None,
) -> Healed:
    """Move the state from ``plan.donors`` to ``plan.needy``. Returns what moved here, and the
    donor's step metadata as received (``step_meta`` on a donor). ``board``: where the CRCs of
    deferred optimizer state go (needed when ``plan.defer``). ``device``: the default group's
    device plane, when it takes tracked tensors (every member passes one, or none): those move
    over it (tmrun.worker.device_transfer), the others over the host path."""
    me = comm.rank
    if plan.defer and board is None:
        raise ValueError("deferred healing needs a CRC board")
    if device is not None:
        device.ready()
    healed = Healed(step_meta)
    donated: HostBytes | None = None  # a donor's bytes, loaded once for every member it heals
    on_device: list[bool] = []  # per tracked tensor: whether it moves over the device plane (a donor's choice)
    parts: tuple[HostBytes, HostBytes] | None = None  # the same, model and optimizer state apart
    for needy in plan.needy:
        if me in plan.donors_of(needy):
            if on_donate is not None:
                on_donate()
            if plan.defer:
                parts = parts or _split(state, load=True)
                path, nbytes = _donate_deferred(comm, state, parts, plan, needy, step_meta, board)  # type: ignore[arg-type]
                if path == PATH_MEMORY:
                    healed.served.append(needy)
                healed.add(path, nbytes)
                continue
            if donated is None:  # once for every member this donor heals
                on_device = [device is not None and device.takes(t) for _, t in state.tensors()]
                donated = HostBytes([t for (_, t), d in zip(state.tensors(), on_device) if not d], load=True)
            for path, nbytes in _donate(comm, state, donated, plan, needy, step_meta, device, on_device):
                healed.add(path, nbytes)
        elif me == needy:
            healed = (_receive_deferred(comm, state, plan, board) if plan.defer  # type: ignore[arg-type]
                      else _receive(comm, state, plan, device))
    return healed


# -- deferred healing: the model first, the optimizer state while the healed member computes ----
#
# When every donor shares the healed member's host and the state is in host memory, the healed
# member returns as soon as its model (and the non-tensor state) arrived intact; the optimizer
# state (two thirds of AdamW's bytes) is read out of the donors' memory in the background while
# it runs its forward and backward. Each donor computes that part's CRC-32C after the model was
# taken, off the critical path, and posts it on a CrcBoard (the store in the runtime). The
# healed member's optimizer step waits for its read (DeferredRead.wait), and so does each
# donor's (it must not change what is being read): the healed member publishes
# keys.heal_done(gen, rank) once the read is checked. A donor whose memory cannot be read sends
# both parts over the socket instead, at once.


class CrcBoard(Protocol):
    """Where donors post the CRC-32C of the optimizer state's stripes for their readers."""

    def put(self, donor: int, needy: int, crc: int) -> None: ...

    def get(self, donor: int, needy: int, timeout: float) -> int: ...


def _donate_deferred(comm: tmrun_native.Communicator, state: TrackedState, parts: tuple[HostBytes, HostBytes],
                     plan: HealPlan, needy: int, step_meta: dict[str, object], board: CrcBoard) -> tuple[str, int]:
    donors = plan.donors_of(needy)
    index = donors.index(comm.rank)
    if index == 0:
        _send_header(comm, state, step_meta, needy)
    now, later = (_stripe(part.views, index, len(donors)) for part in parts)
    _send_json(comm, peer_read.offer(plan.pids[needy], stripe=now, later=later), needy)
    _send_crc(comm, crc32c_of(now), needy)  # computed while the needy member reads
    if _receipt(comm, needy).get("path") == PATH_SOCKET:  # it could not read this process
        return PATH_SOCKET, _send_part(comm, now, needy) + _send_part(comm, later, needy)
    donor = comm.rank
    threading.Thread(target=lambda: board.put(donor, needy, crc32c_of(later)), name="tmrun-deferred-crc",
                     daemon=True).start()
    return PATH_MEMORY, sum(v.numel() for v in now + later)


class DeferredRead:
    """The optimizer state's stripes, read out of the donors' memory in the background after
    ``heal`` returned (the reads run already); :meth:`start` checks each against the CRC its
    donor posts on the board, in a thread of its own, and calls ``on_done("ok" | "error:
    ...")``; :meth:`wait` before the optimizer steps."""

    def __init__(self, reads: list[tuple[peer_read.BackgroundRead, int]], host: HostBytes, board: CrcBoard,
                 me: int) -> None:
        self.nbytes = sum(read.nbytes for read, _ in reads)
        self._reads, self._host, self._board, self._me = reads, host, board, me
        self._on_done: Callable[[str], None] = lambda _: None
        self._error: str | None = None
        self._began = time.monotonic()
        self.seconds: float | None = None  # from heal's return to the read checked (or failed)
        self._thread = threading.Thread(target=self._finish, name="tmrun-deferred-heal", daemon=True)

    def start(self, on_done: Callable[[str], None]) -> None:
        self._on_done = on_done
        self._thread.start()

    def _finish(self) -> None:
        for read, donor in self._reads:
            try:
                read.finish(self._board.get(donor, self._me, READ_TIMEOUT))
            except Exception as exc:  # noqa: BLE001  (a read error, a CRC mismatch, no CRC posted)
                self._error = self._error or str(exc)
        if self._error is None:
            self._host.store()
        self.seconds = time.monotonic() - self._began
        try:
            self._on_done("ok" if self._error is None else f"error: {self._error}")
        except Exception as exc:  # noqa: BLE001  (the store is gone: the donors' wait ends on its own)
            self._error = self._error or f"could not tell the donors: {exc}"

    def wait(self, timeout: float = READ_TIMEOUT) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TransferError(f"the optimizer state did not arrive within {timeout:.0f}s")
        if self._error is not None:
            raise TransferError(f"the optimizer state read after healing is unusable: {self._error}")


def _receive_deferred(comm: tmrun_native.Communicator, state: TrackedState, plan: HealPlan, board: CrcBoard) -> Healed:
    donors = plan.donors_of(comm.rank)
    header = _receive_header(comm, state, donors[0])
    now_host, later_host = _split(state, load=False)
    count = len(donors)
    offers = {donor: _recv_json(comm, donor, "offer") for donor in donors}
    stripes = {donor: (_stripe(now_host.views, index, count), _stripe(later_host.views, index, count))
               for index, donor in enumerate(donors)}
    reads = {donor: peer_read.BackgroundRead(peer_pid(offers[donor], "offer", donor),
                                             peer_addresses(offers[donor], "stripe", "offer", donor),
                                             stripes[donor][0], f"the model's stripe of rank {donor}", READ_TIMEOUT)
             for donor in donors}
    healed = Healed(dict(header["meta"]), received=True)
    later_reads: list[tuple[peer_read.BackgroundRead, int]] = []
    failure: TransferError | None = None
    for donor, read in reads.items():  # every donor gets its answer, even after a failure
        now, later = stripes[donor]
        expected_now = _recv_crc(comm, donor)
        try:
            read.finish(expected_now)
        except peer_read.CopyError as exc:
            failure = failure or _give_up(comm, donor, str(exc))
            continue
        except peer_read.PeerReadError as exc:
            healed.fallbacks.append(f"{exc}: over the socket")
            _send_json(comm, {"ok": True, "path": PATH_SOCKET}, donor)
            healed.add(PATH_SOCKET, _receive_part(comm, now, donor) + _receive_part(comm, later, donor))
            continue
        _send_json(comm, {"ok": True, "path": PATH_MEMORY}, donor)
        remote_later = peer_addresses(offers[donor], "later", "offer", donor)
        later_reads.append((peer_read.BackgroundRead(peer_pid(offers[donor], "offer", donor), remote_later, later,
                                                     f"the optimizer state's stripe of rank {donor}", READ_TIMEOUT),
                            donor))
        healed.add(PATH_MEMORY, read.nbytes + sum(v.numel() for v in later))
    if failure is not None:
        raise failure
    now_host.store()
    state.apply_rest(header["rest"])
    if later_reads:
        healed.deferred = DeferredRead(later_reads, later_host, board, comm.rank)
    else:
        later_host.store()
    return healed


def _send_header(comm: tmrun_native.Communicator, state: TrackedState, step_meta: dict[str, object], dst: int,
                 peer: dict[str, Any] | None = None, on_device: list[bool] | None = None) -> None:
    """What the receiver needs before the tensors: their specs, the non-tensor state, the step
    (and, in a handover on one host, where to read the leaver's tensors; in healing, which
    tensors move over the device plane)."""
    header = {"specs": state.specs(), "rest": state.rest(), "meta": step_meta, "peer": peer,
              "on_device": on_device or []}
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
            step_meta: dict[str, object], device: PlaneLink | None = None,
            on_device: list[bool] | None = None) -> list[tuple[str, int]]:
    """Give ``needy`` this donor's stripe: of the device plane's tensors over the plane, then of
    the others. Returns (the path it took, its bytes) per part."""
    donors = plan.donors_of(needy)
    index = donors.index(comm.rank)
    if index == 0:
        _send_header(comm, state, step_meta, needy, on_device=on_device)
    moved: list[tuple[str, int]] = []
    if device is not None and on_device and any(on_device):
        views = device_transfer.views_of([t for (_, t), d in zip(state.tensors(), on_device) if d])
        stripe = _stripe(views, index, len(donors))
        device.send(stripe, needy)
        _send_crc(comm, device_transfer.checksum(stripe), needy)
        moved.append((PATH_DEVICE, sum(v.numel() for v in stripe)))
        if not host.views:
            return moved  # everything went over the plane
    stripe = _stripe(host.views, index, len(donors))
    if not plan.same_host(comm.rank, needy):
        return moved + [(PATH_SOCKET, _send_part(comm, stripe, needy))]
    _send_json(comm, peer_read.offer(plan.pids[needy], stripe=stripe), needy)
    _send_crc(comm, crc32c_of(stripe), needy)  # computed while the needy member reads
    if _receipt(comm, needy).get("path") == PATH_SOCKET:  # it could not read this process
        return moved + [(PATH_SOCKET, _send_part(comm, stripe, needy))]
    return moved + [(PATH_MEMORY, sum(v.numel() for v in stripe))]


def _receive(comm: tmrun_native.Communicator, state: TrackedState, plan: HealPlan,
             device: PlaneLink | None = None) -> Healed:
    """The needy member's side: the header, the device plane's stripes (when the donors send
    some), then every donor's other stripe (same-host donors' read at once in the background
    while the others' arrive over the socket)."""
    donors = plan.donors_of(comm.rank)
    header = _receive_header(comm, state, donors[0])
    tensors = [t for _, t in state.tensors()]
    on_device = list(header.get("on_device") or [False] * len(tensors))
    healed = Healed(dict(header["meta"]), received=True)
    damaged: TransferError | None = None  # raised once the host part is through (the donors finish theirs)
    if any(on_device):
        if device is None or len(on_device) != len(tensors):
            raise TransferError("the donors heal over the device plane and this member has none")
        damaged = _receive_on_device(comm, [t for t, d in zip(tensors, on_device) if d], donors, device, healed)
    host = HostBytes([t for t, d in zip(tensors, on_device) if not d], load=False)
    if any(on_device) and not host.views:  # everything came over the plane
        if damaged is not None:
            raise damaged
        state.apply_rest(header["rest"])
        return healed
    stripes = {donor: _stripe(host.views, index, len(donors)) for index, donor in enumerate(donors)}
    reads = {donor: _read_stripe(comm, donor, stripes[donor]) for donor in donors
             if plan.same_host(donor, comm.rank)}
    for donor, views in stripes.items():
        if donor not in reads:
            healed.add(PATH_SOCKET, _receive_part(comm, views, donor))
    failure: TransferError | None = None
    for donor, read in reads.items():  # every same-host donor gets its answer, even after a failure
        try:
            healed.add(_finish_read(comm, donor, read, stripes[donor], healed.fallbacks), read.nbytes)
        except TransferError as exc:
            failure = failure or exc
    failure = failure or damaged
    if failure is not None:
        raise failure
    host.store()
    state.apply_rest(header["rest"])
    return healed


def _receive_on_device(comm: tmrun_native.Communicator, tensors: list[torch.Tensor], donors: list[int],
                       device: PlaneLink, healed: Healed) -> TransferError | None:
    """Every donor's stripe of ``tensors`` over the device plane, received in place (a tensor
    that is not on the plane's device, e.g. optimizer state this member just allocated, through
    a scratch copy there), each checked against its donor's checksum. Returns the error of a
    damaged stripe (the caller raises it after the host part, which the donors still send)."""
    where = device.device()
    targets = [(t, t if device.takes(t) else torch.empty_like(t, device=where)) for t in tensors]
    views = device_transfer.views_of([scratch for _, scratch in targets])
    stripes = {donor: _stripe(views, index, len(donors)) for index, donor in enumerate(donors)}
    works = {donor: device.recv(stripe, donor) for donor, stripe in stripes.items()}  # every donor sends at once
    damaged: TransferError | None = None
    for donor, stripe in stripes.items():
        for work in works[donor]:
            work.wait()
        if device_transfer.checksum(stripe) != _recv_crc(comm, donor):
            damaged = damaged or TransferError(f"checksum mismatch in the device stripe from rank {donor}")
        healed.add(PATH_DEVICE, sum(v.numel() for v in stripe))
    if damaged is None:
        for tensor, scratch in targets:
            if scratch is not tensor:
                with torch.no_grad():
                    tensor.copy_(scratch)
    return damaged


def _read_stripe(comm: tmrun_native.Communicator, donor: int, views: list[torch.Tensor]) -> peer_read.BackgroundRead:
    """Start copying ``donor``'s stripe out of its memory, as its offer says."""
    where = _recv_json(comm, donor, "offer")
    return peer_read.BackgroundRead(peer_pid(where, "offer", donor), peer_addresses(where, "stripe", "offer", donor),
                                    views, f"the stripe of rank {donor}", timeout=READ_TIMEOUT)


def _finish_read(comm: tmrun_native.Communicator, donor: int, read: peer_read.BackgroundRead,
                 views: list[torch.Tensor], fallbacks: list[str]) -> str:
    """Wait for a stripe's read, check it, answer its donor. Returns the path that delivered it."""
    expected = _recv_crc(comm, donor)
    try:
        read.finish(expected)
    except peer_read.CopyError as exc:
        raise _give_up(comm, donor, str(exc)) from None
    except peer_read.PeerReadError as exc:
        fallbacks.append(f"{exc}: over the socket")
        _send_json(comm, {"ok": True, "path": PATH_SOCKET}, donor)
        _receive_part(comm, views, donor)
        return PATH_SOCKET
    _send_json(comm, {"ok": True, "path": PATH_MEMORY}, donor)
    return PATH_MEMORY


def _receive_part(comm: tmrun_native.Communicator, views: list[torch.Tensor], src: int) -> int:
    part = PendingTransfer(comm, views, src, "the stripe")
    part.finish()
    return part.nbytes


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


def hand_over(comm: tmrun_native.Communicator, state: TrackedState, step_meta: dict[str, object],
              joiner: int = 1, same_host_reads: bool = True) -> int:
    """The leaver's side. Returns the bytes handed over (sent, or read by the joiner)."""
    pid, host = decode_hello(_recv_blob(comm, joiner), joiner)
    now_host, later_host = _split(state, load=True)
    now, later = now_host.views, later_host.views
    offer = None
    if same_host_reads and host and host == peer_read.host_identity():
        offer = peer_read.offer(pid, now=now, later=later)
    _send_header(comm, state, step_meta, joiner, peer=offer)
    choice = _recv_json(comm, joiner, "choice").get("path")
    if choice != PATH_MEMORY or offer is None:
        return _send_part(comm, now, joiner) + _send_part(comm, later, joiner)
    for part in (now, later):  # the joiner reads meanwhile; the tensors stay as they are
        _send_crc(comm, crc32c_of(part), joiner)
    _receipt(comm, joiner)  # the joiner has copied everything (or gave up)
    return sum(v.numel() for v in now + later)


class _MemoryPart:
    """The optimizer's state, read from the leaver's memory in the background; :meth:`finish`
    also tells the leaver it may go."""

    path = PATH_MEMORY

    def __init__(self, comm: tmrun_native.Communicator, read: peer_read.BackgroundRead, expected_crc: int,
                 leaver: int) -> None:
        self._comm, self._read, self._expected, self._leaver = comm, read, expected_crc, leaver
        self.nbytes = read.nbytes

    def finish(self) -> None:
        try:
            self._read.finish(self._expected)
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
    model = peer_read.BackgroundRead(pid, list(offer["now"]), now, "the model", timeout=READ_TIMEOUT)
    expected_model, expected_rest = _recv_crc(comm, leaver), _recv_crc(comm, leaver)
    try:
        model.finish(expected_model)
    except peer_read.PeerReadError as exc:
        raise _give_up(comm, leaver, str(exc)) from None
    received = model.nbytes
    now_host.store()
    state.apply_rest(header["rest"])
    read = peer_read.BackgroundRead(pid, list(offer["later"]), later, "the optimizer state", timeout=READ_TIMEOUT)
    return dict(header["meta"]), _Stored(_MemoryPart(comm, read, expected_rest, leaver), later_host), received
