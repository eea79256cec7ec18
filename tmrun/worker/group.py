"""The default process group of a tmrun worker, over the "tmrun" backend, and its hooks.

The one place that knows how the runtime reaches the backend object behind
``torch.distributed``'s default group (see tmrun/comm/backend.py)."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

from tmrun.comm import backend as tmrun_backend
from tmrun.comm import device_plane
from tmrun.protocol import environment

BACKEND = "tmrun"


def init_plain() -> None:
    """A job without in-place replacement: the usual env:// initialisation (torchrun's variables)."""
    if dist.is_initialized():
        return
    backend = os.environ.get(environment.ENV_BACKEND, BACKEND)
    if backend == "nccl":
        device_plane.share_gpu_if_asked()  # the GPU benches' torchrun baseline, as the device plane does
    dist.init_process_group(backend)


def init_active(store: dist.Store, rank: int, world_size: int, comm_timeout: float) -> None:
    """An active rank: the group bootstraps through the agent's store (it outlives workers).
    ``comm_timeout``: seconds of silence after which a peer counts as lost."""
    options = tmrun_backend.Options(native={"timeout": comm_timeout, "connect_timeout": 30.0})
    dist.init_process_group(BACKEND, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(minutes=10), pg_options=options)


def init_joined(store: dist.Store, communicator: Any, comm_timeout: float) -> None:
    """A standby promoted in ``tmrun.init()``: the default group over ``communicator``, its
    rank's link in the survivors' repaired communicator (the group is named like theirs)."""
    options = tmrun_backend.Options(native={"timeout": comm_timeout, "connect_timeout": 30.0}, comm=communicator)
    dist.init_process_group(BACKEND, store=store, rank=int(communicator.rank), world_size=int(communicator.world_size),
                            timeout=timedelta(minutes=10), pg_options=options)


def init_local_as(store: dist.Store, rank: int, world_size: int) -> None:
    """A planned migration's joiner before the switch step: the default group as ``rank``, in
    local mode (the script builds its mesh and model meanwhile, every group local), over the
    job's group store (each group joins the survivors' communicator later: ``attach`` for this
    one, :func:`tmrun.comm.backend.join_later` for the subgroups)."""
    os.environ[tmrun_backend.ENV_LOCAL] = "1"
    try:
        dist.init_process_group(BACKEND, store=store, rank=rank, world_size=world_size, timeout=timedelta(minutes=10))
    finally:
        del os.environ[tmrun_backend.ENV_LOCAL]


def init_local(world_size: int, store: dist.Store | None = None) -> None:
    """A standby: the same world size, every collective served locally (no network). ``store``:
    the job's group store, which no group touches in local mode; torch hands each group made
    over it the store the active ranks' same group has (a background group of the whole world
    joins theirs through it at the promotion: :func:`tmrun.worker.subgroups.join_background`)."""
    os.environ[tmrun_backend.ENV_LOCAL] = "1"
    try:
        dist.init_process_group(BACKEND, store=store if store is not None else dist.HashStore(), rank=0,
                                world_size=world_size)
    finally:
        del os.environ[tmrun_backend.ENV_LOCAL]


def set_plane_store(store: dist.Store) -> None:
    """Every process of the job bootstraps its groups' device planes under ``store``."""
    tmrun_backend.set_plane_store(store)


def process_group() -> dist.ProcessGroup:
    return dist.group.WORLD  # type: ignore[return-value]


def _backend() -> Any:
    return tmrun_backend.get_group(process_group())


def backend() -> Any:
    """The :class:`tmrun.comm.backend.TmrunProcessGroup` of the default group."""
    return _backend()


def comm() -> Any:
    return _backend().comm


def set_failure_handler(handler: Callable[[BaseException], bool]) -> None:
    _backend().set_failure_handler(handler)


def clear_aborted() -> None:
    _backend().clear_aborted()


def attach(communicator: Any) -> None:
    """A promoted standby: leave local mode and use ``communicator`` from now on."""
    b = _backend()
    b.attach(communicator)
    b.set_local(False)


def attach_replacing(communicator: Any) -> Any:
    """:func:`attach`, returning the communicator it replaces (None for a standby's first one)."""
    b = _backend()
    old = b.attach(communicator)
    b.set_local(False)
    return old


def traffic() -> dict[str, int]:
    """Collectives served locally and bytes this process put on the network, over every tmrun
    group it created (the default group, and the subgroups of ``new_group`` / a device mesh): a
    standby's sandbox must show zero bytes."""
    total = {"local_ops": 0, "network_ops": 0, "bytes_sent": 0, "bytes_recv": 0}
    groups = tmrun_backend.created_groups() or [_backend()]
    for b in groups:
        counters, stats = b.counters(), b.stats()
        total["local_ops"] += int(stats.get("local_ops", 0))
        total["network_ops"] += int(stats.get("network_ops", 0))
        total["bytes_sent"] += int(counters.get("bytes_sent", 0))
        total["bytes_recv"] += int(counters.get("bytes_recv", 0))
    return total
