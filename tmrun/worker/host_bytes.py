"""The bytes of tracked tensors, in host memory, for moving them between members.

The native communicator and the same-host reads work on host memory. CPU tensors are used as
they are (byte views of their storage: a receiver writes straight into them); tensors on
another device (CUDA) go through a host copy: loaded from the device before they are sent,
stored to the device once they were received and checked. That copy holds the device
tensors' size in (pinned, where CUDA is present) host memory while the transfer runs.
"""

from __future__ import annotations

import torch


def in_host_memory(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu"


class HostBytes:
    """Byte views (uint8, flat) of ``tensors`` in host memory, in order, empty tensors left out.
    ``load``: fill the host copies of device tensors now (a sender); a receiver calls
    :meth:`store` after the bytes arrived."""

    def __init__(self, tensors: list[torch.Tensor], load: bool) -> None:
        self.views: list[torch.Tensor] = []
        self._staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device bytes, host copy)
        for tensor in tensors:
            if not tensor.numel():
                continue
            flat = tensor.detach().reshape(-1).view(torch.uint8)
            if in_host_memory(flat):
                self.views.append(flat)
                continue
            host = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            if load:
                host.copy_(flat)  # a synchronous copy: complete when this returns
            self.views.append(host)
            self._staged.append((flat, host))

    def store(self) -> None:
        """Copy the received bytes of device tensors back to the device (in place)."""
        for device_bytes, host in self._staged:
            device_bytes.copy_(host)
        if self._staged and torch.cuda.is_available():
            torch.cuda.synchronize()
