"""Every key a tmrun process reads or writes in the job's store: the one place keys are built.

Three namespaces, each relative to a prefix built here too:

* **job** (``job_prefix(run_id)``): membership, node registrations, failure reports, events,
  migration requests, drills. Written by agents and the leader; read by ``tmrun-ctl``.
* **in-place** (``group_prefix`` on one node, a fresh one per start of the worker group;
  ``node_prefix`` across nodes, one per rendezvous epoch): generations, plans, standby
  readiness and assignments, workers' reports, the healing meta-data.
* **communicator** (``COMM_PREFIX`` / ``PG_PREFIX`` under the in-place prefix, and the
  backend's ``BACKEND_PREFIX``): where communicators publish their addresses.

Names of what they count: *epoch* is the rendezvous epoch (the active group changed, workers
restarted); *generation* is an in-place change inside one epoch (a rank replaced, no restart);
the native communicator calls its generation ``epoch`` internally (its wire format predates
these names) and is only ever given generations.
"""

from __future__ import annotations

# ---- job namespace (prefix tmrun/<run>/) ------------------------------------------------------


def job_prefix(run_id: str) -> str:
    return f"tmrun/{run_id}/"


STATE = "state"  # Membership JSON, written by the leader only
STATE_VERSION = "state_version"  # counter bumped after every write of STATE
CLOSED = "closed"  # JSON ClosedNotice; set once, first writer wins
NODE_SEQ = "node_seq"  # counter: nodes registered (ordinals in join order; node_order maps each to its id)
FAIL_SEQ = "fail_seq"  # counter: failure reports
FAIL_HANDLED = "fail_handled"  # how many failure reports the leader took (a leader taking over goes on from it)
EVENT_SEQ = "event_seq"  # counter: events
LEFT = "left"  # counter: agents that have left after the job closed
LIVENESS_ADDR = "leader/liveness"  # "host:port" of the leader's liveness listener
LEADER_INFO = "leader/info"  # JSON LeaderInfo
AUTH_MODE = "auth/mode"  # how the job token was obtained: "given" (file/env), "store" (AUTH_TOKEN), "local"
AUTH_TOKEN = "auth/token"  # a generated token of a multi-node job (the store is unauthenticated: docs/user-guide.md)
MIGRATE_SEQ = "migrate_seq"  # counter: migration requests (tmrun-ctl migrate, tm.migrate())


def node_order(ordinal: int) -> str:
    """The node id of the ``ordinal``-th node to register (its id may differ: a SLURM node
    claims ``SLURM_NODEID`` as its id)."""
    return f"node_order/{ordinal}"


def node_claim(node_id: int) -> str:
    """Set once by the agent that takes ``node_id`` (compare-and-set: ids are unique)."""
    return f"node/{node_id}/claim"


def node_info(node_id: int) -> str:
    """JSON NodeInfo, written by the node's agent when it registers."""
    return f"node/{node_id}/info"


def node_workers(node_id: int) -> str:
    """JSON WorkersInfo: the node's worker and standby processes (for tmrun-ctl status)."""
    return f"node/{node_id}/workers"


def failure(seq: int) -> str:
    """JSON FailureReport of an agent about its node."""
    return f"fail/{seq}"


def event(seq: int) -> str:
    return f"event/{seq}"


def migrate_request(seq: int) -> str:
    """JSON MigrateRequest."""
    return f"migrate/{seq}"


def drill(index: int) -> str:
    """Counter: the first process to add 1 fires failure drill ``index`` (once per job)."""
    return f"drill/{index}"


def epoch_prefix(epoch: int) -> str:
    """Per-epoch namespace of the workers' torch store: no restart reads keys an earlier one wrote."""
    return f"epoch/{epoch}/"


# ---- in-place namespaces ------------------------------------------------------------------------


def group_prefix(run_id: str, group_start: int) -> str:
    """The in-place protocol's prefix of one start of a single-node job's worker group."""
    return f"tmrun/{run_id}/ip/{group_start}/"


def node_prefix(run_id: str, epoch: int) -> str:
    """The in-place protocol's prefix of a multi-node job's ``epoch``."""
    return f"tmrun/{run_id}/ip/e{epoch}/"


