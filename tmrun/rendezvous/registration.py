"""Registers the "tmrun" backend in torch's rendezvous handler registry."""

from __future__ import annotations

from collections.abc import Callable

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import handler_registry

BACKEND_NAME = "tmrun"


def _create(params: RendezvousParameters) -> RendezvousHandler:
    from tmrun.rendezvous.handler import create_handler  # imported late: keeps `import tmrun` light

    return create_handler(params)


def register_tmrun_backend() -> None:
    """Make ``--rdzv-backend tmrun`` available (idempotent)."""
    if not handler_registry._registry.get(BACKEND_NAME):  # noqa: SLF001 - no public lookup exists
        handler_registry.register(BACKEND_NAME, _create)


def torchrun_plugin() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """Entry point of group ``torchrun.handlers``: plain torchrun can use ``--rdzv-backend tmrun``."""
    return _create
