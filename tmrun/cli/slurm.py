"""Defaults from a SLURM step: node count, rendezvous endpoint, run id, node rank."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

RDZV_BASE_PORT = 29400
OPS_BASE_PORT = 30400  # the leader's operations endpoint (tmrun-ctl): 30400 + job id mod 1000


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


@dataclass(frozen=True)
class SlurmDefaults:
    nnodes_total: int  # nodes in the step: actives plus standbys
    first_host: str
    rdzv_port: int
    run_id: str
    node_rank: int
    ops_port: int = 0  # where the leader's operations endpoint listens when that port is free


def slurm_defaults(env: Mapping[str, str]) -> SlurmDefaults | None:
    """The defaults a SLURM step implies, or None outside SLURM."""
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not job_id or not nodelist:
        return None
    hosts = expand_hostlist(nodelist)
    count_text = env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    nnodes = int(count_text) if count_text and count_text.isdigit() else len(hosts)
    step = env.get("SLURM_STEP_ID")
    run_id = f"slurm-{job_id}" + (f".{step}" if step else "")
    node_rank_text = env.get("SLURM_NODEID", "0")
    node_rank = int(node_rank_text) if node_rank_text.isdigit() else 0
    offset = int(job_id) % 1000 if job_id.isdigit() else 0
    return SlurmDefaults(nnodes, hosts[0], RDZV_BASE_PORT + offset, run_id, node_rank, OPS_BASE_PORT + offset)