API = "api"  # set by the first worker whose script called tmrun.init() (value: "1")
MEMBERS = "members"  # counter: active ranks that initialised the runtime
GEN = "gen"  # current generation (decimal), written by the controller
REPORT_SEQ = "report_seq"  # counter of worker reports
ABORT = "abort"  # JSON AbortNotice: in-place replacement is over for this prefix
SUBGROUPS = "subgroups"  # "1": the job's ranks made subgroups (a standby then waits in tmrun.init()), else "0"
DIVERGED = "diverged"  # replicas disagree after a change (tmrun.worker.replica_check): the job ends failed, no restart
UNHEALABLE = "unhealable"  # why a change cannot heal in place (no live replica of a shard): the controller falls back at once
WARM_IMPORTS_SETUP = "warm_imports/setup"  # rank 0's module names at its first step (tmrun.worker.warm_imports)
WARM_IMPORTS_STEADY = "warm_imports/steady"  # the same once its second step committed
STARTUP_MESSAGES = "startup_messages"  # pickled P2P messages rank 0 received in its first step (tmrun.worker.startup_replay)


def pipeline_startup(rank: int, schedule: int) -> str:
    """The P2P messages ``rank`` received in the start-up of its ``schedule``-th tracked pipeline
    schedule (pickled; set once: tmrun.worker.pipeline_startup)."""
    return f"pp_startup/{rank}/{schedule}"


def pipeline_startup_of_shard(shard: int, schedule: int) -> str:
    """The same as :func:`pipeline_startup`, keyed by the stages held (the member's shard key,
    equal on replicas): the first replica whose recording was whole sets it (compare-and-set)."""
    return f"pp_startup_shard/{shard}/{schedule}"


def pipeline_startup_way(gen: int, rank: int) -> str:
    """How the joiner of ``rank`` in generation ``gen`` runs its pipeline's start-up: b"local"
    (from the lost rank's recording) or b"network" (its pipeline's survivors run it again with it);
    set once, by whoever asks first (compare-and-set)."""
    return f"pp_startup_way/{gen}/{rank}"


JOB_ID = "job_id"  # the communicator's job id (rank 0 writes it; joiners read it)


def plan(gen: int) -> str:
    """JSON ReplacementPlan of generation ``gen``."""
    return f"plan/{gen}"


def switch(gen: int) -> str:
    """The step at whose end a planned generation takes over (first proposer wins)."""
    return f"switch/{gen}"


def handoff_prefix(gen: int, rank: int) -> str:
    """Where the leaver and the joiner of ``rank`` meet in a planned generation (a node's
    migration moves several ranks at once: one pair each)."""
    return f"handoff/{gen}/{rank}"


def standby_ready(standby_id: int) -> str:
    """JSON StandbyReady: the standby finished its shadow steps and waits."""
    return f"standby/{standby_id}/ready"


def standby_assign(standby_id: int) -> str:
    """JSON Assignment: the rank a standby takes (or stop)."""
    return f"standby/{standby_id}/assign"


def report(seq: int) -> str:
    """JSON WorkerReport."""
    return f"report/{seq}"


def rng(rank: int) -> str:
    """``rank``'s pickled random-state record (tmrun.worker.step_records.Record: its states by the step
    they start), for the joiner that takes it over."""
    return f"rng/{rank}"


def rank_state(rank: int) -> str:
    """``rank``'s pickled per-rank record (``tm.track_per_rank``; tmrun.worker.step_records.Record: its
    state by the step it starts, the current step's and from its commit the next one's), for the
    joiner that takes it over."""
    return f"rank_state/{rank}"


def done(rank: int) -> str:
    """Set by a rank whose ``steps()`` finished (value: its last committed step)."""
    return f"done/{rank}"


def heal_done(gen: int, rank: int) -> str:
    """Set by a member healed into ``gen`` once the optimizer state it read after healing (out of
    its donors' memory) arrived intact ("ok") or not ("error: ..."): its donors may step their
    optimizers then (tmrun.worker.transfer: deferred healing)."""
    return f"heal-done/{gen}/{rank}"


def ddp_buckets(gen: int, donor: int) -> str:
    """JSON: a donor's gradient buckets of each of its DDP models (reducer parameter indices per
    bucket), for the members healed into ``gen`` that built theirs after their promotion
    (tmrun.worker.ddp_buckets)."""
    return f"ddp-buckets/{gen}/{donor}"


