"""The "tmrun" rendezvous backend: torch's handler registry gets handlers wired to a leader.

This is where the two halves meet: :class:`~tmrun.rendezvous.handler.TmrunRendezvousHandler`
adapts the store and the membership to torch's ``RendezvousHandler``; the agent that hosts the
store also runs the :class:`~tmrun.control.leader.Leader` that decides the membership.

Imports of torch's registry stay inside the functions: torch loads ``torchrun_plugin`` while
its registry module is still initialising (entry point group ``torchrun.handlers``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from tmrun.protocol import keys

if TYPE_CHECKING:
    from torch.distributed import Store
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

    from tmrun.control.leader import Leader
    from tmrun.rendezvous.handler import TmrunRendezvousConfig, TmrunRendezvousHandler

BACKEND_NAME = "tmrun"
ETCD_BACKEND_NAME = "tmrun-etcd"
BACKEND_NAMES = (BACKEND_NAME, ETCD_BACKEND_NAME)


def start_leader(raw_store: Store, config: TmrunRendezvousConfig, advertise_host: str,
                 takeover: bool = False) -> Leader:
    """Start the leader of the job on ``raw_store`` (the unprefixed store of its host, or the
    job's etcd namespace; ``takeover``: an earlier leader's decisions are in it)."""
    from torch.distributed import PrefixStore

    from tmrun.control.leader import Leader, LeaderConfig
    from tmrun.rendezvous.election import EtcdLiveness

    leader_config = LeaderConfig(
        run_id=config.run_id,
        limits=config.limits,
        last_call_timeout=config.last_call_timeout,
        join_timeout=config.join_timeout,
        failure_settle=config.failure_settle,
        heartbeat_timeout=config.heartbeat_timeout,
        standby_wait=config.standby_wait,
        event_log=config.event_log or None,
        ops_port=config.ops_port,
        # an etcd call costs about 1 ms (a TCPStore call 20-40 us): the leader's loop asks less often
        poll_interval=0.05 if config.etcd is not None else 0.02,
        store_endpoint=config.etcd.url() if config.etcd is not None
        else f"{config.endpoint.host}:{getattr(raw_store, 'port', config.endpoint.port)}",
        token=config.token,
    )
    liveness = None
    if config.etcd is not None:
        liveness = EtcdLiveness(raw_store.clone(), config.run_id, config.lease_ttl)  # type: ignore[attr-defined]
    leader = Leader(PrefixStore(keys.job_prefix(config.run_id), raw_store), leader_config, raw_store,
                    liveness=liveness, takeover=takeover)
    leader.start(advertise_host)
    return leader


def create_handler(params: RendezvousParameters) -> TmrunRendezvousHandler:
    from tmrun.rendezvous.handler import TmrunRendezvousConfig, TmrunRendezvousHandler

    return TmrunRendezvousHandler(TmrunRendezvousConfig.from_parameters(params), start_leader=start_leader)


def register_tmrun_backend() -> None:
    """Make ``--rdzv-backend tmrun`` and ``tmrun-etcd`` available (idempotent)."""
    from torch.distributed.elastic.rendezvous.registry import handler_registry

    for name in BACKEND_NAMES:
        if name not in handler_registry._registry:  # noqa: SLF001 - no public lookup exists
            handler_registry.register(name, create_handler)


def torchrun_plugin() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """Entry point of group ``torchrun.handlers``: plain torchrun can use ``--rdzv-backend tmrun``."""
    return create_handler
