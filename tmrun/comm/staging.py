"""Host staging: the one place where tensors the native layer cannot use in place get host copies.

The native communicator (and the same-host reads of a handover) work on host memory: a
contiguous CPU tensor is used as it is (a buffer over its storage, see
:func:`tmrun.comm.native.as_buffer`). Anything else goes through a host copy:

* :func:`to_host` / :func:`from_host`: one tensor (the "tmrun" backend's collectives);
* :class:`HostBytes`: the byte views of many tensors (the worker's state transfers: healing
  and a migration's handover).

CUDA: wait for the work queued on the tensor's device's current stream (so the tensor holds
the values its producer queued), then a blocking copy into pinned host memory; back to the
device with a blocking copy. There is no GPU transport: this is the whole CUDA path. Run on an
H100 (bench/gpu_inplace.py: DDP training, a failure in place, both migration paths).
"""

from __future__ import annotations

import torch


class UnsupportedError(NotImplementedError):
    """An operation, reduction or dtype the tmrun backend does not implement."""


def is_host_ready(tensor: torch.Tensor) -> bool:
    """True when the native layer can use ``tensor`` in place (a contiguous CPU tensor)."""
    return tensor.device.type == "cpu" and tensor.is_contiguous()


def to_host(tensor: torch.Tensor, copy: bool = True) -> torch.Tensor:
    """A contiguous CPU tensor with ``tensor``'s values (``copy=False``: only its shape and
    dtype, for a result to be received). ``tensor`` itself when it already is one."""
    if is_host_ready(tensor):
        return tensor
    device = tensor.device.type
    if device == "cuda":
        # nothing queued on the producer's stream may still read or write the tensor once we
        # hand its copy over
        torch.cuda.current_stream(tensor.device).synchronize()
    elif device != "cpu":
        raise UnsupportedError(f"tmrun: tensors on {device} are not supported (cpu, cuda)")
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=device == "cuda")
    if copy:
        host.copy_(tensor)  # non_blocking=False: done when this returns
    return host


def from_host(tensor: torch.Tensor, host: torch.Tensor) -> None:
    """Copy a staged result back into ``tensor`` (nothing to do when it was used in place).

    For CUDA a blocking host-to-device copy on the calling thread's current stream: the values
    are in device memory when this returns."""
    if host is not tensor:
        tensor.copy_(host)


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous CPU tensor as a flat uint8 tensor sharing its memory."""
    flat = tensor.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


class HostBytes:
    """Byte views (uint8, flat) of ``tensors`` in host memory, in order, empty tensors left out.

    Tensors the native layer can use in place are viewed as they are (a receiver writes straight
    into them); the others get a host copy (:func:`to_host`), which holds their size in host
    memory while the transfer runs. ``load``: fill those copies now (a sender); a receiver calls
    :meth:`store` once the bytes arrived and were checked."""

    def __init__(self, tensors: list[torch.Tensor], load: bool) -> None:
        self.views: list[torch.Tensor] = []
        self._staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor, its host copy)
        for tensor in tensors:
            if not tensor.numel():
                continue
            tensor = tensor.detach()
            host = to_host(tensor, copy=load)
            self.views.append(byte_view(host))
            if host is not tensor:
                self._staged.append((tensor, host))

    def store(self) -> None:
        """Copy the received bytes of staged tensors back into them (in place)."""
        for tensor, host in self._staged:
            from_host(tensor, host)
        if self._staged and torch.cuda.is_available():
            torch.cuda.synchronize()
