"""The device plane on a GPU: CUDA collectives on NCCL under tmrun, against torch's own NCCL (GPU only).

    python bench/gpu_nccl.py [--ranks 2] [--json gpu_nccl.json] [--quick]

Several ranks on the GPU(s) available (more ranks than GPUs: they share them, each process with
its own NCCL_HOSTID, TMRUN_NCCL_SHARED_GPU=1; that forces NCCL's socket transport, so (b) and (c)
then measure time slicing, not NCCL: the report says so). In one run:

(a) collectives x dtypes on the "tmrun" backend's device plane against exact references
    (allreduce sum/avg/max, broadcast from every root, all_gather_into_tensor,
    reduce_scatter_tensor, all_to_all_single, send/recv around the ring), and that they went
    through the plane (its counts), not through host staging;
(b) DDP step time: examples/train_inplace.py under tmrun (--standby 1) and under torchrun with
    backend "nccl", same model, same GPU(s), median step time of each (goal: within 2 %);
(c) allreduce bus bandwidth, 1 MiB to 1 GiB: the tmrun group against a torch "nccl" group in
    the same processes (goal: >= 0.95x);
(d) rank 1 SIGKILLed in backward under tmrun on NCCL: exit 0, bitwise equal to the reference run,
    with the recovery's lines (the example's downtime, the controller's phases);
(e) a planned migration (tm.migrate at a step): both members build the next generation's NCCL
    communicator before the switch (their "built ahead" lines), bitwise equal.

Writes a JSON report (--json). Exit status: 0 every check passed, 1 one failed, 77 no CUDA device.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
SKIP = 77
SIZES_MIB = (1, 4, 16, 64, 256, 1024)


# ----------------------------------------------------------------------------- rank processes
def _init(rank: int, world: int, port: int, on_cpu: bool = False):  # type: ignore[no-untyped-def]
    """One rank of the "tmrun" backend; ``on_cpu``: the plane's CPU test mode (gloo), which lets
    CI run (a)'s checks without a GPU (tests/bench/test_gpu_bench.py)."""
    if on_cpu:
        os.environ.update({"TMRUN_DEVICE_PLANE": "gloo", "GLOO_SOCKET_IFNAME": "lo"})
    import torch
    import torch.distributed as dist

    import tmrun  # noqa: F401  (the backend)

    if on_cpu:
        device = torch.device("cpu")
    else:
        count = torch.cuda.device_count()
        if world > count:
            os.environ["TMRUN_NCCL_SHARED_GPU"] = "1"
            from tmrun.comm.device_plane import share_gpu_if_asked

            share_gpu_if_asked()  # before torch's own NCCL group of (c) too
        device = torch.device("cuda", rank % count)
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=__import__("datetime").timedelta(seconds=120))
    dist.init_process_group("tmrun", store=store, rank=rank, world_size=world)
    return torch, dist, device


