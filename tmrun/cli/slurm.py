"""Defaults from a SLURM step: node count, rendezvous endpoint, run id, node rank."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

RDZV_BASE_PORT = 29400  # the store of a multi-node step: 29400 + step_port_offset(job, step)
OPS_BASE_PORT = 30400  # the leader's operations endpoint (tmrun-ctl): 30400 + the same offset


class HostlistError(ValueError):
    """A SLURM host list that cannot be parsed."""


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, []
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"unbalanced ']' in host list {text!r}")
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth != 0:
        raise HostlistError(f"unbalanced '[' in host list {text!r}")
    parts.append("".join(current))
    return [p for p in parts if p]


def _expand_range(body: str, text: str) -> list[str]:
    values: list[str] = []
    for item in body.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if not match:
            raise HostlistError(f"bad range {item!r} in host list {text!r}")
        start_text, end_text = match.group(1), match.group(2)
        if end_text is None:
            values.append(start_text)
            continue
        start, end = int(start_text), int(end_text)
        if end < start:
            raise HostlistError(f"descending range {item!r} in host list {text!r}")
        width = len(start_text)
        values.extend(str(n).zfill(width) for n in range(start, end + 1))
    return values


def _expand_one(pattern: str, text: str) -> list[str]:
    match = re.search(r"\[([^\[\]]*)\]", pattern)
    if not match:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end() :]
    return [expanded for value in _expand_range(match.group(1), text) for expanded in _expand_one(head + value + tail, text)]


def expand_hostlist(text: str) -> list[str]:
    """Expand SLURM's compressed host list: ``node[01-04,07],gpu-a[1-2]-ib`` and the like."""
    text = text.strip()
    if not text:
        raise HostlistError("empty host list")
    hosts: list[str] = []
    for part in _split_top_level(text):
        hosts.extend(_expand_one(part, text))
    return hosts


class SlurmStepError(ValueError):
    """A SLURM step tmrun cannot run in as launched (the message says what to do instead)."""


def _tasks_per_node(text: str) -> list[int]:
    """SLURM's compressed task counts: ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in filter(None, text.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise SlurmStepError(f"cannot read the task counts {text!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def step_port_offset(job_id: str, step_id: str | None) -> int:
    """0..999: the job's port offset, different for each of its first ten steps, so that
    concurrent steps of one allocation never share a store (or an operations endpoint)."""
    job = int(job_id) if job_id.isdigit() else 0
    step = int(step_id) if step_id and step_id.isdigit() else 0
    return (job + 101 * step) % 1000


@dataclass(frozen=True)
class SlurmDefaults:
    nnodes_total: int  # nodes in the step: actives plus standbys
    first_host: str
    rdzv_port: int
    run_id: str
    node_rank: int
    ops_port: int = 0  # where the leader's operations endpoint listens when that port is free
    in_step: bool = True  # started by srun (False: in the batch script or an salloc shell)
    node_name: str = ""  # SLURMD_NODENAME: this node's name in SLURM


def _check_one_task_per_node(env: Mapping[str, str], nnodes: int) -> None:
    counts_text = env.get("SLURM_STEP_TASKS_PER_NODE", "")
    counts = _tasks_per_node(counts_text) if counts_text else []
    tasks_text = env.get("SLURM_STEP_NUM_TASKS", "")
    tasks = sum(counts) if counts else (int(tasks_text) if tasks_text.isdigit() else nnodes)
    if tasks > nnodes or any(count > 1 for count in counts):
        raise SlurmStepError(
            f"this SLURM step runs {tasks} tasks on {nnodes} node(s) (SLURM_STEP_TASKS_PER_NODE={counts_text or '?'}), "
            "but tmrun is one task per node that starts --nproc-per-node workers: "
            "launch it with `srun --ntasks-per-node=1 tmrun ...`"
        )


def slurm_defaults(env: Mapping[str, str]) -> SlurmDefaults | None:
    """The defaults a SLURM step implies, or None outside SLURM.

    Raises :class:`SlurmStepError` for a step tmrun cannot use as launched (several tasks on a
    node) and :class:`HostlistError` for a host list it cannot read.
    """
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")
    in_step = bool(step)
    if in_step:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        count_text = env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    else:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        count_text = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    if not job_id or not nodelist:
        return None
    hosts = expand_hostlist(nodelist)
    nnodes = int(count_text) if count_text and count_text.isdigit() else len(hosts)
    if in_step:
        _check_one_task_per_node(env, nnodes)
    run_id = f"slurm-{job_id}" + (f".{step}" if step else "")
    node_rank_text = env.get("SLURM_NODEID", "0")
    node_rank = int(node_rank_text) if node_rank_text.isdigit() else 0
    offset = step_port_offset(job_id, step)
    return SlurmDefaults(nnodes, hosts[0], RDZV_BASE_PORT + offset, run_id, node_rank, OPS_BASE_PORT + offset,
                         in_step=in_step, node_name=env.get("SLURMD_NODENAME", ""))


def scontrol(*args: str, env: Mapping[str, str] | None = None, timeout: float = 10.0) -> str | None:
    """``scontrol ARGS``'s output, or None: no scontrol here, it failed, or it did not answer
    within ``timeout``."""
    path = shutil.which("scontrol")
    if path is None:
        return None
    try:
        result = subprocess.run([path, *args], capture_output=True, text=True, timeout=timeout, check=False,
                                env=None if env is None else dict(env))
    except (subprocess.TimeoutExpired, OSError):
        return None
    return result.stdout if result.returncode == 0 else None


def node_address(name: str, env: Mapping[str, str], timeout: float = 10.0) -> str:
    """An address for the SLURM node ``name``: the name itself when it resolves, else the
    NodeAddr SLURM has for it (clusters where node names are not in DNS)."""
    try:
        socket.getaddrinfo(name, None)
        return name
    except socket.gaierror:
        pass
    if shutil.which("scontrol") is None:
        raise SlurmStepError(f"the step's first node {name!r} does not resolve and scontrol is not here to ask "
                             "SLURM its address: pass --rdzv-endpoint HOST:PORT")
    match = re.search(r"\bNodeAddr=(\S+)", scontrol("show", "node", name, env=env, timeout=timeout) or "")
    if not match:
        raise SlurmStepError(f"the step's first node {name!r} does not resolve and SLURM gave no address for it: "
                             "pass --rdzv-endpoint HOST:PORT")
    return match.group(1)
