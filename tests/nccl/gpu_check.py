#!/usr/bin/env python
"""GPU-ONLY check of the tmrun NCCL transport.  Ran on one H200 on 2026-11-27 with NCCL 2.28.9 (docs/status.md):
every phase passed, the survivors aborting (not revoking) after the remote error.

Run on a machine with one (or more) NVIDIA GPU(s), after ``pip install nvidia-nccl-cu13``
and ``pip install --no-build-isolation .``:

    python tests/nccl/gpu_check.py [--device 0] [--timeout 60] [--big 262144]

It needs no torch: device memory is handled through ctypes on libcuda.so.1. It starts four
processes on the same GPU, each with its own ``NCCL_HOSTID`` so that NCCL treats them as
different hosts (it refuses two ranks on one GPU in one host) and connects them over sockets
on loopback (``NCCL_SOCKET_IFNAME=lo``, ``NCCL_IB_DISABLE=1`` unless set by the caller):

  phase 0  logical ranks 0, 1, 2 build a 3-rank communicator (unique id through a file store);
  phase 1  every collective (allreduce sum/prod/max/min/avg on 7 dtypes and several sizes,
           broadcast from each root, allgather, reduce-scatter, ring sendrecv, send/recv) is
           checked against a reference computed here;
  phase 2  rank 1 dies abruptly (os._exit, no cleanup); survivors 0 and 2 must get an
           NcclError / NcclTimeoutError from their next allreduce within the deadline, and
           their communicators must be revoked, not hung;
  phase 3  replacement with stock NCCL: ncclCommShrink (exclude logical 1) on the survivors,
           ncclCommGetUniqueId + ncclCommGrow with a standby process that takes logical rank 1
           (NCCL rank 2); the rank map must be [0, 2, 1]; phase-1 checks are rerun, so
           allgather / reduce-scatter / broadcast / sendrecv follow logical ranks;
  phase 4  fallback: a full re-init (new unique id, identity map) is built in the background
           while collectives keep running on the old communicator, then committed; phase-1
           checks are rerun; communicators are closed.

Exit status: 0 all checks passed, 1 a check failed, 77 skipped (no GPU / NCCL not usable).
A JSON summary (checks, timings, native stats) is printed last, and written to --json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

SKIP = 77
WORLD = 3
VICTIM = 1


# ---- a tiny file store (no torch needed) --------------------------------------------------


class FileStore:
    def __init__(self, root: str, timeout: float = 180.0) -> None:
        self.root = root
        self.timeout = timeout
        os.makedirs(root, exist_ok=True)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key.replace("/", "__"))

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        tmp = self._path(key) + f".tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, self._path(key))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = time.monotonic() + (timeout.total_seconds() if timeout else self.timeout)
        while not all(os.path.exists(self._path(k)) for k in keys):
            if time.monotonic() > limit:
                raise TimeoutError(f"store keys {keys} not set in time")
            time.sleep(0.01)

    def get(self, key: str) -> bytes:
        self.wait([key])
        with open(self._path(key), "rb") as f:
            return f.read()


# ---- device memory through the CUDA driver (ctypes) ---------------------------------------


class Cuda:
    def __init__(self, device: int) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        L = self.lib
        L.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
        L.cuMemFree_v2.argtypes = [ctypes.c_uint64]
        L.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
        L.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
        L.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        L.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        self._check(L.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self._check(L.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        self.ctx = ctypes.c_void_p()
        self._check(L.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), dev), "cuDevicePrimaryCtxRetain")
        self._check(L.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    @staticmethod
    def _check(r: int, what: str) -> None:
        if r != 0:
            raise RuntimeError(f"{what} failed with CUresult {r}")

    def alloc(self, nbytes: int) -> int:
        p = ctypes.c_uint64()
        self._check(self.lib.cuMemAlloc_v2(ctypes.byref(p), max(int(nbytes), 16)), "cuMemAlloc")
        return int(p.value)

    def free(self, ptr: int) -> None:
        self.lib.cuMemFree_v2(ptr)

    def h2d(self, ptr: int, data: bytes) -> None:
        if data:
            buf = ctypes.create_string_buffer(data, len(data))
            self._check(self.lib.cuMemcpyHtoD_v2(ptr, buf, len(data)), "cuMemcpyHtoD")

    def d2h(self, ptr: int, nbytes: int) -> bytes:
        if nbytes == 0:
            return b""
        buf = ctypes.create_string_buffer(nbytes)
        self._check(self.lib.cuMemcpyDtoH_v2(buf, ptr, nbytes), "cuMemcpyDtoH")
        return buf.raw


# ---- host encoding of test values ----------------------------------------------------------

SIZES = {"float32": 4, "float64": 8, "int32": 4, "int64": 8, "float16": 2, "bfloat16": 2, "uint8": 1}
FMT = {"float32": "f", "float64": "d", "int32": "i", "int64": "q", "float16": "e", "uint8": "B"}
FLOATS = {"float32", "float64", "float16", "bfloat16"}


def pack(dtype: str, values: list[float]) -> bytes:
    if dtype == "bfloat16":
        raw = struct.pack(f"<{len(values)}f", *values)
        return b"".join(raw[i + 2 : i + 4] for i in range(0, len(raw), 4))
    vals = [float(v) for v in values] if dtype in FLOATS else [int(v) for v in values]
    return struct.pack(f"<{len(values)}{FMT[dtype]}", *vals)


def unpack(dtype: str, data: bytes) -> list[float]:
    if dtype == "bfloat16":
        n = len(data) // 2
        return list(struct.unpack(f"<{n}f", b"".join(b"\0\0" + data[2 * i : 2 * i + 2] for i in range(n))))
    n = len(data) // SIZES[dtype]
    return list(struct.unpack(f"<{n}{FMT[dtype]}", data))


def contrib(rank: int, n: int, salt: int = 0) -> list[int]:
    """Small positive integers: sums and 3-way products are exact in every dtype used."""
    return [((i * 7 + rank * 3 + salt * 11) % 5) + 1 for i in range(n)]


def close_enough(dtype: str, got: list[float], want: list[float], exact: bool) -> bool:
    if len(got) != len(want):
        return False
    if exact:
        return all(g == w for g, w in zip(got, want))
    tol = {"float16": 1e-2, "bfloat16": 2e-2}.get(dtype, 1e-6)
    return all(abs(g - w) <= tol * max(1.0, abs(w)) for g, w in zip(got, want))


# ---- the checks ------------------------------------------------------------------------------


class Report:
    def __init__(self, who: str) -> None:
        self.who = who
        self.checks: list[dict] = []
        self.timings: dict[str, float] = {}
        self.notes: list[str] = []

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append({"who": self.who, "check": name, "ok": bool(ok), "detail": detail})
        print(f"[{self.who}] {'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
        return ok

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - every failure becomes a FAIL line
            self.check(name, False, f"{type(exc).__name__}: {exc}")
            traceback.print_exc()
            return None


def run_collectives(comm: Any, cu: Cuda, rep: Report, tag: str, big: int) -> None:
    c = comm.native
    me = comm.rank
    world = comm.size
    ranks = sorted(comm.rank_map)
    timeout = comm.timeout

    def roundtrip(dtype: str, send_vals: list[int], recv_n: int, op: Callable[[int, int], None]) -> list[float]:
        es = SIZES[dtype]
        sp = cu.alloc(len(send_vals) * es)
        rp = cu.alloc(recv_n * es)
        try:
            cu.h2d(sp, pack(dtype, send_vals))
            op(sp, rp)
            c.synchronize(0, timeout)
            return unpack(dtype, cu.d2h(rp, recv_n * es))
        finally:
            cu.free(sp)
            cu.free(rp)

    # allreduce: every dtype x op x size
    for dtype in SIZES:
        for op in ("sum", "prod", "max", "min", "avg"):
            if op == "avg" and dtype not in FLOATS:
                continue
            for n in (0, 1, 1031) + ((big,) if dtype == "float32" else ()):
                per_rank = [contrib(r, n) for r in ranks]
                cols = list(zip(*per_rank)) if n else []
                want = {
                    "sum": [sum(x) for x in cols],
                    "prod": [math.prod(x) for x in cols],
                    "max": [max(x) for x in cols],
                    "min": [min(x) for x in cols],
                    "avg": [sum(x) / len(x) for x in cols],
                }[op]
                got = rep.run(f"{tag}/allreduce/{dtype}/{op}/{n}", lambda: roundtrip(
                    dtype, contrib(me, n), n, lambda s, r: c.allreduce(s, r, n, dtype, op, 0)))
                if got is not None:
                    ok = close_enough(dtype, got, want, exact=(op != "avg"))
                    if not ok or n == 1031:  # keep the log short: one line per dtype/op
                        rep.check(f"{tag}/allreduce/{dtype}/{op}", ok, "" if ok else f"n={n} got {got[:5]} want {want[:5]}")

    n = 1031
    # broadcast from every logical root
    for root in ranks:
        vals = contrib(root, n) if me == root else [0] * n
        got = rep.run(f"{tag}/broadcast/root{root}", lambda: roundtrip(
            "float32", vals, n, lambda s, r: c.broadcast(s, r, n, "float32", root, 0)))
        if got is not None:
            rep.check(f"{tag}/broadcast/root{root}", got == [float(v) for v in contrib(root, n)])

    # allgather: chunk k of the output is logical rank ranks[k]'s data
    got = rep.run(f"{tag}/allgather", lambda: roundtrip(
        "int32", contrib(me, n), n * world, lambda s, r: c.allgather(s, r, n, "int32", 0)))
    if got is not None:
        want = [v for r in ranks for v in contrib(r, n)]
        rep.check(f"{tag}/allgather(logical order)", got == want)

    # reduce-scatter: input chunk j (for logical position j) = contrib(me, n, salt=j)
    send = [v for j in range(world) for v in contrib(me, n, salt=j)]
    got = rep.run(f"{tag}/reduce_scatter", lambda: roundtrip(
        "float32", send, n, lambda s, r: c.reduce_scatter(s, r, n, "float32", "sum", 0)))
    if got is not None:
        pos = ranks.index(me)
        want = [float(sum(col)) for col in zip(*[contrib(r, n, salt=pos) for r in ranks])]
        rep.check(f"{tag}/reduce_scatter(logical order)", got == want)

    # ring sendrecv by logical rank
    idx = ranks.index(me)
    dst, src = ranks[(idx + 1) % world], ranks[(idx - 1) % world]
    got = rep.run(f"{tag}/sendrecv", lambda: roundtrip(
        "int64", contrib(me, n), n, lambda s, r: c.sendrecv(s, n, dst, r, n, src, "int64", 0)))
    if got is not None:
        rep.check(f"{tag}/sendrecv(ring)", got == contrib(src, n))

    # plain send/recv: lowest logical rank -> highest
    lo, hi = ranks[0], ranks[-1]
    if me in (lo, hi):
        def p2p(s: int, r: int) -> None:
            if me == lo:
                c.send(s, n, "int32", hi, 0)
            else:
                c.recv(r, n, "int32", lo, 0)
        got = rep.run(f"{tag}/send-recv", lambda: roundtrip("int32", contrib(me, n), n, p2p))
        if got is not None and me == hi:
            rep.check(f"{tag}/send-recv({lo}->{hi})", got == contrib(lo, n))


# ---- worker processes ----------------------------------------------------------------------


def worker(role: str, rank: int, args: argparse.Namespace) -> int:
    from tmrun.comm import nccl as N

    store = FileStore(args.store, timeout=args.timeout * 3)
    rep = Report(f"{role}{rank}")
    out = os.path.join(args.store, f"result-{role}{rank}.json")

    def dump() -> None:
        with open(out, "w") as f:
            json.dump({"checks": rep.checks, "timings": rep.timings, "notes": rep.notes}, f)

    try:
        cu = Cuda(args.device)
        if role == "member":
            t0 = time.monotonic()
            comm = N.NcclComm(store, rank, WORLD, args.device, epoch=0, timeout=args.timeout)
            rep.timings["init_s"] = time.monotonic() - t0
            rep.check("init", comm.state == "ready" and comm.rank_map == [0, 1, 2], f"map={comm.rank_map}")
            run_collectives(comm, cu, rep, "initial", args.big)
            store.set(f"phase1-done/{rank}", b"1")
            if rank == VICTIM:
                store.wait([f"phase1-done/{r}" for r in range(WORLD)])
                rep.notes.append("victim exits abruptly (os._exit) without closing its communicator")
                dump()
                os._exit(0)
            # ---- phase 2: detect the dead peer
            store.wait([f"phase1-done/{r}" for r in range(WORLD)])
            time.sleep(2.0)  # let the victim exit
            n = 1 << 16
            sp = cu.alloc(4 * n)
            t0 = time.monotonic()
            err = None
            try:
                comm.native.allreduce(sp, sp, n, "float32", "sum", 0)
                comm.native.synchronize(0, args.fail_timeout)
            except N.NcclError as exc:
                err = exc
            rep.timings["failure_detect_s"] = time.monotonic() - t0
            rep.check("failure/detected", err is not None,
                      f"{type(err).__name__}: {err}" if err else "allreduce with a dead peer returned normally")
            # revoked where NCCL's revoke quiesces after a remote error; else aborted (NCCL 2.28.9
            # on an H200: the remote error outlived the revoke), and the plan is a re-init: either
            # way out of service, not hung
            rep.check("failure/communicator-out-of-service", comm.state in ("revoked", "aborted"),
                      f"state={comm.state}")
            store.set(f"state-after-failure/{rank}", comm.state.encode())
            # ---- phase 3: shrink + grow (or re-init if revoke did not work)
            survivors = [r for r in range(WORLD) if r != VICTIM]
            store.wait([f"state-after-failure/{r}" for r in survivors])
            states = {r: store.get(f"state-after-failure/{r}").decode() for r in survivors}
            plan = "grow" if all(s == "revoked" for s in states.values()) else "reinit"
            if rank == min(survivors):
                store.set("plan/1", plan.encode())
            rep.notes.append(f"survivor states after failure: {states}; plan: {plan}")
            t0 = time.monotonic()
            if plan == "grow":
                ok = rep.run("replace/shrink+grow", lambda: N.replace_by_shrink_grow(
                    comm, store, leaving=[VICTIM], epoch=1, failed=True) or True)
                rep.timings["shrink_grow_s"] = time.monotonic() - t0
                if ok:
                    rep.check("replace/rank-map", comm.rank_map == [0, 2, 1] and comm.rank == rank,
                              f"map={comm.rank_map} nccl_rank={comm.nccl_rank}")
            else:
                rep.run("replace/reinit(after failed revoke)", lambda: N.replace_by_reinit(
                    comm, store, epoch=1, world_size=WORLD))
                rep.timings["reinit_after_failure_s"] = time.monotonic() - t0
            cu.free(sp)
        else:  # the standby that takes logical rank VICTIM
            plan = store.get("plan/1").decode()
            t0 = time.monotonic()
            if plan == "grow":
                comm = N.NcclComm.join_by_grow(store, VICTIM, args.device, epoch=1, timeout=args.timeout)
                rep.check("join/grow", comm.rank_map == [0, 2, 1] and comm.nccl_rank == 2,
                          f"map={comm.rank_map} nccl_rank={comm.nccl_rank}")
            else:
                comm = N.NcclComm(store, VICTIM, WORLD, args.device, epoch=1, timeout=args.timeout)
                rep.check("join/reinit", comm.state == "ready")
            rep.timings["join_s"] = time.monotonic() - t0

        run_collectives(comm, cu, rep, "after-replace", args.big)

        # ---- phase 4: full re-init built in the background, committed at a safe point
        t0 = time.monotonic()
        N.replace_by_reinit(comm, store, epoch=2, world_size=WORLD, commit=False)
        busy = 0
        n = 1 << 12
        sp = cu.alloc(4 * n)
        flag = cu.alloc(4)
        cu.h2d(sp, pack("float32", [1.0] * n))
        while True:
            # Keep the old communicator busy while the new one is built. Every rank must run
            # the same number of collectives, so the decision to stop is itself an allreduce
            # (min over "my pending communicator is ready").
            comm.native.allreduce(sp, sp, n, "float32", "max", 0)
            cu.h2d(flag, pack("int32", [1 if comm.native.pending_ready() else 0]))
            comm.native.allreduce(flag, flag, 1, "int32", "min", 0)
            comm.native.synchronize(0, args.timeout)
            busy += 1
            if unpack("int32", cu.d2h(flag, 4))[0] == 1 or busy >= 100000:
                break
        cu.free(flag)
        cu.free(sp)
        rep.timings["reinit_background_s"] = time.monotonic() - t0
        rep.notes.append(f"{busy} allreduces ran on the old communicator while the new one was built")
        t1 = time.monotonic()
        comm.native.commit(args.timeout)
        rep.timings["reinit_commit_s"] = time.monotonic() - t1
        rep.check("reinit/commit", comm.rank_map == [0, 1, 2] and comm.nccl_rank == comm.rank,
                  f"map={comm.rank_map} allreduces-during-build={busy}")
        run_collectives(comm, cu, rep, "after-reinit", args.big)
        rep.notes.append(f"native stats: {comm.stats()}")
        comm.close(args.timeout)
        rep.check("close", comm.state == "closed")
    except Exception as exc:  # noqa: BLE001
        rep.check("worker", False, f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
    dump()
    return 0 if all(c["ok"] for c in rep.checks) else 1


# ---- driver --------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120.0, help="deadline of every NCCL operation (s)")
    ap.add_argument("--fail-timeout", type=float, default=30.0, help="deadline of the allreduce with a dead peer")
    ap.add_argument("--big", type=int, default=1 << 18, help="elements of the large float32 allreduce")
    ap.add_argument("--json", default="", help="also write the summary here")
    ap.add_argument("--worker", choices=["member", "joiner"], help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--store", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.rank, args)

    from tmrun.comm import nccl as N

    ok, reason = N.nccl_available()
    if not ok:
        print(f"SKIP: NCCL transport not usable here: {reason}")
        return SKIP
    print(f"NCCL transport: {reason}")
    store_dir = tempfile.mkdtemp(prefix="tmrun-gpu-check-")
    procs = []
    for role, rank in [("member", 0), ("member", 1), ("member", 2), ("joiner", VICTIM)]:
        env = dict(os.environ)
        env["NCCL_HOSTID"] = f"tmrun-gpu-check-{role}-{rank}"  # distinct "hosts" on one GPU
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_IB_DISABLE", "1")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", role, "--rank", str(rank),
               "--store", store_dir, "--device", str(args.device), "--timeout", str(args.timeout),
               "--fail-timeout", str(args.fail_timeout), "--big", str(args.big)]
        procs.append((f"{role}{rank}", subprocess.Popen(cmd, env=env)))
    limit = time.monotonic() + args.timeout * 8
    codes = {}
    for name, p in procs:
        try:
            codes[name] = p.wait(timeout=max(1.0, limit - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            codes[name] = "killed (hung past the overall limit)"
    summary: dict[str, Any] = {"exit_codes": codes, "results": {}}
    for name, _ in procs:
        path = os.path.join(store_dir, f"result-{name}.json")
        if os.path.exists(path):
            with open(path) as f:
                summary["results"][name] = json.load(f)
        else:
            summary["results"][name] = {"checks": [{"check": "result file", "ok": False}]}
    failed = [f"{n}:{c['check']}" for n, r in summary["results"].items() for c in r["checks"] if not c["ok"]]
    hung = [n for n, c in codes.items() if not isinstance(c, int)]
    summary["failed"] = failed
    summary["passed"] = sum(c["ok"] for r in summary["results"].values() for c in r["checks"])
    text = json.dumps(summary, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print("RESULT:", "PASS" if not failed and not hung else f"FAIL ({len(failed)} failed checks, hung: {hung})")
    return 0 if not failed and not hung else 1


if __name__ == "__main__":
    sys.exit(main())
