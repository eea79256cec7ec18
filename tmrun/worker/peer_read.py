"""Same-host handover: the joiner copies the leaver's tensors straight out of its memory.

When a migration's leaver and joiner run on one host (same kernel boot, same PID namespace),
the joiner reads the leaver's tensors with cross-memory attach (``process_vm_readv``): one
copy, about 5 GB/s on the 2-core test machine, where the loopback socket manages about
0.5-1 GB/s and costs CPU on both sides. The leaver sends the addresses and the CRC-32C of
each part; the joiner checks its copy against them. Anything that stops the reads (another
host or container, a kernel that forbids them) makes the joiner ask for the socket instead.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

import tmrun_native
from tmrun.comm.native import as_buffer, crc32c_of

PROBE_BYTES = 64


class PeerReadError(RuntimeError):
    """The leaver's memory could not be read (it died, or reads are not allowed)."""


def host_identity() -> str:
    """Equal for two processes exactly when one can name the other by PID on the same kernel
    (boot id and PID namespace); empty when unknown (no same-host reads then)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return f"{boot.read().strip()}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def addresses(views: list[torch.Tensor]) -> list[int]:
    return [int(view.data_ptr()) for view in views]


def _buffers(views: list[torch.Tensor]) -> list[Any]:
    return [as_buffer(view)[0] for view in views]


def readable(pid: int, remote: list[int], views: list[torch.Tensor]) -> bool:
    """Whether the first bytes of the leaver's first tensor can be read from here."""
    if not remote or not views:
        return False
    probe = torch.empty(min(PROBE_BYTES, views[0].numel()), dtype=torch.uint8)
    try:
        tmrun_native.read_peer_memory(pid, remote[:1], _buffers([probe]))
    except (OSError, ValueError):
        return False
    return True


def read_part(pid: int, remote: list[int], views: list[torch.Tensor], what: str) -> int:
    """Copy the leaver's tensors at ``remote`` into ``views`` (in place). Returns the bytes."""
    if len(remote) != len(views):
        raise PeerReadError(f"{what}: the leaver named {len(remote)} tensors, this member has {len(views)}")
    try:
        return int(tmrun_native.read_peer_memory(pid, remote, _buffers(views)))
    except OSError as exc:
        raise PeerReadError(f"could not read {what} from the leaver (pid {pid}): {exc.strerror}") from None


class BackgroundRead:
    """A part read in a thread (the native call releases the GIL) while the joiner computes;
    :meth:`finish` waits for it, checks its CRC-32C against the leaver's, and returns."""

    def __init__(self, pid: int, remote: list[int], views: list[torch.Tensor], expected_crc: int, what: str,
                 timeout: float) -> None:
        self.nbytes = sum(v.numel() for v in views)
        self._views = views
        self._expected = expected_crc
        self._what = what
        self._timeout = timeout
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(pid, remote), name="tmrun-peer-read", daemon=True)
        self._thread.start()

    def _run(self, pid: int, remote: list[int]) -> None:
        try:
            read_part(pid, remote, self._views, self._what)
        except Exception as exc:  # handed to finish(), in the caller's thread
            self._error = exc

    def finish(self) -> None:
        self._thread.join(self._timeout)
        if self._thread.is_alive():
            raise PeerReadError(f"reading {self._what} from the leaver took over {self._timeout:.0f}s")
        if self._error is not None:
            raise self._error
        if crc32c_of(self._views) != self._expected:
            raise PeerReadError(f"checksum mismatch in {self._what} read from the leaver")
