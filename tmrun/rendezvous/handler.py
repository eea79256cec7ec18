"""The "tmrun" rendezvous handler: epochs, active and standby nodes, one leader.

Every agent registers as a node. The agent that hosts the store runs the leader, which decides
membership; the others only read it. The leader is not part of this package: it is given to the
handler as ``start_leader`` (see :mod:`tmrun.control.rendezvous_backend`, which builds handlers
for torch's registry), so that decisions live in ``control`` and this package only adapts the
store and the membership to torch's ``RendezvousHandler``. ``next_rendezvous`` returns when this node holds a group
rank in an epoch newer than the one it last ran; a standby node waits inside it until promoted.
Each epoch gets its own key prefix, so no restart ever reads an address an earlier one wrote.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from torch.distributed import PrefixStore, Store
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from tmrun.console import say
from tmrun.protocol import auth, keys
from tmrun.protocol.membership import GroupLimits, Membership, Phase
from tmrun.protocol.messages import ClosedNotice, FailureReport, LeaderInfo, NodeInfo, WorkersInfo
from tmrun.protocol.etcd import EtcdConfig, EtcdConfigError, EtcdError, EtcdStore
from tmrun.rendezvous.election import AgentLease, job_key_prefix
from tmrun.rendezvous.endpoint import Endpoint, open_store, parse_endpoint
from tmrun.rendezvous.liveness import LivenessBeacon

DEFAULT_PORT = 29400
BACKEND_NAME = "tmrun"
ETCD_BACKEND_NAME = "tmrun-etcd"  # the same handler on etcd: no store host, the lead is a lease


class NodeRetiredError(RendezvousClosedError):
    """This node's ranks were taken over in place by a standby node: its agent leaves (the job
    goes on without it)."""


class LeaderHandle(Protocol):
    """The leader thread, as the handler of its host sees it."""

    error: BaseException | None  # set when the leader stopped on an error

    def stop(self) -> None: ...


# (raw store, config, the host to advertise, takeover) -> the started leader
StartLeader = Callable[[Store, "TmrunRendezvousConfig", str, bool], LeaderHandle]


class RendezvousConfigError(ValueError):
    """A rendezvous option is invalid (reported to the user as one line)."""


@dataclass(frozen=True)
class TmrunRendezvousConfig:
    endpoint: Endpoint
    run_id: str
    limits: GroupLimits
    node_rank_hint: int
    local_addr: str | None
    join_timeout: float
    last_call_timeout: float
    failure_settle: float
    heartbeat_interval: float
    heartbeat_timeout: float
    connect_timeout: float
    read_timeout: float
    close_grace: float
    standby_wait: float
    may_host: bool  # rdzv-conf is_host (as torch's c10d backend): false = always a client
    event_log: str = ""  # rdzv-conf event_log: the leader's JSON-lines event log ("": none)
    ops_port: int = 0  # rdzv-conf ops_port: the operations endpoint's preferred port (0: any)
    etcd: EtcdConfig | None = None  # --rdzv-backend tmrun-etcd: the cluster (endpoint list, TLS, auth)
    lease_ttl: float = 10.0  # etcd: an agent's lease; its loss (the leader's included) is seen within it
    token: str = field(default="", repr=False, compare=False)  # the job token (set by the handler)

    @classmethod
    def from_parameters(cls, params: RendezvousParameters) -> TmrunRendezvousConfig:
        def number(key: str, default: float) -> float:
            raw = params.get(key, default)
            try:
                value = float(raw)
            except (TypeError, ValueError):
                raise RendezvousConfigError(f"rendezvous option {key}={raw!r} is not a number") from None
            if value < 0:
                raise RendezvousConfigError(f"rendezvous option {key}={raw!r} must not be negative")
            return value

        standby = int(number("standby", 0))
        etcd = None
        if params.backend == ETCD_BACKEND_NAME:
            if not params.endpoint:
                raise RendezvousConfigError("--rdzv-backend tmrun-etcd needs --rdzv-endpoint HOST:PORT[,HOST:PORT...] "
                                            "(the etcd cluster's client endpoints)")
            try:
                etcd = EtcdConfig.parse(params.endpoint, params.config)
            except EtcdConfigError as exc:
                raise RendezvousConfigError(str(exc)) from None
        if params.min_nodes < 1 or params.max_nodes < params.min_nodes:
            raise RendezvousConfigError(f"invalid node counts {params.min_nodes}:{params.max_nodes}")
        first = f"{etcd.endpoints[0][0]}:{etcd.endpoints[0][1]}" if etcd else params.endpoint
        heartbeat_timeout = number("heartbeat_timeout", 10.0)
        return cls(
            etcd=etcd,
            lease_ttl=number("lease_ttl", heartbeat_timeout),
            endpoint=parse_endpoint(first or f"localhost:{DEFAULT_PORT}", DEFAULT_PORT),
            run_id=params.run_id,
            limits=GroupLimits(params.min_nodes, params.max_nodes, standby),
            node_rank_hint=params.get_as_int("node_rank", -1),
            local_addr=params.local_addr,
            join_timeout=number("join_timeout", 600),
            last_call_timeout=number("last_call_timeout", 30),
            failure_settle=number("failure_settle", 0.25),
            heartbeat_interval=number("heartbeat_interval", 1.0),
            heartbeat_timeout=heartbeat_timeout,
            connect_timeout=number("connect_timeout", 60),
            read_timeout=number("read_timeout", 60),
            close_grace=number("close_grace", 10),
            standby_wait=number("standby_wait", 60),
            may_host=str(params.get("is_host", "auto")).lower() not in ("0", "false", "no"),
            event_log=str(params.get("event_log", "") or ""),
            ops_port=int(number("ops_port", 0)),
        )


class TmrunRendezvousHandler(RendezvousHandler):
    def __init__(self, config: TmrunRendezvousConfig, start_leader: StartLeader | None = None) -> None:
        self.config = config
        self._lease: AgentLease | None = None
        store: Store
        if config.etcd is not None:
            store = _open_etcd(config)
            self.is_host, port = False, config.endpoint.port
        else:
            store, self.is_host, port = open_store(
                config.endpoint,
                connect_timeout=config.connect_timeout,
                op_timeout=config.read_timeout,
                may_host=config.may_host,
            )
        self.endpoint = Endpoint(config.endpoint.host, port)
        self._raw_store = store
        self.store: Store = PrefixStore(keys.job_prefix(config.run_id), store)
        self.config = config = replace(config, token=self._job_token())
        self.node_id: int | None = None
        self.epoch = 0
        self.membership = Membership()
        self._state_version = -1
        self._leader: LeaderHandle | None = None
        self._start_leader_with = start_leader
        self._beacon: LivenessBeacon | None = None
        self._left = False
        self.store_lost = False  # set when the store's connection failed (its host is gone)
        # called while this node stands by, with the current membership (the agent keeps its
        # standby workers warm for the active group's epoch)
        self.on_standby: Callable[[Membership], None] | None = None
        # etcd: called (on the lease's thread) each time this agent takes the lead
        self.on_lead: Callable[[], None] | None = None
        if self.is_host or config.etcd is not None:
            if start_leader is None:
                raise RendezvousConfigError("this agent may lead the job but was given no leader to run")
            if config.etcd is not None:
                self._campaign(start_leader)
            else:
                self._start_leader(start_leader)

    # -- RendezvousHandler ----------------------------------------------------------------

    def get_backend(self) -> str:
        return ETCD_BACKEND_NAME if self.config.etcd is not None else BACKEND_NAME

    @property
    def store_url(self) -> str:
        """Where workers open the job's store: ``host:port`` (the TCPStore) or ``etcd://...``."""
        return self.config.etcd.url() if self.config.etcd is not None else str(self.endpoint)

    @property
    def use_agent_store(self) -> bool:
        # Workers get a fresh store per epoch (on group rank 0), never the agents' store.
        return False

    def get_run_id(self) -> str:
        return self.config.run_id

    @property
    def token(self) -> str:
        """The job token every agent of the job shares (workers get it through the environment)."""
        return self.config.token

    @property
    def leader(self) -> LeaderHandle | None:
        """The leader this agent runs (the store host, or the etcd lease's holder), else None."""
        if self._lease is not None:
            return self._lease.leader
        return self._leader

    @property
    def raw_store(self) -> Store:
        """The job's store without any prefix (the in-place protocol's keys are full paths)."""
        return self._raw_store

    def next_rendezvous(self) -> RendezvousInfo:
        if self.node_id is None:
            self._register()
        started = time.monotonic()
        announced_standby = False
        while True:
            membership = self._read_membership()
            if membership.is_closed():
                raise RendezvousClosedError(f"job {membership.phase.value}: {membership.reason}")
            assert self.node_id is not None
            self.check_retired()
            if self.node_id in membership.dead:
                raise RendezvousClosedError(f"node {self.node_id} was declared dead by the leader")
            rank = membership.group_rank_of(self.node_id)
            if rank is not None and membership.epoch > self.epoch:
                self.epoch = membership.epoch
                return self._rendezvous_info(membership, rank)
            if self.node_id in membership.standby and not announced_standby:
                say(f"node {self.node_id} is a standby (epoch {membership.epoch}); waiting to be promoted")
                announced_standby = True
            if rank is not None:
                announced_standby = False
            elif self.on_standby is not None and self.node_id in membership.standby:
                self.on_standby(membership)
            if membership.phase is Phase.FORMING and time.monotonic() - started > self.config.join_timeout + 5:
                raise RendezvousTimeoutError("the group did not form in time")
            self._check_leader()
            time.sleep(0.1 if self.node_id in membership.standby else 0.02)

    def is_closed(self) -> bool:
        return self.store.check([keys.CLOSED])

    def set_closed(self) -> None:
        self.close(Phase.SUCCEEDED, "closed")

    def num_nodes_waiting(self) -> int:
        """Non-zero when the active group changed since this node's workers started."""
        membership = self._read_membership()
        if membership.is_closed():
            raise RendezvousClosedError(f"job {membership.phase.value}: {membership.reason}")
        self._check_leader()
        return 1 if membership.epoch > self.epoch else 0

    def shutdown(self) -> bool:
        self.leave()
        return True

    # -- tmrun additions --------------------------------------------------------------------

    def close(self, phase: Phase, reason: str) -> None:
        """Close the job for everyone (first closer wins)."""
        self.store.compare_set(keys.CLOSED, "", ClosedNotice(phase.value, reason).encode())

    def closed_reason(self) -> tuple[Phase, str] | None:
        if not self.store.check([keys.CLOSED]):
            return None
        notice = ClosedNotice.decode(keys.CLOSED, self.store.get(keys.CLOSED))
        return Phase(notice.phase), notice.reason

    def is_standing_by(self) -> bool:
        """True while this node is one of the job's standbys (not yet given a group rank); with
        the store gone, what the membership it last read said (its stop line names its role)."""
        if self.node_id is None:
            return False
        try:
            membership = self._read_membership()
        except Exception:  # noqa: BLE001 - the store is gone: the last membership read
            membership = self.membership
        return self.node_id in membership.standby

    def wait_closed(self, poll: float = 0.2) -> tuple[Phase, str]:
        """Block until the job closes (its phase and reason); raises RendezvousClosedError if the
        leader running here fails first. No timeout of its own: a store host that retired as a
        compute node serves the store for as long as the job runs."""
        while True:
            closed = self.closed_reason()
            if closed is not None:
                return closed
            self._check_leader()
            time.sleep(poll)

    def check_retired(self) -> None:
        """Raise :class:`NodeRetiredError` once a standby node took this node's ranks in place."""
        membership = self._read_membership()
        if self.node_id is not None and self.node_id in membership.retired:
            raise NodeRetiredError(f"node {self.node_id}'s ranks were taken over in place ({membership.reason})")
        if self.node_id is not None and self.node_id in membership.dead and self.node_id not in membership.active:
            # declared lost (no heartbeat: it was stopped or cut off) while it lived on
            raise NodeRetiredError(f"node {self.node_id} was declared lost and its ranks were taken over in place "
                                   f"({membership.reason})")

    def report_failure(self, by_signal: bool, detail: str, node_fallback: str = "", reached_api: bool = False) -> None:
        """Tell the leader that a worker of this node failed in the current epoch
        (``node_fallback``: why the node's own in-place controller gave up on it, if it ran;
        ``reached_api``: a worker of the node reached tmrun.init(), by the node's own keys)."""
        assert self.node_id is not None
        seq = self.store.add(keys.FAIL_SEQ, 1) - 1
        report = FailureReport(node_id=self.node_id, epoch=self.epoch, by_signal=by_signal, detail=detail,
                               node_fallback=node_fallback, reached_api=reached_api, at=time.time())
        self.store.set(keys.failure(seq), report.encode())

    def publish_workers(self, info: WorkersInfo) -> None:
        if self.node_id is not None:
            self.store.set(keys.node_workers(self.node_id), info.encode())

    def leave(self) -> None:
        """Say goodbye; the host keeps the store up (bounded) until every live node has left."""
        if self._left:
            return
        self._left = True
        if self._beacon is not None:
            self._beacon.close()
        if self._lease is not None:
            self._lease.close(departed=not self.store_lost)
        if self.store_lost:
            return  # the store's host is gone: nobody to tell, and each store call could wait
        try:
            if self.node_id is not None:
                self.store.add(keys.LEFT, 1)
            if self.is_host:
                self._wait_for_others()
        except Exception:  # noqa: BLE001 - the store is gone: nothing left to coordinate, nothing to say
            pass
        if self._leader is not None:
            self._leader.stop()

    # -- internals --------------------------------------------------------------------------

    def _job_token(self) -> str:
        """The job token: given to this agent (TMRUN_JOB_TOKEN_FILE, TMRUN_JOB_TOKEN), else made by
        the store host. A job that may span nodes gets the host's token through the store (which
        anyone who reaches the store can read: give a token out of band to keep it from them);
        a one-node job's token never leaves its agent and workers."""
        given = auth.token_from_environ()
        limits = self.config.limits
        multi_node = limits.max_nodes > 1 or limits.standby > 0
        if self.config.etcd is not None:
            return self._job_token_on_etcd(given)
        if self.is_host:
            if given is not None:
                token, mode = given, "given"
            else:
                token, mode = auth.new_token(), "store" if multi_node else "local"
                if mode == "store":
                    self.store.set(keys.AUTH_TOKEN, token)
            self.store.set(keys.AUTH_MODE, mode)
            return token
        mode = self.store.get(keys.AUTH_MODE).decode()
        if given is not None:
            if mode == "store":
                raise RendezvousConfigError("this agent was given a job token (TMRUN_JOB_TOKEN_FILE or TMRUN_JOB_TOKEN) "
                                            "and the store host none: give every agent the same, or none")
            return given
        if mode == "local":
            raise RendezvousConfigError("the store host runs a one-node job: no other agent can join it")
        if mode != "store":
            raise RendezvousConfigError("the store host was given a job token (TMRUN_JOB_TOKEN_FILE or "
                                        "TMRUN_JOB_TOKEN) and this agent none: give every agent the same")
        return self.store.get(keys.AUTH_TOKEN).decode()

    def _job_token_on_etcd(self, given: str | None) -> str:
        """etcd has no host: the first agent decides. Given tokens must be given to every agent;
        else the first agent's generated token is shared through etcd (behind etcd's own TLS and
        authentication when configured)."""
        if given is not None:
            if self.store.compare_set(keys.AUTH_MODE, "", "given").decode() != "given":
                raise RendezvousConfigError("this agent was given a job token (TMRUN_JOB_TOKEN_FILE or TMRUN_JOB_TOKEN) "
                                            "and the job's first agent none: give every agent the same, or none")
            return given
        token = self.store.compare_set(keys.AUTH_TOKEN, "", auth.new_token()).decode()
        if self.store.compare_set(keys.AUTH_MODE, "", "store").decode() != "store":
            raise RendezvousConfigError("the job's first agent was given a job token (TMRUN_JOB_TOKEN_FILE or "
                                        "TMRUN_JOB_TOKEN) and this agent none: give every agent the same")
        return token

    def _start_leader(self, start_leader: StartLeader) -> None:
        advertise = self.config.endpoint.host
        if advertise in ("localhost", "0.0.0.0", ""):
            advertise = "127.0.0.1"
        self._leader = start_leader(self._raw_store.clone(), self.config, advertise, False)
        info = LeaderInfo(host=socket.gethostname(), pid=os.getpid(), endpoint=str(self.endpoint))
        self.store.set(keys.LEADER_INFO, info.encode())

    def _campaign(self, start_leader: StartLeader) -> None:
        """etcd: this agent's lease, and its candidacy for the lead (see rendezvous.election)."""
        advertise = self.config.local_addr or socket.gethostname()

        def lead(takeover: bool) -> LeaderHandle:
            leader = start_leader(self._raw_store.clone(), self.config, advertise, takeover)
            info = LeaderInfo(host=socket.gethostname(), pid=os.getpid(), endpoint=self.store_url)
            self.store.set(keys.LEADER_INFO, info.encode())
            if self.on_lead is not None:
                self.on_lead()
            return leader

        assert isinstance(self._raw_store, EtcdStore)
        try:
            self._lease = AgentLease(self._raw_store, self.config.run_id, self.config.lease_ttl, lead)
        except EtcdError as exc:
            raise RendezvousConfigError(f"cannot take an etcd lease: {exc}") from None
        self._lease.start()

    def _register(self) -> None:
        self.node_id = self._claim_node_id()
        info = NodeInfo(host=socket.gethostname(), addr=self.config.local_addr or socket.getfqdn(), pid=os.getpid(),
                        node_rank_hint=self.config.node_rank_hint, time=time.time())
        if self._lease is not None:  # etcd: liveness is this agent's lease (before the info: never unseen)
            self._lease.register(self.node_id, info.encode())
            self.store.set(keys.node_info(self.node_id), info.encode())
            return
        self.store.set(keys.node_info(self.node_id), info.encode())
        host, port = self.store.get(keys.LIVENESS_ADDR).decode().rsplit(":", 1)
        try:
            self._beacon = LivenessBeacon(host, int(port), self.config.run_id, self.node_id,
                                          self.config.heartbeat_interval, token=self.config.token)
        except auth.AuthError as exc:
            raise RendezvousError(str(exc)) from None

    def _claim_node_id(self) -> int:
        """This node's id: its SLURM node rank when it has one and no other agent took it (a
        restarted agent gets a fresh one), else the next free id from its join ordinal."""
        ordinal = self.store.add(keys.NODE_SEQ, 1) - 1
        token = f"{socket.gethostname()}:{os.getpid()}:{ordinal}"
        hint = self.config.node_rank_hint
        candidate = hint if hint >= 0 else ordinal
        while self.store.compare_set(keys.node_claim(candidate), "", token).decode() != token:
            candidate = ordinal if candidate == hint and hint != ordinal else candidate + 1
        self.store.set(keys.node_order(ordinal), str(candidate))
        return candidate

    def _read_membership(self) -> Membership:
        version = self.store.add(keys.STATE_VERSION, 0)
        if version != self._state_version:
            self.membership = Membership.from_json(self.store.get(keys.STATE))
            self._state_version = version
        return self.membership

    def _check_leader(self) -> None:
        leader = self.leader
        if leader is not None and leader.error is not None:
            raise RendezvousClosedError(f"the tmrun leader failed: {leader.error}")
        if self._lease is not None and self._lease.lost:
            raise RendezvousClosedError("this agent's etcd lease expired: the job went on without this node")

    def _rendezvous_info(self, membership: Membership, rank: int) -> RendezvousInfo:
        epoch_store = PrefixStore(keys.epoch_prefix(membership.epoch), self.store)
        bootstrap = RendezvousStoreInfo.build(rank, epoch_store, local_addr=self.config.local_addr)
        say(f"node {self.node_id} runs group rank {rank} of {len(membership.active)} in epoch {membership.epoch}")
        return RendezvousInfo(epoch_store, rank, len(membership.active), bootstrap)

    def _wait_for_others(self) -> None:
        deadline = time.monotonic() + self.config.close_grace
        while time.monotonic() < deadline:
            registered = self.store.add(keys.NODE_SEQ, 0)
            gone = len(self._read_membership().dead)
            if self.store.add(keys.LEFT, 0) + gone >= registered:
                return
            time.sleep(0.05)


def _open_etcd(config: TmrunRendezvousConfig) -> EtcdStore:
    """The job's namespace on the etcd cluster; a run id that already finished there is refused
    (its keys would mix with this job's: choose another ``--rdzv-id`` or delete them)."""
    assert config.etcd is not None
    try:
        store = EtcdStore.for_job(config.etcd, config.run_id, timeout=config.read_timeout,
                                  connect_timeout=config.connect_timeout)
        closed = store.check([job_key_prefix(config.run_id) + keys.CLOSED])
    except (EtcdError, EtcdConfigError) as exc:
        raise RendezvousConfigError(f"cannot use the etcd rendezvous: {exc}") from None
    if closed:
        raise RendezvousConfigError(
            f"run id {config.run_id!r} already ran to its end on this etcd: choose another --rdzv-id "
            f"(or remove its keys: etcdctl del --prefix {store.namespace})")
    return store
