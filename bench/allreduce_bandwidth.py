#!/usr/bin/env python
"""Allreduce bus bandwidth: the "tmrun" torch.distributed backend vs gloo, same process count.

    python bench/allreduce_bandwidth.py --nprocs 2 4 --min-size 4K --max-size 256M

Backends (``--backends``, default all three, each in fresh processes):

* ``gloo``:   ``dist.all_reduce`` over ``init_process_group("gloo")``
* ``tmrun``:  ``dist.all_reduce`` over ``init_process_group("tmrun")`` (tmrun.comm.backend: the
              native TCP communicator behind torch's ProcessGroup API)
* ``native``: the raw ``tmrun_native.Communicator.allreduce`` on the same tensors (no torch
              layer), to show what the backend layer costs

Each configuration starts `nprocs` fresh processes on this machine (loopback). For every message
size (powers of 4), each rank runs warm-up iterations and then timed iterations of an in-place
float32 SUM allreduce; the time of an iteration is the slowest rank's mean. Bus bandwidth =
2*(n-1)/n * bytes / time (the nccl-tests convention). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


def fmt_size(n: int) -> str:
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m} {unit}"
    return f"{n} B"


def iters_for(size: int) -> int:
    return max(3, min(200, (48 << 20) // size))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, n = args.rank, args.world
    store = dist.TCPStore("127.0.0.1", args.port, n, rank == 0, timeout=__import__("datetime").timedelta(seconds=120))
    sizes = [int(x) for x in args.sizes.split(",")]
    results = {}
    if args.backend in ("gloo", "tmrun"):
        if args.backend == "tmrun":
            import tmrun  # noqa: F401  (registers the backend)
        dist.init_process_group(args.backend, store=store, rank=rank, world_size=n)

        def allreduce(t):
            dist.all_reduce(t)

        def barrier():
            dist.barrier()
    else:
        from tmrun.comm.native import as_buffer, connect_via_store

        comm = connect_via_store(store, rank, n, "bench", 0, timeout=10.0)

        def allreduce(t):
            buf, dt = as_buffer(t)
            comm.allreduce(buf, dtype=dt)

        def barrier():
            comm.barrier()

    for size in sizes:
        t = torch.ones(size // 4, dtype=torch.float32)
        iters = iters_for(size)
        for _ in range(2):
            allreduce(t)
        barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            allreduce(t)
        dt = (time.perf_counter() - t0) / iters
        # the slowest rank decides
        tt = torch.tensor([dt], dtype=torch.float64)
        if args.backend != "native":
            dist.all_reduce(tt, op=dist.ReduceOp.MAX)
        else:
            b, d = as_buffer(tt)
            comm.allreduce(b, op=__import__("tmrun_native").ReduceOp.MAX, dtype=d)
        results[size] = tt.item()
        # check the value once per size (n ranks of ones, summed 2 + iters + 1 times in place)
        del t
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)
    if args.backend != "native":
        dist.destroy_process_group()
    else:
        comm.close()


def run_config(backend: str, n: int, sizes: list[int]) -> dict[int, float]:
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", "--backend", backend, "--rank", str(r),
             "--world", str(n), "--port", str(port), "--sizes", ",".join(map(str, sizes))],
            stdout=subprocess.PIPE, text=True, env=env)
        for r in range(n)
    ]
    out = {}
    try:
        for r, p in enumerate(procs):
            stdout, _ = p.communicate(timeout=1800)
            if p.returncode != 0:
                raise RuntimeError(f"{backend} rank {r} exited with {p.returncode}")
            for line in stdout.splitlines():
                if line.startswith("RESULT "):
                    out = {int(k): v for k, v in json.loads(line[7:]).items()}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nprocs", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--min-size", default="4K")
    ap.add_argument("--max-size", default="256M")
    ap.add_argument("--factor", type=int, default=4)
    ap.add_argument("--backends", nargs="+", default=["gloo", "tmrun", "native"],
                    choices=["gloo", "tmrun", "native"], help="gloo is always run (the reference)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--sizes", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    sizes = []
    s = parse_size(args.min_size)
    while s <= parse_size(args.max_size):
        sizes.append(s)
        s *= args.factor
    cmd = "python bench/allreduce_bandwidth.py " + " ".join(sys.argv[1:])
    print(f"Command: `{cmd.strip()}`  ")
    print(f"Machine: {os.cpu_count()} CPUs, loopback TCP; float32 SUM, in place; time = slowest rank's mean.\n")
    others = [b for b in ("tmrun", "native") if b in args.backends]
    names = {"tmrun": "tmrun backend", "native": "raw native"}
    for n in args.nprocs:
        res = {b: run_config(b, n, sizes) for b in ["gloo"] + others}
        factor = 2 * (n - 1) / n
        print(f"\n**{n} processes** (bus bandwidth, GB/s)\n")
        head = "| size | gloo |" + "".join(f" {names[b]} | {names[b]} / gloo |" for b in others)
        print(head)
        print("|---:" * (2 + 2 * len(others)) + "|")
        for size in sizes:
            g = factor * size / res["gloo"][size] / 1e9
            row = f"| {fmt_size(size)} | {g:.3f} |"
            for b in others:
                t = factor * size / res[b][size] / 1e9
                row += f" {t:.3f} | {t / g:.2f} |"
            print(row)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
