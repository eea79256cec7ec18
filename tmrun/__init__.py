"""tmrun: an interruption-resilient drop-in replacement for torchrun."""

from __future__ import annotations

__version__ = "0.1.0"

from tmrun.comm.backend import register as _register_backend  # noqa: E402

_register_backend()  # torch.distributed backend "tmrun"
