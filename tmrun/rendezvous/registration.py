"""Registers the "tmrun" backend in torch's rendezvous handler registry.

Imports of torch's registry stay inside the functions: torch loads ``torchrun_plugin`` while
its registry module is still initialising (entry point group ``torchrun.handlers``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

BACKEND_NAME = "tmrun"


def _create(params: RendezvousParameters) -> RendezvousHandler:
    from tmrun.rendezvous.handler import create_handler

    return create_handler(params)


def register_tmrun_backend() -> None:
    """Make ``--rdzv-backend tmrun`` available (idempotent)."""
    from torch.distributed.elastic.rendezvous.registry import handler_registry

    if BACKEND_NAME not in handler_registry._registry:  # noqa: SLF001 - no public lookup exists
        handler_registry.register(BACKEND_NAME, _create)


def torchrun_plugin() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """Entry point of group ``torchrun.handlers``: plain torchrun can use ``--rdzv-backend tmrun``."""
    return _create