def rank_collectives(rank: int, world: int, port: int, on_cpu: bool = False) -> dict:
    torch, dist, device = _init(rank, world, port, on_cpu)
    from tmrun.comm import backend as tb

    failures: list[str] = []

    def check(name: str, got, want) -> None:  # type: ignore[no-untyped-def]
        if not torch.equal(got.cpu(), want.cpu()):
            failures.append(f"{name}: got {got.flatten()[:4].tolist()} want {want.flatten()[:4].tolist()}")

    n = world
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.uint8):
        d = str(dtype).split(".")[-1]
        t = torch.full((1000,), rank + 1, dtype=dtype, device=device)
        dist.all_reduce(t)
        check(f"allreduce sum {d}", t, torch.full((1000,), n * (n + 1) // 2, dtype=dtype))
        t = torch.full((7,), rank + 1, dtype=dtype, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        check(f"allreduce max {d}", t, torch.full((7,), n, dtype=dtype))
        if dtype.is_floating_point and not on_cpu:  # (gloo has no AVG)
            t = torch.full((9,), float(2 * rank), dtype=dtype, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.AVG)
            check(f"allreduce avg {d}", t, torch.full((9,), float(n - 1), dtype=dtype))
        for root in range(n):
            t = (torch.arange(33, device=device) * (rank + 1)).to(dtype)
            dist.broadcast(t, src=root)
            check(f"broadcast {d} from {root}", t, (torch.arange(33) * (root + 1)).to(dtype))
        out = torch.empty(3 * n, dtype=dtype, device=device)
        dist.all_gather_into_tensor(out, torch.full((3,), rank, dtype=dtype, device=device))
        check(f"all_gather {d}", out, torch.arange(n).repeat_interleave(3).to(dtype))
        out = torch.empty(2, dtype=dtype, device=device)
        dist.reduce_scatter_tensor(out, torch.arange(2 * n, device=device).to(dtype))
        check(f"reduce_scatter {d}", out, (torch.arange(2 * rank, 2 * rank + 2) * n).to(dtype))
        send = torch.full((n * 2,), rank, dtype=dtype, device=device)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        check(f"all_to_all {d}", recv, torch.arange(n).repeat_interleave(2).to(dtype))
        if n > 1:
            buf = torch.empty(5, dtype=dtype, device=device)
            mine = torch.full((5,), rank, dtype=dtype, device=device)
            right, left = (rank + 1) % n, (rank - 1) % n
            if os.environ.get("TMRUN_NCCL_SHARED_GPU") == "1" and not on_cpu:
                # ranks posing as hosts on one GPU: torch 2.11's lazy 2-rank P2P communicator
                # fails to bootstrap when both ranks send at once, on torch's own NCCL group too
                # (bench/gpu_p2p.py, torch-unbound-isend); in rank order it works
                from gpu_p2p import exchange_in_rank_order

                exchange_in_rank_order(rank, mine, buf, right, left)
            else:
                ops = [dist.P2POp(dist.isend, mine, right), dist.P2POp(dist.irecv, buf, left)]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
            check(f"send/recv {d}", buf, torch.full((5,), left, dtype=dtype))
    if not on_cpu:
        torch.cuda.synchronize()
    pg = tb.get_group()
    stats, plane = pg.stats(), pg.plane_counts()
    staged = stats["network_ops"] - stats["device_ops"]
    dist.destroy_process_group()
    return {"rank": rank, "failures": failures, "device_ops": stats["device_ops"], "tcp_ops": staged, "plane": plane}


def rank_bandwidth(rank: int, world: int, port: int, sizes: list[int]) -> dict:
    torch, dist, device = _init(rank, world, port)
    nccl = dist.new_group(backend="nccl")
    rows = []
    for mib in sizes:
        t = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32, device=device)
        iters = 3 if mib >= 256 else 10
        row = {"MiB": mib}
        for name, group in (("tmrun", None), ("nccl", nccl)):
            for _ in range(2):
                dist.all_reduce(t, group=group)
            torch.cuda.synchronize()
            dist.barrier()
            started = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(t, group=group)
            torch.cuda.synchronize()
            seconds = (time.perf_counter() - started) / iters
            row[f"{name}_busbw_GBps"] = round(2 * (world - 1) / world * t.numel() * 4 / seconds / 1e9, 3)
        row["ratio"] = round(row["tmrun_busbw_GBps"] / row["nccl_busbw_GBps"], 3) if row["nccl_busbw_GBps"] else 0
        rows.append(row)
        del t
    dist.destroy_process_group()
    return {"rank": rank, "rows": rows}


def spawn(mode: str, world: int, timeout: float, extra: list[str]) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, __file__, "--rank-mode", mode, "--rank", str(r), "--world", str(world),
                               "--port", str(port), *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True) for r in range(world)]
    results = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        text = out.decode(errors="replace")
        found = [json.loads(line) for line in text.splitlines() if line.startswith("{\"rank\"")]
        results.append(found[0] if found else {"error": text[-3000:], "exit": p.returncode})
    return results


# ----------------------------------------------------------------------------- whole jobs
def step_median(path: Path, skip: int = 5) -> float:
    times = [float(line.split()[1]) for line in path.read_text().splitlines()] if path.exists() else []
    gaps = [b - a for a, b in zip(times[skip:], times[skip + 1:])]
    return statistics.median(gaps) if gaps else float("nan")