def heal_crc(gen: int, donor: int, needy: int) -> str:
    """CRC-32C (decimal) of the optimizer state's stripe ``donor`` lets ``needy`` read after
    healing it into ``gen`` (tmrun.worker.transfer: deferred healing)."""
    return f"heal-crc/{gen}/{donor}/{needy}"


def commit_record(gen: int, rank: int) -> str:
    """``rank``'s last committed step (decimal) as it left the steps of ``gen``: written when it
    starts recovering, or at once by a rank whose commit vote lost a peer; such a rank applies
    its step's update if any surviving member committed it (tmrun.worker.vote)."""
    return f"commit/{gen}/{rank}"


def commit_records(gen: int) -> str:
    """Counter: ``commit_record`` writes of ``gen`` (a rank whose vote lost a peer polls it)."""
    return f"commits/{gen}"


def committed_at(gen: int, step: int) -> str:
    """Counter: ``commit_record`` writes of ``gen`` whose value is ``step``."""
    return f"committed-at/{gen}/{step}"


def recovered(gen: int) -> str:
    """Counter: members that finished recovery into ``gen``."""
    return f"recovered/{gen}"


def timing(gen: int, rank: int) -> str:
    """JSON RecoveryTiming: ``rank``'s instants of its recovery into ``gen`` (written when it
    counted itself recovered, rewritten once its first step after it ended)."""
    return f"timing/{gen}/{rank}"


def first_steps(gen: int) -> str:
    """Counter: members whose first step after recovering into ``gen`` ended (its
    ``timing`` record then has ``first_step``)."""
    return f"first_steps/{gen}"


def node_ranks(group_rank: int) -> str:
    """JSON NodeRanks of the node at ``group_rank`` (its agent writes it; several nodes)."""
    return f"node/{group_rank}/ranks"


def standby_node(node_id: int) -> str:
    """JSON StandbyNode: the standby workers of standby node ``node_id``, by local rank."""
    return f"standby_node/{node_id}"


# ---- communicator namespaces ----------------------------------------------------------------------

COMM_PREFIX = "comm/"  # under an in-place prefix: the worker runtime's native communicators
PG_PREFIX = "pg/"  # under an in-place prefix: the default process group's rendezvous
BACKEND_PREFIX = "tmrun/pg"  # the "tmrun" backend's groups under a torch store: g<count>/...
PLANE_PREFIX = "dp/"  # under an in-place prefix: the device planes' bootstraps, g<group name>/e<generation>/...
BACKEND_GROUP_COUNT = "tmrun/generation"  # counter: groups the "tmrun" backend created
NATIVE_PREFIX = "tmrun/native"  # default prefix of native.connect_via_store


def native_address(prefix: str, job_id: str, comm_epoch: int, rank: int) -> str:
    """Where a native communicator publishes its "host:port" for ``comm_epoch`` (a generation)."""
    return f"{prefix}/{job_id}/epoch{comm_epoch}/addr/{rank}"


def nccl_key(epoch: int, group: str, purpose: str) -> str:
    """Epoch-prefixed key of the NCCL transport, e.g. ``epoch/3/nccl/default/init``."""
    if int(epoch) < 0:
        raise ValueError("epoch must be >= 0")
    return f"epoch/{int(epoch)}/nccl/{group}/{purpose}"


# ---- appended: the operations endpoint ----------------------------------------------------------

OPS_ADDR = "leader/ops"  # "host:port" of the leader's operations endpoint (tmrun-ctl; protocol/ops.py)

# ---- progress (detection beyond process exit) ------------------------------------------------------


def final_progress(epoch: int, node: int) -> str:
    """A node's ranks' last progress in ``epoch`` (a :class:`NodeProgress`), written once by its
    agent when that epoch's workers stopped, before it starts the next epoch's: the leader
    counts a group restart's recomputed steps from it."""
    return f"progress-final/{epoch}/{node}"


def node_progress(node: int) -> str:
    """JSON NodeProgress of node ``node`` (group rank; 0 on one node), under the job prefix
    ``tmrun/<run>/``: its agent rewrites it at most about once a second while workers run."""
    return f"progress/{node}"
