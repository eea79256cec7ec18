"""tmrun: an interruption-resilient drop-in replacement for torchrun.

``import tmrun`` registers the torch.distributed backend "tmrun"; ``tm = tmrun.init()`` in a
training script starts the worker runtime (in-place replacement; see docs/user-guide.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tmrun.comm.backend import register as _register_backend

if TYPE_CHECKING:
    from tmrun.worker.runtime import Runtime

__version__ = "0.1.0"

_register_backend()  # torch.distributed backend "tmrun"


def init() -> Runtime:
    """Start (or return) this worker's runtime (see :mod:`tmrun.worker.runtime`)."""
    from tmrun.worker.runtime import init as _init

    return _init()
