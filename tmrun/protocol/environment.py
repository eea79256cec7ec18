"""The launch environment: what an agent tells the workers and standbys it starts.

:class:`LaunchEnv` is the one type for it: the agent and the standby pool write it with
:meth:`LaunchEnv.to_environ`, the worker runtime and the standby entry point read it with
:meth:`LaunchEnv.from_environ`. Only the ``TMRUN_*`` variables are tmrun's; ``RANK``,
``WORLD_SIZE`` and ``LOCAL_RANK`` are torchrun's (read here, written by torch's agent, or by the
standby pool for a process torch does not start). Variables of other layers are named here too,
so that no module spells a variable's name as a literal.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from enum import Enum
from typing import Mapping

ENV_ROLE = "TMRUN_ROLE"  # "standby" for a standby worker; unset for an active one
ENV_STORE = "TMRUN_IP_STORE"  # host:port of the agent's store, or etcd://h:p[,h:p]; set when in-place replacement is on
ENV_STORE_OPTIONS = "TMRUN_IP_STORE_OPTIONS"  # etcd: JSON of its TLS/auth options (file paths, no secrets)
ENV_RUN_ID = "TMRUN_RUN_ID"
ENV_GEN_FILE = "TMRUN_IP_GEN_FILE"  # the controller's generation, in a file on this node
ENV_PREFIX = "TMRUN_IP_PREFIX"  # key prefix of this worker group's in-place protocol
ENV_STANDBY_ID = "TMRUN_STANDBY_ID"
ENV_AGENT_PID = "TMRUN_AGENT_PID"
ENV_SHADOW_STEPS = "TMRUN_SHADOW_STEPS"
ENV_RECOVERY_TIMEOUT = "TMRUN_RECOVERY_TIMEOUT"
ENV_COMM_TIMEOUT = "TMRUN_COMM_TIMEOUT"
ENV_HANDOVER = "TMRUN_HANDOVER"  # "auto" (same-host reads where possible) or "socket"
ENV_HEAL_PATH = "TMRUN_HEAL_PATH"  # healing: "memory" (same-host reads where possible) or "socket"
ENV_ENTRYPOINT = "TMRUN_ENTRYPOINT"  # JSON argv of the job's script (a standby runs the same)
ENV_READY_FILE = "TMRUN_STANDBY_READY_FILE"  # a single-node standby writes its pid here once warm
ENV_INJECT_FAILURE = "TMRUN_INJECT_FAILURE"  # failure drills (tmrun.worker.drills)
ENV_BACKEND = "TMRUN_BACKEND"  # torch.distributed backend of a plain worker group (default "tmrun")
ENV_STATE_DIR = "TMRUN_STATE_DIR"  # where agents write their run files (tmrun-ctl finds jobs there)
ENV_PROGRESS_DIR = "TMRUN_PROGRESS_DIR"  # per-rank progress records on this node (protocol.progress)
ENV_NODE_NAME = "TMRUN_NODE_NAME"  # the node named in log lines (SLURM: SLURMD_NODENAME); read by tmrun.console
ENV_TORCH_CPP_LOG_LEVEL = "TORCH_CPP_LOG_LEVEL"  # torch's C++ log level, read once when torch loads
ENV_THP_ALLOC = "THP_MEM_ALLOC_ENABLE"  # torch's CPU allocator: transparent huge pages for large blocks
ENV_JOB_TOKEN = "TMRUN_JOB_TOKEN"  # the job token (protocol.auth); the agent sets it for its workers
ENV_JOB_TOKEN_FILE = "TMRUN_JOB_TOKEN_FILE"  # a 0600 file holding the job token (read before TMRUN_JOB_TOKEN)
ENV_FAKE_NVML = "TMRUN_FAKE_NVML"  # tests: a JSON file that stands in for NVML (control.gpu_health)
# the "tmrun" torch.distributed backend
ENV_COMM_LOCAL = "TMRUN_COMM_LOCAL"  # "1": serve collectives locally (a standby's sandbox)
ENV_COMM_BIND = "TMRUN_COMM_BIND"
ENV_COMM_ADVERTISE = "TMRUN_COMM_ADVERTISE"
ENV_NCCL_LIBRARY = "TMRUN_NCCL_LIBRARY"  # an NCCL library to use instead of torch's (preloaded into workers)
ENV_NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"  # torch's watchdog: 2 = clean up, do not kill
# torch's ProcessGroupNCCL watchdog, as a survivor of a lost peer needs it, each unless the user set
# it: clean up without killing the process; no flight recorder (on torch 2.11 its traceback of the
# failed collective ended the survivor: "watchdog thread terminated with exception: std::future_error:
# Broken promise", seen on an H200), no dump on a failure or timeout, no heartbeat monitor (it kills
# a process whose watchdog is slow; tmrun detects hangs itself). docs/nccl.md, "Torch's watchdog".
NCCL_WATCHDOG_DEFAULTS = {
    ENV_NCCL_ERROR_HANDLING: "2",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
}
ENV_DEVICE_PLANE = "TMRUN_DEVICE_PLANE"  # one of DEVICE_PLANES (tmrun.comm.device_plane)
DEVICE_PLANES = ("auto", "nccl", "staging", "gloo")
ENV_HEAL_OVERLAP = "TMRUN_HEAL_OVERLAP"  # one of HEAL_OVERLAPS (tmrun.worker.cpu_budget)
HEAL_OVERLAPS = ("auto", "on", "off")
ENV_COMMIT_VOTE = "TMRUN_COMMIT_VOTE"  # one of COMMIT_VOTES (tmrun.worker.loop: the commit vote)
COMMIT_VOTES = ("on", "off")


def _one_of(environ: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str:
    """``environ[name]`` lower-cased, ``choices[0]`` when unset or empty; ``ValueError`` (one
    line) for any other value than ``choices``."""
    raw = environ.get(name, choices[0]).strip().lower() or choices[0]
    if raw not in choices:
        raise ValueError(f"{name}={raw!r} is not one of {', '.join(choices)}")
    return raw


def device_plane(environ: Mapping[str, str]) -> str:
    """The device plane ``TMRUN_DEVICE_PLANE`` asks for (``auto`` when unset); ``ValueError``
    (one line) for any other value than :data:`DEVICE_PLANES`."""
    return _one_of(environ, ENV_DEVICE_PLANE, DEVICE_PLANES)


def heal_overlap(environ: Mapping[str, str]) -> str:
    """Whether a healed member reads the optimizer state in the background while it computes
    (``TMRUN_HEAL_OVERLAP``: ``auto`` when unset, see :mod:`tmrun.worker.cpu_budget`);
    ``ValueError`` (one line) for any other value than :data:`HEAL_OVERLAPS`."""
    return _one_of(environ, ENV_HEAL_OVERLAP, HEAL_OVERLAPS)


def commit_vote(environ: Mapping[str, str]) -> bool:
    """Whether in-place ranks vote before each step's commit (``TMRUN_COMMIT_VOTE``: ``on`` when
    unset; ``off`` saves one tiny all-reduce per step and gives up what the vote guarantees,
    docs/user-guide.md); ``ValueError`` (one line) for any other value."""
    return _one_of(environ, ENV_COMMIT_VOTE, COMMIT_VOTES) == "on"


# torchrun's own
ENV_RANK = "RANK"
ENV_WORLD_SIZE = "WORLD_SIZE"
ENV_LOCAL_RANK = "LOCAL_RANK"
ENV_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
ENV_GROUP_RANK = "GROUP_RANK"
ENV_TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"


class Mode(Enum):
    PLAIN = "plain"  # no in-place replacement (torchrun, or tmrun without a standby worker)
    ACTIVE = "active"  # an active rank of an in-place job
    STANDBY = "standby"  # a standby worker: sandbox until promoted


class LaunchEnvError(ValueError):
    """The launch environment is inconsistent (one line for the user)."""


def _integer(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "")
    if raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise LaunchEnvError(f"{name}={raw!r} is not an integer") from None


def _number(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise LaunchEnvError(f"{name}={raw!r} is not a number") from None
    if value != value:
        raise LaunchEnvError(f"{name}={raw!r} is not a number")
    if value < 0:
        raise LaunchEnvError(f"{name}={raw!r} must not be negative")
    return value


def _count(env: Mapping[str, str], name: str, default: int) -> int:
    """A count given as a number (``2`` or ``2.0``): finite, not negative."""
    value = _number(env, name, default)
    if value == float("inf"):
        raise LaunchEnvError(f"{name}={env.get(name)!r} must be finite")
    return int(value)


DEFAULT_PREFIX = "tmrun/ip/"


@dataclass(frozen=True)
class LaunchEnv:
    mode: Mode = Mode.PLAIN
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    store_host: str = ""  # the agent's store (in-place modes only)
    store_port: int = 0
    store_etcd: str = ""  # etcd://h:p[,h:p]: the job's store is on etcd (then host and port are unused)
    store_options: str = ""  # etcd: JSON object of its options (protocol.etcd.EtcdConfig.options)
    store_prefix: str = DEFAULT_PREFIX  # the in-place protocol's keys (protocol.keys.group_prefix/node_prefix)
    gen_file: str = ""  # the controller's current generation, in a file on this node
    run_id: str = "none"
    standby_id: int = -1
    agent_pid: int = 0
    shadow_steps: int = 2
    recovery_timeout: float = 120.0
    comm_timeout: float = 5.0
    same_host_reads: bool = True  # a migration's joiner may read the leaver's memory (TMRUN_HANDOVER)
    heal_reads: bool = True  # healing: a needy member may read same-host donors' memory (TMRUN_HEAL_PATH)
    entrypoint: tuple[str, ...] = ()  # argv of the job's script, for a standby to run the same
    ready_file: str = ""  # a single-node standby's "I am warm" file
    progress_dir: str = ""  # where this node's workers write their progress records ("" : none)

    def to_environ(self) -> dict[str, str]:
        """The ``TMRUN_*`` variables that :meth:`from_environ` reads back as this env (the
        torchrun variables rank, world size and local rank are not written)."""
        environ = {
            ENV_RUN_ID: self.run_id,
            ENV_AGENT_PID: str(self.agent_pid),
            ENV_SHADOW_STEPS: str(self.shadow_steps),
            ENV_RECOVERY_TIMEOUT: repr(self.recovery_timeout),
            ENV_COMM_TIMEOUT: repr(self.comm_timeout),
            ENV_HANDOVER: "auto" if self.same_host_reads else "socket",
            ENV_HEAL_PATH: "memory" if self.heal_reads else "socket",
            ENV_PREFIX: self.store_prefix,
            ENV_GEN_FILE: self.gen_file,
            ENV_ENTRYPOINT: json.dumps(list(self.entrypoint)),
            ENV_STANDBY_ID: str(self.standby_id),
            ENV_READY_FILE: self.ready_file,
            ENV_STORE: (self.store_etcd or f"{self.store_host}:{self.store_port}") if self.mode is not Mode.PLAIN else "",
            ENV_STORE_OPTIONS: self.store_options,
            ENV_ROLE: "standby" if self.mode is Mode.STANDBY else "",
            ENV_PROGRESS_DIR: self.progress_dir,
        }
        return environ

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> LaunchEnv:
        env = os.environ if environ is None else environ
        store = env.get(ENV_STORE, "")
        role = env.get(ENV_ROLE, "")
        mode = Mode.PLAIN
        host, port = "", 0
        store_etcd = ""
        if store.startswith("etcd://"):
            mode = Mode.STANDBY if role == "standby" else Mode.ACTIVE
            store_etcd = store
        elif store:
            mode = Mode.STANDBY if role == "standby" else Mode.ACTIVE
            host, _, port_text = store.rpartition(":")
            if not host or not port_text.isascii() or not port_text.isdigit() or int(port_text) > 65535:
                raise LaunchEnvError(f"{ENV_STORE}={store!r} is not host:port")
            port = int(port_text)
        handover = env.get(ENV_HANDOVER, "") or "auto"
        if handover not in ("auto", "socket"):
            raise LaunchEnvError(f"{ENV_HANDOVER}={handover!r} must be auto or socket")
        heal_path = env.get(ENV_HEAL_PATH, "") or "memory"
        if heal_path not in ("memory", "socket"):
            raise LaunchEnvError(f"{ENV_HEAL_PATH}={heal_path!r} must be memory or socket")
        try:
            entrypoint = json.loads(env.get(ENV_ENTRYPOINT, "") or "[]")
        except (ValueError, RecursionError):  # RecursionError: nested too deeply
            raise LaunchEnvError(f"{ENV_ENTRYPOINT} is not a JSON list") from None
        if not isinstance(entrypoint, list):
            raise LaunchEnvError(f"{ENV_ENTRYPOINT} is not a JSON list")
        return cls(
            mode=mode,
            rank=_integer(env, ENV_RANK, 0),
            world_size=_integer(env, ENV_WORLD_SIZE, 1),
            local_rank=_integer(env, ENV_LOCAL_RANK, 0),
            store_host=host,
            store_port=port,
            store_etcd=store_etcd,
            store_options=env.get(ENV_STORE_OPTIONS, ""),
            store_prefix=env.get(ENV_PREFIX, "") or DEFAULT_PREFIX,
            gen_file=env.get(ENV_GEN_FILE, ""),
            run_id=env.get(ENV_RUN_ID, "") or env.get(ENV_TORCHELASTIC_RUN_ID, "") or "none",
            standby_id=_integer(env, ENV_STANDBY_ID, -1),
            agent_pid=_integer(env, ENV_AGENT_PID, 0),
            shadow_steps=_count(env, ENV_SHADOW_STEPS, 2),
            recovery_timeout=_number(env, ENV_RECOVERY_TIMEOUT, 120.0),
            comm_timeout=_number(env, ENV_COMM_TIMEOUT, 5.0),
            same_host_reads=handover == "auto",
            heal_reads=heal_path == "memory",
            entrypoint=tuple(str(a) for a in entrypoint),
            ready_file=env.get(ENV_READY_FILE, ""),
            progress_dir=env.get(ENV_PROGRESS_DIR, ""),
        )
