"""How this worker was launched, read once from the environment the agent gave it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum

ENV_ROLE = "TMRUN_ROLE"  # "standby" for a standby worker; unset for an active one
ENV_STORE = "TMRUN_IP_STORE"  # host:port of the agent's store; set when in-place replacement is on
ENV_RUN_ID = "TMRUN_RUN_ID"
ENV_GEN_FILE = "TMRUN_IP_GEN_FILE"  # the controller's generation, in a file on this node
ENV_PREFIX = "TMRUN_IP_PREFIX"  # key prefix of this worker group's in-place protocol
ENV_STANDBY_ID = "TMRUN_STANDBY_ID"
ENV_AGENT_PID = "TMRUN_AGENT_PID"
ENV_SHADOW_STEPS = "TMRUN_SHADOW_STEPS"
ENV_RECOVERY_TIMEOUT = "TMRUN_RECOVERY_TIMEOUT"
ENV_COMM_TIMEOUT = "TMRUN_COMM_TIMEOUT"
ENV_HANDOVER = "TMRUN_HANDOVER"  # "auto" (same-host reads where possible) or "socket"


class Mode(Enum):
    PLAIN = "plain"  # no in-place replacement (torchrun, or tmrun without a standby worker)
    ACTIVE = "active"  # an active rank of an in-place job
    STANDBY = "standby"  # a standby worker: sandbox until promoted


class LaunchEnvError(ValueError):
    """The launch environment is inconsistent (one line for the user)."""


def _number(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise LaunchEnvError(f"{name}={raw!r} is not a number") from None
    if value < 0:
        raise LaunchEnvError(f"{name}={raw!r} must not be negative")
    return value


@dataclass(frozen=True)
class LaunchEnv:
    mode: Mode
    rank: int
    world_size: int
    local_rank: int
    store_host: str
    store_port: int
    store_prefix: str
    gen_file: str
    run_id: str
    standby_id: int
    agent_pid: int
    shadow_steps: int
    recovery_timeout: float
    comm_timeout: float
    same_host_reads: bool = True  # a migration's joiner may read the leaver's memory (TMRUN_HANDOVER)

    @classmethod
    def from_environ(cls) -> LaunchEnv:
        store = os.environ.get(ENV_STORE, "")
        role = os.environ.get(ENV_ROLE, "")
        mode = Mode.PLAIN
        host, port = "", 0
        if store:
            mode = Mode.STANDBY if role == "standby" else Mode.ACTIVE
            host, _, port_text = store.rpartition(":")
            if not host or not port_text.isdigit():
                raise LaunchEnvError(f"{ENV_STORE}={store!r} is not host:port")
            port = int(port_text)
        handover = os.environ.get(ENV_HANDOVER, "") or "auto"
        if handover not in ("auto", "socket"):
            raise LaunchEnvError(f"{ENV_HANDOVER}={handover!r} must be auto or socket")
        return cls(
            mode=mode,
            rank=int(os.environ.get("RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            store_host=host,
            store_port=port,
            store_prefix=os.environ.get(ENV_PREFIX, "tmrun/ip/"),
            gen_file=os.environ.get(ENV_GEN_FILE, ""),
            run_id=os.environ.get(ENV_RUN_ID, os.environ.get("TORCHELASTIC_RUN_ID", "none")),
            standby_id=int(os.environ.get(ENV_STANDBY_ID, "-1")),
            agent_pid=int(os.environ.get(ENV_AGENT_PID, "0")),
            shadow_steps=int(_number(ENV_SHADOW_STEPS, 2)),
            recovery_timeout=_number(ENV_RECOVERY_TIMEOUT, 120.0),
            comm_timeout=_number(ENV_COMM_TIMEOUT, 5.0),
            same_host_reads=handover == "auto",
        )
