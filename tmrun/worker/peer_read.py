"""Same-host reads: a member copies a peer's tensors straight out of the peer's memory.

When two members run on one host (same kernel boot, same PID namespace), the one that needs
the state reads the other's tensors with cross-memory attach (``process_vm_readv``): one copy,
about 5 GB/s on the 2-core test machine, where the loopback socket manages about 0.5-1 GB/s
and costs CPU on both sides. Two transfers use it: a migration's handover (the joiner reads the
leaver) and healing (a needy member reads its stripe of every donor on its host). The owner
sends the addresses and the CRC-32C of what it offers, and keeps those tensors as they are until
the reader says it is done; the reader checks its copy against the CRC. Anything that stops the
reads (another host or container, a kernel that forbids them) makes the reader ask for the
socket instead; a copy that does not match its CRC is an error on both sides.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
from typing import Any

import torch

import tmrun_native
from tmrun.comm.native import as_buffer, crc32c_of

PROBE_BYTES = 64
BATCH_BYTES = 32 << 20  # a read's unit: its checksum is computed while the next one is copied


class PeerReadError(RuntimeError):
    """The peer's memory could not be read (it died, or reads are not allowed): nothing was
    written after this was raised, so the part may be fetched another way."""


class CopyError(PeerReadError):
    """The copy is unusable: it differs from the peer's checksum, or the read did not end in
    time (and may still be writing). Fetching it again would hide a fault: not retried."""


def host_identity() -> str:
    """Equal for two processes exactly when one can name the other by PID on the same kernel
    (boot id and PID namespace); empty when unknown (no same-host reads then)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return f"{boot.read().strip()}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def host_key() -> int:
    """:func:`host_identity` as a signed 64-bit number (for an allgather); 0 when unknown."""
    identity = host_identity()
    if not identity:
        return 0
    key = int.from_bytes(hashlib.blake2b(identity.encode(), digest_size=8).digest(), "little", signed=True)
    return key or 1


def addresses(views: list[torch.Tensor]) -> list[int]:
    return [int(view.data_ptr()) for view in views]


def offer(reader_pid: int, **parts: list[torch.Tensor]) -> dict[str, Any]:
    """Let ``reader_pid`` read this process (where Yama restricts reads to ancestors) and say
    where each part's tensors are: what the reader needs, besides the CRCs."""
    tmrun_native.allow_peer_reader(reader_pid)
    return {"pid": os.getpid(), **{name: addresses(views) for name, views in parts.items()}}


def _buffers(views: list[torch.Tensor]) -> list[Any]:
    return [as_buffer(view)[0] for view in views]


def readable(pid: int, remote: list[int], views: list[torch.Tensor]) -> bool:
    """Whether the first bytes of the peer's first tensor can be read from here."""
    if not remote or not views:
        return False
    probe = torch.empty(min(PROBE_BYTES, views[0].numel()), dtype=torch.uint8)
    try:
        tmrun_native.read_peer_memory(pid, remote[:1], _buffers([probe]))
    except (OSError, ValueError):
        return False
    return True


def read_part(pid: int, remote: list[int], views: list[torch.Tensor], what: str) -> int:
    """Copy the peer's tensors at ``remote`` into ``views`` (in place). Returns the bytes."""
    if len(remote) != len(views):
        raise PeerReadError(f"{what}: the peer named {len(remote)} tensors, this member has {len(views)}")
    try:
        return int(tmrun_native.read_peer_memory(pid, remote, _buffers(views)))
    except (OSError, ValueError) as exc:  # ValueError: no pid named
        raise PeerReadError(f"could not read {what} (pid {pid}): {getattr(exc, 'strerror', None) or exc}") from None


Batch = tuple[list[int], list[torch.Tensor]]  # peer addresses, and the local views they fill


def _batches(remote: list[int], views: list[torch.Tensor], size: int) -> list[Batch]:
    """``views`` (flat uint8) and their peer addresses cut and grouped into batches of about
    ``size`` bytes, in order."""
    batches: list[Batch] = []
    addrs: list[int] = []
    pieces: list[torch.Tensor] = []
    nbytes = 0
    for address, view in zip(remote, views):
        for start in range(0, view.numel(), size):
            piece = view[start : start + size]
            addrs.append(address + start)
            pieces.append(piece)
            nbytes += piece.numel()
            if nbytes >= size:
                batches.append((addrs, pieces))
                addrs, pieces, nbytes = [], [], 0
    if pieces:
        batches.append((addrs, pieces))
    return batches


class BackgroundRead:
    """A part (flat uint8 views) read out of a peer's memory in a thread, batch after batch,
    while a second thread computes the CRC-32C of the batches already copied (both native calls
    release the GIL: reads from several peers, the checksum and the caller's own work run at
    once); :meth:`finish` waits for both and compares the CRC with the peer's."""

    def __init__(self, pid: int, remote: list[int], views: list[torch.Tensor], what: str, timeout: float) -> None:
        self.nbytes = sum(v.numel() for v in views)
        self._pid = pid
        self._what = what
        self._timeout = timeout
        self._error: BaseException | None = None
        self._crc = 0
        self._copied: queue.SimpleQueue[list[torch.Tensor] | None] = queue.SimpleQueue()
        if len(remote) != len(views):
            self._error = PeerReadError(f"{what}: the peer named {len(remote)} tensors, this member has {len(views)}")
            remote, views = [], []
        batches = _batches(remote, views, BATCH_BYTES)
        self._threads = [threading.Thread(target=self._read, args=(batches,), name="tmrun-peer-read", daemon=True),
                         threading.Thread(target=self._check, name="tmrun-peer-check", daemon=True)]
        for thread in self._threads:
            thread.start()

    def _read(self, batches: list[Batch]) -> None:
        try:
            for remote, pieces in batches:
                read_part(self._pid, remote, pieces, self._what)
                self._copied.put(pieces)
        except Exception as exc:  # handed to finish(), in the caller's thread
            self._error = exc
        finally:
            self._copied.put(None)

    def _check(self) -> None:
        while (pieces := self._copied.get()) is not None:
            self._crc = crc32c_of(pieces, self._crc)

    def finish(self, expected_crc: int) -> None:
        deadline = time.monotonic() + self._timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                raise CopyError(f"reading {self._what} took over {self._timeout:.0f}s")
        if self._error is not None:
            raise self._error
        if self._crc != expected_crc:
            raise CopyError(f"checksum mismatch in {self._what} read from pid {self._pid}")
