"""Point-to-point on a GPU: which send/recv paths work, torch's own NCCL group against the
"tmrun" backend's device plane (GPU only; the question docs/status.md left open).

    python bench/gpu_p2p.py [--json gpu_p2p.json] [--timeout 60]

Each case is a fresh pair of processes (two ranks; on one GPU they share it, each posing as a
host of its own, TMRUN_NCCL_SHARED_GPU=1) that exchange tensors both ways and check the values:

  torch-unbound-send    torch "nccl" group, no device_id: unbatched isend/irecv (a lazy 2-rank
                        communicator per pair)
  torch-unbound-isend   the same group, both ranks isend then irecv at once (small messages only:
                        what batch_isend_irecv does on a group that cannot coalesce)
  torch-bound-send      the same with init_process_group(device_id=...): over the collective
                        communicator
  torch-bound-batch     batch_isend_irecv on the bound torch group
  tmrun-send            the "tmrun" backend, unbatched send then recv in rank order
  tmrun-isend           the "tmrun" backend, both ranks isend then irecv at once (small messages)
  tmrun-batch           batch_isend_irecv on the "tmrun" backend (a ring of two)
  tmrun-pipeline        a 2-stage pipeline (torch.distributed.pipelining, GPipe, 4 microbatches)
                        on the "tmrun" backend against the same model on one process

Writes a JSON report (--json). Exit status: 0 when every tmrun case passed or failed where its
torch counterpart (BASELINE) failed too, 1 otherwise, 77 no CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIP = 77
CASES = ("torch-unbound-send", "torch-unbound-isend", "torch-bound-send", "torch-bound-batch", "tmrun-send",
         "tmrun-isend", "tmrun-batch", "tmrun-pipeline")

# what each tmrun case must match: the same calls on torch's own NCCL group (batch_isend_irecv: the
# bound group, which coalesces the batch into one NCCL group call)
BASELINE = {"tmrun-send": "torch-unbound-send", "tmrun-isend": "torch-unbound-isend",
            "tmrun-batch": "torch-bound-batch", "tmrun-pipeline": "torch-bound-batch"}


def exchange_in_rank_order(rank: int, mine, got, to: int, source: int) -> None:  # type: ignore[no-untyped-def]
    """Blocking send and receive around a ring, rank 0 sending first: no two ranks send to each
    other at once (which fails on one shared GPU, bench/gpu_nccl.py uses it there)."""
    import torch.distributed as dist

    if rank == 0:
        dist.send(mine, to)
        dist.recv(got, source)
    else:
        dist.recv(got, source)
        dist.send(mine, to)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(case: str, rank: int, port: int) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    world = 2
    if os.environ.get("GPU_P2P_ON_CPU") == "1":  # checks this script itself without a GPU (tmrun cases)
        device = torch.device("cpu")
    else:
        count = torch.cuda.device_count()
        if world > count:
            os.environ["TMRUN_NCCL_SHARED_GPU"] = "1"
            os.environ.setdefault("NCCL_HOSTID", f"{socket.gethostname()}-{os.getpid()}")
        device = torch.device("cuda", rank % count)
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
    if case.startswith("tmrun"):
        import tmrun  # noqa: F401  (the backend)

        dist.init_process_group("tmrun", store=store, rank=rank, world_size=world)
    else:
        bound = case.startswith("torch-bound")
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world,
                                device_id=device if bound else None)
    peer = 1 - rank
    if case == "tmrun-pipeline":
        _pipeline(rank, device)
    else:
        sizes = (5,) if case.endswith("isend") else (5, 1 << 20, 16 << 20)  # small (eager), large (rendezvous)
        for size in sizes:
            mine = torch.full((size,), float(rank + 1), device=device)
            got = torch.zeros(size, device=device)
            if case.endswith("isend"):
                works = [dist.isend(mine, peer), dist.irecv(got, peer)]
                for work in works:
                    work.wait()
            elif case.endswith("batch"):
                ops = [dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, got, peer)]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
            else:
                exchange_in_rank_order(rank, mine, got, peer, peer)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if not torch.equal(got.cpu(), torch.full((size,), float(peer + 1))):
                raise SystemExit(f"{case}: rank {rank} received {got[:3].tolist()} of {size}, wanted {peer + 1}")
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.destroy_process_group()
    print(f"{case}: rank {rank} ok", flush=True)


def _pipeline(rank: int, device) -> None:  # type: ignore[no-untyped-def]
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 64) for _ in range(4)]
    full = torch.nn.Sequential(*layers).to(device)
    x = torch.randn(16, 64, device=device)
    target = torch.randn(16, 64, device=device)
    loss_fn = torch.nn.MSELoss(reduction="sum")
    reference = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]).to(device)
    reference.load_state_dict(full.state_dict())
    ref_loss = loss_fn(reference(x), target)
    ref_loss.backward()
    part = torch.nn.Sequential(*list(full.children())[2 * rank: 2 * rank + 2])
    stage = PipelineStage(part, rank, 2, device)
    schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=loss_fn, scale_grads=False)  # a sum, as the reference
    losses: list = []
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=target, losses=losses)
    mine = list(part.parameters())
    theirs = list(reference.children())[2 * rank: 2 * rank + 2]
    want = [p.grad for layer in theirs for p in layer.parameters()]
    worst = max(float((p.grad - g).abs().max()) for p, g in zip(mine, want))
    if worst > 1e-4:
        raise SystemExit(f"tmrun-pipeline: rank {rank} gradients differ from one process's by {worst}")
    if rank == 1:
        total = float(sum(loss.item() for loss in losses))
        print(f"tmrun-pipeline: loss {total:.4f} against {ref_loss.item():.4f}", flush=True)
    dist.barrier()


def run_case(case: str, timeout: float, logs: Path | None = None) -> dict:
    port = _free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", NCCL_SOCKET_IFNAME=os.environ.get("NCCL_SOCKET_IFNAME", "lo"),
               NCCL_IB_DISABLE=os.environ.get("NCCL_IB_DISABLE", "1"), GLOO_SOCKET_IFNAME="lo")
    started = time.monotonic()
    procs = [subprocess.Popen([sys.executable, __file__, "--case", case, "--rank", str(r), "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for r in range(2)]
    outputs, codes = [], []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, timeout - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            out += "\n(timed out)"
        outputs.append(out)
        codes.append(proc.returncode)
    ok = all(code == 0 for code in codes)
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
        for rank, out in enumerate(outputs):
            (logs / f"{case}.rank{rank}.log").write_text(out)
    tail = [line for out in outputs for line in out.strip().splitlines()[-6:]]
    result = {"case": case, "ok": ok, "exit": codes, "seconds": round(time.monotonic() - started, 1), "tail": tail}
    print(f"{case}: {'PASS' if ok else 'FAIL'} exit {codes} in {result['seconds']} s", flush=True)
    if not ok:
        for line in tail:
            print(f"    {line}", flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--logs", type=Path, help="write each rank's whole output to this folder")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        _rank(args.case, args.rank, args.port)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return SKIP
    print(f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
          f"{torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}", flush=True)
    results = [run_case(case, args.timeout, args.logs) for case in args.cases.split(",")]
    by_case = {r["case"]: r for r in results}
    failed = []
    for r in results:
        if r["ok"] or not r["case"].startswith("tmrun"):
            continue
        baseline = by_case.get(BASELINE.get(r["case"], ""))
        if baseline is not None and not baseline["ok"]:
            r["torch_fails_too"] = baseline["case"]
            print(f"{r['case']}: fails where torch's own group fails too ({baseline['case']})", flush=True)
        else:
            failed.append(r["case"])
    if args.json:
        args.json.write_text(json.dumps({"results": results, "failed": failed}, indent=2))
    print(f"gpu_p2p.py: {'FAIL ' + ', '.join(failed) if failed else 'PASS'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