def ddp_step_times(work: Path, args: argparse.Namespace, env: dict) -> dict:
    common = [str(ROOT / "examples" / "train_inplace.py"), "--device", "cuda", "--steps", str(args.steps),
              "--width", str(args.width), "--depth", str(args.depth), "--deterministic"]
    result = {}
    for name, launcher, extra_env in (
        ("tmrun", [sys.executable, "-m", "tmrun.cli.main", "--standalone", "--nproc-per-node", str(args.ranks),
                   "--standby", "1"], {}),
        ("torchrun", [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                      str(args.ranks)], {"TMRUN_BACKEND": "nccl"}),
    ):
        out = work / f"ddp-{name}"
        out.mkdir()
        cmd = [*launcher, *common, "--step-log", str(out / "steps-{rank}.log"), "--final", str(out / "final-{rank}")]
        with open(out / "log", "wb") as log:
            code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env={**env, **extra_env,
                                  "TMRUN_STATE_DIR": str(out / "state")}, timeout=args.timeout,
                                  start_new_session=True, check=False).returncode
        finals = [(out / f"final-{r}").read_text().strip() if (out / f"final-{r}").exists() else ""
                  for r in range(args.ranks)]
        result[name] = {"exit": code, "median_step_s": round(step_median(out / "steps-0.log"), 5),
                        "final": finals[0], "replicas_equal": bool(finals[0]) and len(set(finals)) == 1}
    t, r = result["tmrun"]["median_step_s"], result["torchrun"]["median_step_s"]
    result["tmrun_over_torchrun"] = round(t / r, 4) if r == r and r else None
    # the same training on torch's own NCCL group: the same bits (the plane changes no value)
    result["bitwise_equal_to_torchrun"] = (bool(result["tmrun"]["final"]) and result["tmrun"]["replicas_equal"]
                                           and result["tmrun"]["final"] == result["torchrun"]["final"])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-step", type=int, default=14)
    parser.add_argument("--job-steps", type=int, default=24, help="steps of the failure and migration runs (d), (e)")
    parser.add_argument("--job-step-time", type=float, default=1.0,
                        help="extra seconds a step in (d), (e): the event lands after the standby is warm")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--quick", action="store_true", help="bandwidth up to 64 MiB only")
    parser.add_argument("--parts", default="abcde",
                        help="which checks to run: a collectives, b DDP step time, c bandwidth, d failure, e migration")
    parser.add_argument("--json", default="")
    parser.add_argument("--keep", default="", help="keep the runs' logs in this folder")
    parser.add_argument("--rank-mode", default="", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_mode in ("collectives", "collectives-cpu"):
        print(json.dumps(rank_collectives(args.rank, args.world, args.port, args.rank_mode.endswith("cpu"))),
              flush=True)
        return 0
    if args.rank_mode == "bandwidth":
        sizes = [int(x) for x in args.sizes.split(",")]
        print(json.dumps(rank_bandwidth(args.rank, args.world, args.port, sizes)), flush=True)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return SKIP
    from gpu_inplace import migrated, replaced_in_place, run_job  # as the staging path's GPU check

    from tmrun.comm.nccl_runtime import loaded_library

    gpus = torch.cuda.device_count()
    shared = args.ranks > gpus
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8",  # --deterministic on CUDA
           **({"TMRUN_NCCL_SHARED_GPU": "1", "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo"} if shared else {})}
    if args.ranks + 1 > gpus:  # the standby of (b), (d), (e) has no spare GPU: it shares one
        env["TMRUN_STANDBY_SHARE_GPU"] = "1"
    os.environ.update(env)
    torch.zeros(1, device="cuda")
    report: dict = {"gpu": torch.cuda.get_device_name(0), "gpus": gpus, "ranks": args.ranks, "torch": torch.__version__,
                    "nccl": ".".join(map(str, torch.cuda.nccl.version())), "nccl_library": loaded_library(),
                    "shared_gpu": shared}
    print(f"{report['gpu']} x{gpus}, torch {report['torch']}, NCCL {report['nccl']}, {args.ranks} ranks"
          + (" sharing GPUs (socket transport: (b) and (c) measure time slicing)" if shared else ""), flush=True)
    ok = True
    parts = set(args.parts)
    if "a" in parts:
        report["collectives"] = spawn("collectives", args.ranks, args.timeout, [])
        good = all("failures" in r and not r["failures"] and r["device_ops"] > 0 and r["plane"]["builds"] == 1
                   for r in report["collectives"])
        ok &= good
        print(f"(a) collectives x dtypes: {'PASS' if good else 'FAIL'} {report['collectives']}", flush=True)
    if "c" in parts:
        sizes = [s for s in SIZES_MIB if not args.quick or s <= 64]
        report["bandwidth"] = spawn("bandwidth", args.ranks, args.timeout * 2, ["--sizes", ",".join(map(str, sizes))])
        rows = report["bandwidth"][0].get("rows", [])
        print("(c) allreduce bus bandwidth (GB/s), tmrun vs torch nccl:", flush=True)
        for row in rows:
            print(f"    {row['MiB']:>5} MiB  {row['tmrun_busbw_GBps']:>8}  {row['nccl_busbw_GBps']:>8}  {row['ratio']}x")
        ok &= bool(rows)
    if not parts & set("bde"):
        return _finish(report, ok, args)
    with tempfile.TemporaryDirectory(prefix="tmrun-gpu-nccl-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        if "b" in parts:
            report["ddp"] = ddp_step_times(work, args, env)
            print(f"(b) DDP median step: {report['ddp']}", flush=True)
            ok &= report["ddp"]["tmrun"]["exit"] == 0 and report["ddp"]["torchrun"]["exit"] == 0
            ok &= report["ddp"]["bitwise_equal_to_torchrun"]
        if not parts & set("de"):
            return _finish(report, ok, args)
        kill = str(args.kill_step)
        # a standby on a GPU is warm some 15 s after the start (CUDA, the model, its shadow steps):
        # slower steps let the failure and the migration find it warm
        jobs = argparse.Namespace(**{**vars(args), "steps": args.job_steps})
        slow = ["--step-time", str(args.job_step_time), "--deterministic"]
        runs = [run_job(work, "reference", jobs, [], slow),
                run_job(work, "failure", jobs, ["--inject-failure", f"rank=1,step={kill},at=backward"], slow),
                run_job(work, "migration", jobs, [], [*slow, "--migrate-at", kill])]
        logs = {r["name"]: Path(r["log_path"]).read_text(errors="replace") for r in runs}
    reference = runs[0]["final"]
    for r in runs:
        r["bitwise_equal"] = bool(reference) and r["final"] == reference and r["replicas_equal"]
        r["recovery_lines"] = re.findall(r"[^\n]*(?:ranks recovered|downtime|device plane)[^\n]*", logs[r["name"]])[-8:]
        ok &= r["exit"] == 0 and r["bitwise_equal"]
    runs[1]["in_place"] = replaced_in_place(runs[1], logs["failure"])
    runs[2]["migrated"] = migrated(logs["migration"])
    ok &= runs[1]["in_place"] and runs[2]["migrated"]
    ahead = re.findall(r"generation 1's communicator built ahead of the switch \(([\d.]+) s\)", logs["migration"])
    runs[2]["built_ahead_s"] = [float(x) for x in ahead]
    ok &= len(ahead) == 2
    report["jobs"] = runs
    for r in runs:
        print(f"({'d' if r['name'] == 'failure' else 'e' if r['name'] == 'migration' else '-'}) {r['name']}: exit "
              f"{r['exit']}, bitwise equal {r['bitwise_equal']}, {r['report']}")
        for line in r["recovery_lines"]:
            print(f"    {line[:200]}")
    print(f"(e) built ahead of the switch: {runs[2]['built_ahead_s']} s")
    return _finish(report, ok, args)


def _finish(report: dict, ok: bool, args: argparse.Namespace) -> int:
    report["ok"] = ok
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    print("\nPASS" if ok else "\nFAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
