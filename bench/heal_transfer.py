"""Healing on one host: the needy member reads the donor's memory, or receives it over the socket.

    python bench/heal_transfer.py --runs 3                     # 25M and 100M parameters (+ AdamW)
    python bench/heal_transfer.py --runs 1 --sizes 64x2        # a quick check (the e2e test)

Two processes on this host, connected by the native communicator over loopback: a donor (a
model of DEPTH x Linear(WIDTH), AdamW after one step: parameters and both moments, 12 bytes a
parameter) and a joiner (the same model, another initialisation, no optimizer state), which
heals from it with ``transfer.agree`` + ``transfer.heal``, as after a failure. Per run the
joiner's state is zeroed first; the time is the joiner's, from the agreement to ``heal``'s
return (the header, the state, its CRC-32C checked); the paths alternate (socket, memory,
socket, ...) after one unmeasured warm-up of each (the joiner's optimizer state is allocated in
the first). After every run the joiner's whole state must have the donor's CRC-32C.

Each run then times the replica check every change ends with (``tmrun.worker.replica_check``:
CRC-32C of every parameter and optimizer tensor on both members, one allgather of a digest),
beside the heal it follows: its cost, against the transfer's, in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PATHS = ("socket", "memory")


def _state_crc(state: Any) -> int:
    from tmrun.comm.native import crc32c_of
    from tmrun.comm.staging import HostBytes

    return crc32c_of(HostBytes([t for _, t in state.tensors()], load=True).views)


def member(rank: int, port: int, width: int, depth: int, order: list[str]) -> None:
    """One process: rank 0 donates, rank 1 heals; one JSON line per run on stdout."""
    import torch
    from torch.distributed import TCPStore

    from tmrun.comm.native import connect_via_store
    from tmrun.worker.replica_check import check
    from tmrun.worker.tracked import TrackedState
    from tmrun.worker.transfer import agree, heal

    donor = rank == 0
    torch.manual_seed(1 if donor else 2)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if donor:
        model(torch.randn(8, width)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    state = TrackedState()
    state.track(model=model, optimizer=optimizer)
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    comm = connect_via_store(store, rank, 2, "heal-bench", timeout=30.0)
    try:
        for run, path in enumerate(order):
            if not donor:
                for _, tensor in state.tensors():
                    tensor.detach().zero_()
            comm.barrier()
            started = time.perf_counter()
            plan = agree(comm, 1 if donor else -1, state.layout_digest(), not donor,
                         same_host_reads=path.endswith("memory"))
            healed = heal(comm, state, plan, {"committed_step": 1})
            seconds = time.perf_counter() - started
            comm.barrier()
            checked = check(comm, 0, state.replica_tensors(), f"run {run}")  # raises if the replicas differ
            print(json.dumps({"rank": rank, "run": run, "path": path, "seconds": seconds, "bytes": healed.nbytes,
                              "paths": sorted(healed.paths), "crc": _state_crc(state),
                              "check_seconds": checked.seconds, "check_bytes": checked.nbytes}), flush=True)
    finally:
        comm.close()


def measure(width: int, depth: int, order: list[str], timeout: float) -> list[dict[str, Any]]:
    """Run a donor and a joiner through ``order``; the joiner's rows, each checked against the donor."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    argv = ["--width", str(width), "--depth", str(depth), "--port", str(store.port), "--order", ",".join(order)]
    procs = [subprocess.Popen([sys.executable, __file__, "--member", str(rank), *argv], stdout=subprocess.PIPE,
                              text=True, cwd=ROOT) for rank in (0, 1)]
    try:
        outs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    finally:
        for proc in procs:  # only these two, by their pids
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if any(proc.returncode for proc in procs):
        raise SystemExit(f"a member failed (exit codes {[p.returncode for p in procs]})")
    donor, joiner = ([json.loads(line) for line in out.splitlines() if line.startswith("{")] for out in outs)
    for d, j in zip(donor, joiner, strict=True):
        want = j["path"].removeprefix("warmup-")
        if j["crc"] != d["crc"] or j["paths"] != [want] or d["paths"] != [want]:
            raise SystemExit(f"run {j['run']}: the joiner's state differs or took another path: {j} {d}")
    return joiner


def report(label: str, rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for path in PATHS:
        seconds = [r["seconds"] for r in rows if r["path"] == path]
        checks = [r["check_seconds"] for r in rows if r["path"] == path]
        nbytes = rows[0]["bytes"]
        best, median = min(seconds), statistics.median(seconds)
        check = statistics.median(checks)
        lines.append(f"| {label} | {nbytes / 1e6:.0f} MB | {path} | {len(seconds)} | {best:.3f} / {median:.3f} | "
                     f"{nbytes / best / 1e9:.2f} / {nbytes / median / 1e9:.2f} | {check:.3f} "
                     f"({check / median:.0%} of the heal) |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="measured runs per path")
    parser.add_argument("--sizes", default="2048x6,4096x6", help="WIDTHxDEPTH, comma separated")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--member", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--depth", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--order", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.member >= 0:
        member(args.member, args.port, args.width, args.depth, args.order.split(","))
        return
    order = [f"warmup-{p}" for p in PATHS] + [p for _ in range(args.runs) for p in PATHS]
    lines = ["| state | bytes | path | runs | seconds (min / median) | GB/s (at min / median) | replica check, "
             "seconds (median) |", "|---|---|---|---|---|---|---|"]
    for size in args.sizes.split(","):
        width, depth = (int(x) for x in size.split("x"))
        params = depth * (width * width + width)
        rows = measure(width, depth, order, args.timeout)
        label = f"{params / 1e6:.1f}M params + AdamW" if params >= 100_000 else f"{params} params + AdamW"
        lines += report(label, [r for r in rows if not r["path"].startswith("warmup")])
    print(f"{os.cpu_count()} CPUs; every run bitwise equal (CRC-32C of the whole state)")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
