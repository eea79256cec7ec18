"""One rank of a multi-process test of the "tmrun" torch.distributed backend.

    python backend_worker.py SCENARIO --rank R --world N --port P [--kill-step K] [--standby]

Prints JSON lines on stdout ({"event": ...}); exits 0 when the scenario's own checks passed.
Scenarios: api (dist.* helpers), ddp (train the same model over tmrun, gloo and tmrun again),
kill (allreduce loop; the test SIGKILLs the last rank), replace (DDP training where rank 1 dies
and a standby that ran in local mode takes its place through the backend's hooks). With
TMRUN_DEVICE_PLANE=gloo in the environment, CPU tensors go through the device plane (one gloo
group per generation) instead of the TCP communicator.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import hashlib
import json
import os
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist

import tmrun  # noqa: F401  (registers the backend)
from tmrun.comm import backend as tb
from tmrun.comm.native import join_via_store, prepare_replacement

TIMEOUT = datetime.timedelta(seconds=60)


def say(**kw) -> None:
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous()
        h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))  # no numpy in CI
    return h.hexdigest()


def store_for(args, is_master: bool | None = None) -> dist.TCPStore:
    master = args.rank == 0 if is_master is None else is_master
    return dist.TCPStore("127.0.0.1", args.port, None, master, timeout=TIMEOUT, wait_for_workers=False)


# ------------------------------------------------------------------------------------------- api
def scenario_api(args) -> None:
    r, n = args.rank, args.world
    dist.init_process_group("tmrun", store=store_for(args), rank=r, world_size=n, timeout=TIMEOUT)
    assert dist.get_backend() == "tmrun", dist.get_backend()
    assert dist.get_rank() == r and dist.get_world_size() == n
    pg = tb.get_group()
    assert pg.rank() == r

    # all_reduce, every op
    for op, ref in ((dist.ReduceOp.SUM, sum(range(1, n + 1))), (dist.ReduceOp.MAX, n), (dist.ReduceOp.MIN, 1),
                    (dist.ReduceOp.PRODUCT, 1 * 2 * 3 if n == 3 else None), (dist.ReduceOp.AVG, (n + 1) / 2)):
        t = torch.full((5,), float(r + 1))
        dist.all_reduce(t, op=op)
        if ref is not None:
            assert torch.allclose(t, torch.full((5,), float(ref))), (op, t)
    # broadcast from every root, odd sizes, int64
    for root in range(n):
        t = torch.arange(7, dtype=torch.int64) * (r + 1)
        dist.broadcast(t, src=root)
        assert torch.equal(t, torch.arange(7) * (root + 1))
    # all_gather (list), all_gather_into_tensor, empty
    outs = [torch.empty(3, dtype=torch.float64) for _ in range(n)]
    dist.all_gather(outs, torch.full((3,), float(r), dtype=torch.float64))
    assert all(torch.equal(o, torch.full((3,), float(i), dtype=torch.float64)) for i, o in enumerate(outs))
    big = torch.empty(2 * n)
    dist.all_gather_into_tensor(big, torch.full((2,), float(r)))
    assert torch.equal(big, torch.arange(n).repeat_interleave(2).float())
    empties = [torch.empty(0) for _ in range(n)]
    dist.all_gather(empties, torch.empty(0))
    # uint8 payloads of a common padded size (what all_gather_object does under the hood)
    payload = torch.zeros(16, dtype=torch.uint8)
    payload[: r + 1] = 7
    got = [torch.empty(16, dtype=torch.uint8) for _ in range(n)]
    dist.all_gather(got, payload)
    assert [int(g.sum()) for g in got] == [7 * (i + 1) for i in range(n)]
    # reduce_scatter (list and tensor)
    out = torch.empty(4)
    dist.reduce_scatter(out, [torch.full((4,), float(r + i)) for i in range(n)])
    assert torch.equal(out, torch.full((4,), float(sum(q + r for q in range(n)))))
    out2 = torch.empty(2, dtype=torch.int32)
    dist.reduce_scatter_tensor(out2, torch.arange(2 * n, dtype=torch.int32))
    assert torch.equal(out2, torch.arange(2 * r, 2 * r + 2, dtype=torch.int32) * n)
    # several tensors in one allreduce: each reduced on its own
    pair = [torch.full((3,), float(r + 1)), torch.full((5,), float(10 * (r + 1)))]
    dist.all_reduce_coalesced(pair)
    assert torch.equal(pair[0], torch.full((3,), float(n * (n + 1) / 2))), pair
    assert torch.equal(pair[1], torch.full((5,), float(10 * n * (n + 1) / 2))), pair
    # barrier, reduce, gather, scatter
    dist.barrier()
    t = torch.full((3,), float(r + 1))
    dist.reduce(t, dst=n - 1)
    if r == n - 1 or os.environ.get("TMRUN_DEVICE_PLANE") != "gloo":  # gloo's reduce leaves other ranks' undefined
        assert torch.equal(t, torch.full((3,), float(n * (n + 1) / 2) if r == n - 1 else float(r + 1)))
    g = [torch.empty(2) for _ in range(n)] if r == 0 else None
    dist.gather(torch.full((2,), float(r)), g, dst=0)
    if r == 0:
        assert [int(x[0]) for x in g] == list(range(n))
    s = torch.empty(3)
    dist.scatter(s, [torch.full((3,), float(i * 10)) for i in range(n)] if r == 1 else None, src=1)
    assert torch.equal(s, torch.full((3,), float(r * 10)))
    # send/recv around the ring, even ranks send first; then isend/irecv pairs
    right, left = (r + 1) % n, (r - 1) % n
    buf = torch.empty(5, dtype=torch.bfloat16)
    mine = torch.arange(5, dtype=torch.bfloat16) + r
    if r % 2 == 0:
        dist.send(mine, right, tag=3)
        dist.recv(buf, left, tag=3)
    else:
        dist.recv(buf, left, tag=3)
        dist.send(mine, right, tag=3)
    assert torch.equal(buf, torch.arange(5, dtype=torch.bfloat16) + left)
    if r in (0, 1):
        peer = 1 - r
        rb = torch.empty(4)
        works = ([dist.isend(torch.full((4,), 1.0 + r), peer), dist.irecv(rb, peer)] if r == 0 else
                 [dist.irecv(rb, peer), dist.isend(torch.full((4,), 1.0 + r), peer)])
        for w in works:
            w.wait()
        assert torch.equal(rb, torch.full((4,), 1.0 + peer))
    # async: several in flight, futures, then()
    ts = [torch.full((1000,), float(r + i)) for i in range(4)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    chained = works[-1].get_future().then(lambda f: f.value()[0] * 2)
    for i, w in enumerate(works):
        w.wait()
        assert torch.equal(ts[i], torch.full((1000,), float(sum(q + i for q in range(n)))))
    assert torch.equal(chained.wait(), ts[-1] * 2)
    # a subgroup over tmrun
    sub = dist.new_group([0, n - 1])
    if r in (0, n - 1):
        t = torch.ones(3)
        dist.all_reduce(t, group=sub)
        assert torch.equal(t, torch.full((3,), 2.0))
    # functional collectives (what torch.compile traces) resolve the group by name
    import torch.distributed._functional_collectives as fcol

    assert pg.group_name, "the group has a name"
    y = fcol.all_reduce(torch.full((3,), float(r + 1)), "sum", dist.group.WORLD)
    assert torch.equal(y, torch.full((3,), float(n * (n + 1) / 2)))
    # non-contiguous tensors are staged and written back
    nc = torch.arange(12, dtype=torch.float32).reshape(3, 4)[:, ::2] * (r + 1)
    dist.all_reduce(nc)
    assert torch.equal(nc, torch.arange(12, dtype=torch.float32).reshape(3, 4)[:, ::2] * (n * (n + 1) / 2))
    # unsupported things fail clearly, on the caller's thread, before any traffic
    for fn in (lambda: dist.all_reduce(torch.ones(2, dtype=torch.int16)),
               lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.BAND),
               lambda: dist.all_to_all_single(torch.empty(n + 1), torch.empty(n + 1))):  # not divisible
        try:
            fn()
        except (tb.UnsupportedError, ValueError, TypeError) as exc:
            assert "tmrun" in str(exc), exc
        else:
            raise AssertionError("expected an error")
    dist.barrier()
    counters, stats, plane = pg.counters(), pg.stats(), pg.plane_counts()
    dist.destroy_process_group()
    say(event="ok", collectives=counters["collectives"], p2p=counters["p2p_ops"], stats=stats, plane=plane)


# ------------------------------------------------------------------------------------------- ddp
def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def batch(rank: int, step: int) -> tuple:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def train(ddp: torch.nn.Module, rank: int, steps: int, first_step: int = 0, opt=None, on_step=None) -> tuple:
    opt = opt or torch.optim.SGD(ddp.parameters(), lr=0.05)
    grads = None
    for step in range(first_step, steps):
        x, y = batch(rank, step)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        if grads is None:
            grads = [p.grad.clone() for p in ddp.parameters()]
        opt.step()
        opt.zero_grad()
    return grads, opt


def scenario_ddp(args) -> None:
    from tmrun.comm.ddp import wrap

    r, n = args.rank, args.world
    torch.set_num_threads(1)
    dist.init_process_group("tmrun", store=store_for(args), rank=r, world_size=n, timeout=TIMEOUT)
    gloo = dist.new_group(backend="gloo")
    tm2 = dist.new_group(backend="tmrun")
    results = {}
    for name, group in (("tmrun", None), ("gloo", gloo), ("tmrun2", tm2)):
        model = make_model(seed=r)  # different on every rank: DDP's constructor broadcast fixes that
        if name == "gloo":
            ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.002)
        else:
            ddp = wrap(model, group=group, bucket_cap_mb=0.002)  # several buckets in flight
        grads, _ = train(ddp, r, steps=6)
        # parameters only: BatchNorm's running stats are per-rank (DDP broadcasts them before a forward)
        results[name] = ([p.detach().clone() for p in ddp.module.parameters()], grads)
    tm_params, tm_grads = results["tmrun"]
    gl_params, gl_grads = results["gloo"]
    max_param = max(float((a.double() - b.double()).abs().max()) for a, b in zip(tm_params, gl_params))
    max_grad = max(float((a - b).abs().max()) for a, b in zip(tm_grads, gl_grads))
    same = all(torch.equal(a, b) for a, b in zip(tm_params, results["tmrun2"][0]))
    dist.destroy_process_group()
    say(event="ok", digest=digest(tm_params), digest2=digest(results["tmrun2"][0]), gloo_digest=digest(gl_params),
        max_param_diff=max_param, max_grad_diff=max_grad, tmrun_runs_equal=same)


# ------------------------------------------------------------------------------------------- kill
def scenario_kill(args) -> None:
    """Ranks: 0 handler True, 1 no handler, 2 handler False (when n >= 4), last: the victim."""
    r, n = args.rank, args.world
    dist.init_process_group("tmrun", store=store_for(args), rank=r, world_size=n, timeout=TIMEOUT,
                            pg_options=tb.Options(native={"timeout": 2.0}))
    pg = tb.get_group()
    calls = []
    if r == 0:
        pg.set_failure_handler(lambda exc: calls.append(repr(exc)) or True)
    elif r == 2 and n >= 4:
        pg.set_failure_handler(lambda exc: calls.append(repr(exc)) or False)
    t = torch.ones(1 << 18)  # 1 MiB
    first = True
    while True:
        try:
            dist.all_reduce(t)
        except Exception as exc:  # noqa: BLE001
            say(event="error", type=type(exc).__name__, msg=str(exc), peer=getattr(exc, "peer", None),
                t=time.time(), handler_calls=len(calls))
            break
        if first:
            say(event="running")
            first = False
        if pg.aborted:
            t_abs = time.time()
            before = pg.counters()
            t0 = time.perf_counter()
            for _ in range(20):
                dist.all_reduce(t)
                dist.broadcast(t, 0)
                dist.barrier()
            w = dist.all_reduce(t, async_op=True)
            assert w.is_completed()
            elapsed = time.perf_counter() - t0
            after = pg.counters()
            say(event="absorbed", t=t_abs, later_s=elapsed, handler_calls=len(calls), handler_exc=calls[:1],
                bytes_delta=after["bytes_sent"] + after["bytes_recv"] - before["bytes_sent"] - before["bytes_recv"],
                stats=pg.stats())
            break
    sys.stdout.flush()
    os._exit(0)  # the group is broken: skip destroy_process_group's teardown


# ------------------------------------------------------------------------------------------- replace
def scenario_replace(args) -> None:
    """Ranks 0 and 1 train under DDP; a standby (--standby) warms up in local mode. With
    --kill-step K rank 1 dies in step K's forward; rank 0 absorbs the failure (handler), the
    standby joins as rank 1 through join_via_store + attach, and training redoes step K."""
    n, steps, kill = 2, 8, args.kill_step
    torch.set_num_threads(1)
    if args.standby:
        os.environ[tb.ENV_LOCAL] = "1"
        dist.init_process_group("tmrun", store=dist.HashStore(), rank=0, world_size=n, timeout=TIMEOUT)
        os.environ.pop(tb.ENV_LOCAL)
        pg = tb.get_group()
        assert pg.local and pg.comm is None
        ddp = torch.nn.parallel.DistributedDataParallel(make_model(seed=0))
        train(ddp, 0, steps=2)  # shadow steps: collectives served locally
        say(event="sandbox", bytes=pg.counters()["bytes_sent"], local_ops=pg.stats()["local_ops"],
            finite=all(bool(torch.isfinite(p).all()) for p in ddp.parameters()))
        store = store_for(args, is_master=False)
        tb.set_plane_store(dist.PrefixStore("plane", store))  # the sandbox's group has a local store
        store.wait(["test/promote"])
        step = int(store.get("test/promote"))
        comm = join_via_store(store, 1, n, pg.job_id, epoch=1, timeout=2.0)
        pg.attach(comm)
        pg.set_local(False)
        say(event="promoted", rank=dist.get_rank(), pg_rank=pg.rank())
        for p in ddp.module.parameters():  # state transfer (the runtime's job): from rank 0
            dist.broadcast(p.data, 0)
        rank = 1
    else:
        rank = args.rank
        dist.init_process_group("tmrun", store=store_for(args), rank=rank, world_size=n, timeout=TIMEOUT,
                                pg_options=tb.Options(native={"timeout": 2.0}))
        pg = tb.get_group()
        ddp = torch.nn.parallel.DistributedDataParallel(make_model(seed=rank))
        step = 0
        tb.set_plane_store(dist.PrefixStore("plane", store_for(args, is_master=False)))
        if rank == 0:
            pg.set_failure_handler(lambda exc: True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    while step < steps:
        x, y = batch(rank, step)
        if rank == 1 and step == kill and not args.standby:
            os.kill(os.getpid(), signal.SIGKILL)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        if pg.aborted:  # the step lost a peer: skip it, repair, redo it
            opt.zero_grad()
            store = store_for(args, is_master=False)
            store.set("test/promote", str(step))
            prepare_replacement(store, pg.comm, [1], new_epoch=1)
            pg.comm.commit()
            pg.clear_aborted()
            for p in ddp.module.parameters():
                dist.broadcast(p.data, 0)
            say(event="recovered", step=step, links=[(lk["peer"], lk["opened_epoch"]) for lk in pg.links()],
                stats=pg.stats())
            continue
        opt.step()
        opt.zero_grad()
        step += 1
    params = [p.detach().clone() for p in ddp.module.parameters()]
    dist.barrier()
    say(event="ok", digest=digest(params), rank=dist.get_rank(), stats=pg.stats(), plane=pg.plane_counts())
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--kill-step", type=int, default=-1)
    ap.add_argument("--standby", action="store_true")
    args = ap.parse_args()
    try:
        globals()[f"scenario_{args.scenario}"](args)
    except BaseException:
        say(event="failed", traceback=traceback.format_exc())
        sys.stdout.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
