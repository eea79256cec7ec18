"""Replicas agree, checked: at the end of every change of the group, each group of replicas (the
members with equal shard keys: every member under DDP, a shard's replicas under HSDP) compares
checksums of what it holds, its parameters and optimizer state.

Healing that missed a tensor (a module whose ``state_dict`` hooks returned copies used to leave
a joiner's weights at their fresh initialisation), a state hook that changes a weight, memory
damaged in a transfer: each leaves replicas that would train on apart, silently, to a final
state that differs from a run without the failure. Here they are caught at the change that
caused them: every member computes a CRC-32C of each tensor (the same walk on every member,
:meth:`tmrun.worker.tracked.TrackedState.replica_tensors`), one allgather of a digest per member
compares them, and only when a group disagrees a second exchange finds the first tensor that
differs and between which ranks. The job then stops (:class:`ReplicasDiverged`): it never
trains on. Buffers are not compared (some legitimately differ by rank: batch-norm statistics
under DDP without ``broadcast_buffers``), nor optimizer state that is still arriving (deferred
healing checks that part's CRC when it is read).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import torch

import tmrun_native
from tmrun.comm.native import as_buffer, crc32c_of


class ReplicasDiverged(RuntimeError):
    """Members that must hold the same state do not (one line: the tensor and the ranks)."""


@dataclass(frozen=True)
class Checked:
    groups: int  # replica groups compared (with two or more members)
    tensors: int  # tensors compared on this member
    nbytes: int  # bytes checksummed on this member
    seconds: float


def fingerprints(tensors: list[torch.Tensor]) -> list[int]:
    """CRC-32C of each tensor's bytes (device or non-contiguous tensors through a host copy)."""
    crcs = []
    for tensor in tensors:
        flat = tensor.detach()
        if flat.device.type != "cpu" or not flat.is_contiguous():
            flat = flat.to("cpu").contiguous()
        crcs.append(crc32c_of([flat.reshape(-1)]) if flat.numel() else 0)
    return crcs


def _digest(crcs: list[int]) -> int:
    return int.from_bytes(hashlib.sha256(repr(crcs).encode()).digest()[:8], "little") >> 1


def allgather_ints(comm: tmrun_native.Communicator, values: list[int]) -> list[list[int]]:
    """Every member's ``values`` (as many on each), by member."""
    mine = torch.tensor(values, dtype=torch.int64)
    every = torch.zeros(comm.world_size * len(values), dtype=torch.int64)
    out, dtype = as_buffer(every)
    inp, _ = as_buffer(mine)
    comm.allgather(out, inp, dtype=dtype)
    return every.view(comm.world_size, len(values)).tolist()


def disagreement(shard_keys: list[int], digests: list[int]) -> list[list[int]]:
    """The replica groups (members with equal shard keys) whose digests differ."""
    groups: dict[int, list[int]] = {}
    for member, key in enumerate(shard_keys):
        groups.setdefault(key, []).append(member)
    return [members for members in groups.values() if len({digests[m] for m in members}) > 1]


def first_difference(names: list[str], crcs_by_member: dict[int, list[int]]) -> tuple[str, list[int], list[int]]:
    """The first tensor whose CRCs differ within a group, and the members on each side (the
    side of the group's lowest member first)."""
    members = sorted(crcs_by_member)
    for index, name in enumerate(names):
        values = {m: crcs_by_member[m][index] for m in members}
        if len(set(values.values())) > 1:
            reference = values[members[0]]
            same = [m for m in members if values[m] == reference]
            return name, same, [m for m in members if values[m] != reference]
    return "(the number of tensors)", members[:1], members[1:]


def check(comm: tmrun_native.Communicator, shard_key: int, named: list[tuple[str, torch.Tensor]],
          what: str, later: frozenset[str] = frozenset(), arriving: bool = False) -> Checked:
    """Compare the replicas' checksums of ``named`` (every member calls this with the same walk).
    Raises :class:`ReplicasDiverged` on every member when any group disagrees; ``what`` names
    the change (for the line). ``later``: the tracked objects (the same on every member) whose
    tensors may still be arriving somewhere (names ``object.…``); ``arriving``: this member's are (a migration's joiner: its
    optimizer state is read in the background, checked by the handover's own CRC against the
    leaver's). A group with an arriving member compares the other tensors only, on every
    member alike."""
    started = time.monotonic()
    names = [name for name, _ in named]
    crcs = fingerprints([tensor for _, tensor in named])
    ready = [crc for name, crc in zip(names, crcs) if name.partition(".")[0] not in later]
    rows = allgather_ints(comm, [shard_key, _digest(crcs), len(crcs), _digest(ready), int(arriving)])
    keys = [row[0] for row in rows]
    partial = {key for key, row in zip(keys, rows) if row[4]}  # groups that compare what arrived only
    digests = [row[3] if key in partial else row[1] for key, row in zip(keys, rows)]
    diverged = disagreement(keys, digests)
    groups = sum(1 for key in set(keys) if keys.count(key) > 1)
    if diverged:
        # every member takes part in the second exchange (the same sequence of operations everywhere)
        longest = max(row[2] for row in rows)
        padded = allgather_ints(comm, crcs + [0] * (longest - len(crcs)))
        group = diverged[0]
        by_member = {m: padded[m][: rows[m][2]] for m in group}
        if keys[group[0]] in partial:  # what some member still receives is not compared
            kept = [i for i, name in enumerate(names) if name.partition(".")[0] not in later]
            by_member = {m: [c[i] for i in kept if i < len(c)] for m, c in by_member.items()}
            names = [names[i] for i in kept]
        name, same, other = first_difference(names, by_member)
        raise ReplicasDiverged(
            f"replicas disagree after {what}: tensor {name!r} differs between rank{'s' if len(same) > 1 else ''} "
            f"{', '.join(map(str, same))} and rank{'s' if len(other) > 1 else ''} {', '.join(map(str, other))}"
            + (f" (and {len(diverged) - 1} more replica group(s))" if len(diverged) > 1 else "")
            + "; the job stops (training on would give a wrong result)")
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    return Checked(groups=groups, tensors=len(named), nbytes=nbytes, seconds=time.monotonic() - started)
